"""``spatial.check_layouts``: a sweep of layouts on the test's pools (one per world size),
its progress line, its summary row, and its failure with the map of every layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

from harness._records.observe import quiet
from harness.case import SpatialCase
from harness.errors import ConfigError
from harness.layouts import LayoutResult, LayoutsReport, check_layouts, check_max_ranks
from harness.plugin._keys import _EQUIV_PROP, _settings_key
from harness.plugin.github import record_sweep
from harness.plugin.html_report import record_sweep as page_sweep
from harness.plugin.lease import PoolLease
from harness.plugin.pictures import sweep_failure
from harness.plugin.rank_output import RankOutput
from harness.plugin.summary import planned_layouts, progress, sweep_row
from harness.pool import RankPool, check_oversubscription
from harness.pool.launcher import LauncherRunner


class LayoutSweep:
    """One test's ``spatial.check_layouts``: runs on ``lease``'s pools, heard by ``output``."""

    def __init__(self, node: pytest.Item, lease: PoolLease, output: RankOutput) -> None:
        self._node = node
        self._lease = lease
        self._output = output

    def __call__(
        self,
        case: SpatialCase,
        *,
        max_ranks: int | None,
        timeout: float | None,
        locate: bool | None,
        exhaustive: bool | None,
        **kwargs: Any,
    ) -> LayoutsReport:
        """The sweep's report; the test fails with the smallest failing layout's report and
        the map of every layout if not ok."""
        __tracebackhide__ = True
        settings = self._node.config.stash[_settings_key]
        if max_ranks is not None:  # 0 or "3" is the caller's mistake, never the default
            check_max_ranks(max_ranks)
        top = max_ranks or settings.layouts or self._lease.ranks
        self._check_ranks(top)
        if exhaustive is None:
            exhaustive = settings.layouts_all
        if self._lease.launcher:  # only the launcher's world size can run: say so, never hide it
            kwargs.setdefault("world_sizes", [self._launched_size(top)])
        used: list[RankPool | LauncherRunner] = []

        def pools(size: int) -> RankPool | LauncherRunner:
            pool = self._lease.pool(size)
            used.append(pool)
            return pool

        with self._output.heard(used), quiet():  # its row is made here
            report = check_layouts(
                case,
                max_ranks=top,
                pools=pools,
                timeout=self._lease.seconds(timeout),
                locate=locate,
                exhaustive=exhaustive,
                oversubscribe=True,  # this machine's limit was checked above, naming the flag
                progress=self._progress(case, top, kwargs.get("world_sizes"), exhaustive),
                **kwargs,
            )
        self._record(report, case)
        if not report.ok:
            pytest.fail(sweep_failure(self._node, report), pytrace=False)
        return report

    def _launched_size(self, top: int) -> int:
        """The one world size a sweep may use under torchrun/srun: the launcher's; a skip
        naming why where the launcher started more ranks than the sweep may use."""
        ranks = self._lease.ranks
        if ranks > top:
            pytest.skip(
                f"check_layouts(max_ranks={top}): the launcher started {ranks} ranks, "
                f"more than any layout it may use; run it on the pool, or launch {top}"
            )
        return ranks

    def _record(self, report: LayoutsReport, case: SpatialCase) -> None:
        """A sweep's summary row, its GitHub summary and annotations, its report page row."""
        record_sweep(self._node, report, case)
        page_sweep(self._node, report)
        row = sweep_row(report)
        row["test"] = self._node.nodeid
        self._node.user_properties.append((_EQUIV_PROP, row))

    def _progress(
        self,
        case: SpatialCase,
        top: int,
        world_sizes: Iterable[int] | None,
        exhaustive: bool,
    ) -> Callable[[LayoutResult], None]:
        """A sweep's progress line, a layout at a time (``layouts: 5 of 13 ...``; a
        covering sweep's count is not known beforehand: ``layouts: 5 (covering, of 13)``)."""
        total = planned_layouts(case, top, world_sizes)
        if not total:
            of = ""
        else:
            of = f" of {total}" if exhaustive else f" (covering, of {total})"
        done = 0
        config = self._node.config

        def tell(result: LayoutResult) -> None:
            nonlocal done
            done += 1
            line = f"{case.label}: layouts: {done}{of} ({result.layout}: {result.status})"
            progress(config, line)

        return tell

    def _check_ranks(self, top: int) -> None:
        """Fail the test when this machine cannot run ``top`` ranks (without
        ``--spatial-oversubscribe``)."""
        __tracebackhide__ = True
        try:
            check_oversubscription(
                top,
                allow=self._node.config.getoption("spatial_oversubscribe"),
                how="pass --spatial-oversubscribe",
            )
        except ConfigError as exc:
            pytest.fail(f"check_layouts(max_ranks={top}): {exc}", pytrace=False)
