"""The ``spatial`` and ``golden`` fixtures and what they hand to a test."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    import torch

from harness._mutation.mode import current as mutant_mode
from harness._records.observe import quiet
from harness.case import SpatialCase
from harness.compare import Bound, Tolerance
from harness.equivalence import check_equivalence
from harness.errors import ConfigError, GoldenError, exception_summary
from harness.goldens import (
    GoldenResult,
    GoldenStore,
    check_report,
    golden_stem,
)
from harness.layouts import LayoutResult, LayoutsReport, check_layouts, check_max_ranks
from harness.plugin._keys import (
    _EQUIV_PROP,
    _GOLDEN_PROP,
    _registry_key,
    _settings_key,
    _skipped_key,
)
from harness.plugin.github import record_check, record_sweep
from harness.plugin.html_report import defer_figures
from harness.plugin.html_report import record_sweep as page_sweep
from harness.plugin.mutants import collect_sites
from harness.plugin.session import _session_key
from harness.plugin.summary import planned_layouts, progress, rollout_progress, sweep_row
from harness.pool import (
    MIN_TIMEOUT,
    PoolRegistry,
    RankPool,
    check_oversubscription,
    check_seconds,
)
from harness.pool.launcher import LauncherRegistry, LauncherRunner, WorldSizeMismatch
from harness.report import EquivalenceReport, SummaryRow

R = TypeVar("R")  # what a function run on the ranks returns


class SpatialFixture:
    """What a test sees as ``spatial``: the rank count and a way to run on the ranks."""

    def __init__(
        self,
        registry: PoolRegistry | LauncherRegistry,
        node: pytest.Item,
        ranks: int,
        timeout: float,
        golden: GoldenFixture,
        *,
        fresh: bool = False,
    ) -> None:
        self._registry = registry
        self._golden = golden
        self._node = node
        self.ranks = ranks
        self.timeout = timeout
        self.fresh = fresh
        self._used: dict[int, RankPool] = {}  # world size -> pool, for fresh tests
        self.used = False  # did the test run anything on the ranks?
        self._tmp: pytest.TempPathFactory | None = None

    def run(
        self,
        fn: Callable[..., R],
        *args: object,
        ranks: int | None = None,
        timeout: float | None = None,
        **kwargs: object,
    ) -> list[R]:
        """Run module-level ``fn(*args, **kwargs)`` on every rank; results in rank order."""
        __tracebackhide__ = True
        pool = self._pool(ranks)
        with self._heard([pool]):
            results: list[R] = pool.run(fn, *args, timeout=self._timeout(timeout), **kwargs)
        return results

    def check(
        self,
        case: SpatialCase,
        *,
        golden: bool | str = False,
        ranks: int | None = None,
        timeout: float | None = None,
        locate: bool | None = None,
        **kwargs: Any,
    ) -> EquivalenceReport:
        """``check_equivalence`` on the warm pool; fail with its table if not equivalent.

        With ``golden=True`` (or a name) the reference's loss, gradients, fields and
        parameters are then checked against this test's golden file; when both fail, the
        failure says both. ``locate``: as for ``check_equivalence`` (default: on failure, or
        always with ``--spatial-locate``).
        """
        __tracebackhide__ = True
        settings = self._node.config.stash[_settings_key]
        if settings.layouts and not mutant_mode().verdict_only:
            # --spatial-layouts N: the layouts first; the usual check (goldens, summary) after
            sweep = {k: v for k, v in kwargs.items() if k not in ("spatial_size", "mesh")}
            self.check_layouts(case, max_ranks=settings.layouts, timeout=timeout, **sweep)
        ranks = ranks or self.ranks
        pool = self._pool(ranks)
        if locate is None and (settings.calibrate or settings.locate):
            locate = True
        steps = int(kwargs.get("rollout") or 0)  # a long rollout says where it is
        with (
            self._heard([pool]),
            quiet(),  # its row is made here, with the golden's status
            rollout_progress(self._node.config, pool, case.label, steps),
        ):
            report = check_equivalence(
                case,
                ranks=ranks,
                pool=pool,
                timeout=self._timeout(timeout),
                locate=locate,
                **kwargs,
            )
        row = report.summary_row()
        row["test"] = self._node.nodeid
        if settings.calibrate and report.location is not None and report.tolerance is not None:
            rtols = {q: report.tolerance.bound(q).rtol for q in ("loss", "grad", "field")}
            row["calibration"] = report.location.calibration_lines(rtols)
        record_check(self._node, report, case, row)  # its user lines, its JUnit properties
        # said with the report's own failure, so neither hides the other
        golden_failure = self._golden_failure(report, golden, row, case, kwargs) if golden else ""
        self._node.user_properties.append((_EQUIV_PROP, row))
        failures = [] if report.ok else [self._report_failure(report)]
        if golden_failure:
            lead = "The golden check failed too:\n" if failures else ""
            failures.append(lead + golden_failure)
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)
        return report

    def _golden_failure(
        self,
        report: EquivalenceReport,
        golden: bool | str,
        row: SummaryRow,
        case: SpatialCase,
        kwargs: dict[str, Any],
    ) -> str:
        """The golden check of ``check``: its failure text ("" when it passed); its status
        goes on ``row``."""
        __tracebackhide__ = True
        name = golden if isinstance(golden, str) else None
        try:
            result = self._golden.check_report(
                report,
                name=name,
                allow_nonfinite=kwargs.get("allow_nonfinite") or case.expect_nonfinite,
                provenance={"seed": kwargs.get("seed", 0)},
            )
        except pytest.fail.Exception as exc:  # a corrupt or foreign golden
            return str(exc.msg)
        row["golden"] = str(result.status)  # plain text: rows travel to the controller
        return "" if result.ok else str(result)

    def _report_failure(self, report: EquivalenceReport) -> str:
        """A failing report's text, with the paths of its error maps and rollout curve under
        ``--spatial-plots``."""
        text = str(report)
        plots = self._node.config.getoption("spatial_plots")
        if plots and report.field_errors:
            maps = write_error_maps(report, plots, self._node.nodeid)
            text += "\n\nError maps:\n" + "\n".join(f"  {p}" for p in maps)
        if plots and report.rollout is not None and report.rollout.curve:
            curve = _drawn(
                "the rollout error curve",
                lambda: write_rollout_curve(report, plots, self._node.nodeid),
            )
            text += f"\n\nRollout error curve: {curve}"
        defer_figures(self._node, lambda out: self._figures(report, out))
        return text

    def _figures(self, report: EquivalenceReport, directory: str) -> list[str]:
        """A failing report's pictures drawn under ``directory`` (for ``--spatial-report``):
        paths, or ``Not plotted:`` lines."""
        nodeid = self._node.nodeid
        # a map per failing field, or its Not plotted line (write_error_maps says why)
        figures = write_error_maps(report, directory, nodeid) if report.field_errors else []
        if report.rollout is not None and report.rollout.curve:
            curve = lambda: write_rollout_curve(report, directory, nodeid)  # noqa: E731
            figures.append(_drawn("the rollout error curve", curve))
        return figures

    def check_layouts(
        self,
        case: SpatialCase,
        *,
        max_ranks: int | None = None,
        timeout: float | None = None,
        locate: bool | None = None,
        exhaustive: bool | None = None,
        **kwargs: Any,
    ) -> LayoutsReport:
        """``harness.check_layouts`` on the warm pools (one per world size): the covering set
        of the layouts up to ``max_ranks`` (default: ``--spatial-layouts``, else this test's
        rank count), every one with ``exhaustive=True`` (default: ``--spatial-layouts-all``);
        fail with the smallest failing layout's report and the map of every layout.
        Under torchrun/srun only the launcher's world size can run: its layouts are swept."""
        __tracebackhide__ = True
        settings = self._node.config.stash[_settings_key]
        if max_ranks is not None:  # 0 or "3" is the caller's mistake, never the default
            check_max_ranks(max_ranks)
        top = max_ranks or settings.layouts or self.ranks
        self._check_layout_ranks(top)
        if exhaustive is None:
            exhaustive = settings.layouts_all
        if self.launcher:  # only the launcher's world size can run here: say so, never hide it
            kwargs.setdefault("world_sizes", [self._launched_size(top)])
        used: list[RankPool | LauncherRunner] = []

        def pools(size: int) -> RankPool | LauncherRunner:
            pool = self._pool(size)
            used.append(pool)
            return pool

        with self._heard(used), quiet():  # its row is made here
            report = check_layouts(
                case,
                max_ranks=top,
                pools=pools,
                timeout=self._timeout(timeout),
                locate=locate,
                exhaustive=exhaustive,
                oversubscribe=True,  # this machine's limit was checked above, naming the flag
                progress=self._sweep_progress(case, top, kwargs.get("world_sizes"), exhaustive),
                **kwargs,
            )
        self._record_sweep(report, case)
        if not report.ok:
            defer_figures(self._node, lambda out: self._layout_figures(report, out))
            text = str(report)
            plots = self._node.config.getoption("spatial_plots")
            if plots:  # the map as a picture too
                stem = golden_stem(self._node.nodeid).replace("/", ".")
                out = Path(plots) / f"{stem}.layouts.png"
                path = _drawn("the layout map", lambda: str(report.plot(out)))
                text += f"\n\nLayout map: {path}"
            pytest.fail(text, pytrace=False)
        return report

    def _launched_size(self, top: int) -> int:
        """The one world size a sweep may use under torchrun/srun: the launcher's; a skip
        naming why where the launcher started more ranks than the sweep may use."""
        if self.ranks > top:
            pytest.skip(
                f"check_layouts(max_ranks={top}): the launcher started {self.ranks} ranks, "
                f"more than any layout it may use; run it on the pool, or launch {top}"
            )
        return self.ranks

    def _record_sweep(self, report: LayoutsReport, case: SpatialCase) -> None:
        """A sweep's summary row, its GitHub summary and annotations, its report page row."""
        record_sweep(self._node, report, case)
        page_sweep(self._node, report)
        row = sweep_row(report)
        row["test"] = self._node.nodeid
        self._node.user_properties.append((_EQUIV_PROP, row))

    def _layout_figures(self, report: LayoutsReport, directory: str) -> list[str]:
        """A failing sweep's pictures: its layout map, then the smallest failing layout's."""
        stem = golden_stem(self._node.nodeid).replace("/", ".")
        out = Path(directory) / f"{stem}.layouts.png"
        figures = [_drawn("the layout map", lambda: str(report.plot(out)))]
        smallest = report.smallest_report
        return figures + (self._figures(smallest, directory) if smallest is not None else [])

    def _sweep_progress(
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

        def tell(result: LayoutResult) -> None:
            nonlocal done
            done += 1
            line = f"{case.label}: layouts: {done}{of} ({result.layout}: {result.status})"
            progress(self._node.config, line)

        return tell

    def _check_layout_ranks(self, top: int) -> None:
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

    def _timeout(self, timeout: float | None) -> float:
        seconds = timeout or self.timeout
        cap = mutant_mode().timeout  # a mutant's rerun: a shorter limit
        return min(seconds, cap) if cap else seconds

    def pool(self, ranks: int | None = None) -> RankPool | LauncherRunner:
        """The warm ``RankPool`` (or, under torchrun/srun, the in-place runner) for ``ranks``.

        Pass it as ``pool=`` to ``check_equivalence`` to get the report without failing.
        """
        return self._pool(ranks)

    @property
    def launcher(self) -> bool:
        """True when pytest runs under torchrun or srun (functions run in place)."""
        return isinstance(self._registry, LauncherRegistry)

    def _pool(self, ranks: int | None) -> RankPool | LauncherRunner:
        self.used = True
        size = ranks or self.ranks
        try:
            pool = self._registry.get(size)
        except WorldSizeMismatch as exc:
            pytest.skip(f"{exc} (run it without torchrun/srun, or with that many ranks)")
        if self.fresh and size not in self._used and isinstance(pool, RankPool):
            pool.discard()  # brand-new rank processes: no module globals of earlier tests
            self._used[size] = pool
        return pool

    def discard_used(self) -> None:
        """After a fresh test: its rank processes go with it."""
        for pool in self._used.values():
            pool.discard()
        self._used.clear()

    @contextlib.contextmanager
    def _heard(self, pools: list[RankPool | LauncherRunner]) -> Iterator[None]:
        """Whatever the ranks of ``pools`` do inside (a list the block may still add to):
        what they printed attached to the test, and the collective sites they reached kept
        for mutation testing."""
        try:
            yield
        finally:
            for pool in dict.fromkeys(pools):
                self._attach_output(pool.last_outputs)
                collect_sites(self._node, pool)

    def _attach_output(self, outputs: list[str]) -> None:
        """What each rank printed, as a report section; long output is cut to its first and
        last lines, and the whole of it saved to a file that the section names."""
        self.used = True
        for rank, text in enumerate(outputs):
            if not text.strip():
                continue
            if len(text) > OUTPUT_LIMIT:
                path = (
                    self._output_dir() / f"{golden_stem(self._node.nodeid).replace('/', '.')}"
                    f".rank{rank}.txt"
                )
                path.write_text(text)
                text = _cut(text, path)
            self._node.add_report_section("call", f"rank {rank} stdout", text)

    def _output_dir(self) -> Path:
        assert self._tmp is not None
        path = self._tmp.getbasetemp() / "spatial-output"
        path.mkdir(parents=True, exist_ok=True)
        return path


#: Rank output longer than this (characters) is cut in the report; the whole is saved.
OUTPUT_LIMIT = 8000


def _cut(text: str, path: Path) -> str:
    """The head and tail of a long output, and where the whole of it is."""
    head, tail = text[: OUTPUT_LIMIT // 4], text[-(OUTPUT_LIMIT * 3 // 4) :]
    left_out = len(text) - len(head) - len(tail)
    return (
        f"{head}\n... {left_out} characters left out; the whole output ({len(text)} "
        f"characters) is in {path} ...\n{tail}"
    )


class SpatialUnusedWarning(pytest.PytestWarning):
    """A test asked for the ``spatial`` fixture but never ran anything on the ranks."""


def _marker_options(
    request: pytest.FixtureRequest, marker: pytest.Mark, ranks: int, timeout: float
) -> tuple[int, float, bool]:
    """``@pytest.mark.spatial(ranks=, timeout=, fresh=)``, each checked as the command
    line's options are (the same oversubscription rule for ranks); one clear line naming
    the marker otherwise."""
    __tracebackhide__ = True
    unknown = set(marker.kwargs) - {"ranks", "timeout", "fresh"}
    if unknown:
        pytest.fail(
            f"@pytest.mark.spatial got unknown option(s) {sorted(unknown)}; it takes ranks=, "
            "timeout= and fresh=",
            pytrace=False,
        )
    raw = marker.kwargs.get("ranks", marker.args[0] if marker.args else None)
    if raw is not None:
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            pytest.fail(
                f"@pytest.mark.spatial(ranks={raw!r}): ranks must be an integer >= 1, e.g. ranks=4",
                pytrace=False,
            )
        try:
            check_oversubscription(
                raw,
                allow=request.config.getoption("spatial_oversubscribe"),
                how="pass --spatial-oversubscribe",
            )
        except ConfigError as exc:
            pytest.fail(f"@pytest.mark.spatial(ranks={raw}): {exc}", pytrace=False)
        ranks = raw
    raw_timeout = marker.kwargs.get("timeout")
    if raw_timeout is not None:
        try:
            timeout = check_seconds(raw_timeout, "timeout", minimum=MIN_TIMEOUT)
        except ConfigError as exc:
            pytest.fail(f"@pytest.mark.spatial(timeout={raw_timeout!r}): {exc}", pytrace=False)
    return ranks, timeout, bool(marker.kwargs.get("fresh", False))


@pytest.fixture
def spatial(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpatialFixture]:
    """Run functions on a warm group of gloo ranks: ``spatial.run(fn, *args)``."""
    registry = request.config.stash[_registry_key]
    marker = request.node.get_closest_marker("spatial")
    ranks = registry.default_ranks
    timeout = registry.timeout
    fresh = False
    if marker is not None:
        ranks, timeout, fresh = _marker_options(request, marker, ranks, timeout)
    if fresh and isinstance(registry, LauncherRegistry):
        pytest.skip(
            "spatial(fresh=True) needs brand-new rank processes; under torchrun/srun "
            "the ranks are the launcher's"
        )
    fixture = SpatialFixture(
        registry, request.node, ranks, timeout, _golden_fixture(request), fresh=fresh
    )
    fixture._tmp = tmp_path_factory
    yield fixture
    fixture.discard_used()  # a fresh test's module globals stay with it
    # a test that skipped itself (pytest.skip before the ranks, an xfail) ran nothing on purpose
    if not fixture.used and not request.node.stash.get(_skipped_key, False):
        request.node.warn(
            SpatialUnusedWarning(
                "this test takes the spatial fixture but never ran anything on the ranks (no "
                "spatial.run, spatial.check or spatial.pool): it checked nothing partitioned. "
                "Call spatial.check(case), or drop the fixture."
            )
        )


class GoldenFixture:
    """What a test sees as ``golden``: ``golden.check(tensors, name=None, tolerance=None)``."""

    def __init__(self, store: GoldenStore, node: pytest.Item) -> None:
        self._store = store
        self._node = node

    def check(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        name: str | None = None,
        tolerance: Bound | tuple[float, float] | None = None,
        allow_nonfinite: bool = False,
    ) -> GoldenResult:
        """Compare ``tensors`` ({name: tensor}) with this test's golden; fail if they differ.

        ``tolerance`` is a ``Bound`` or ``(rtol, atol)``; the default is the field tolerance
        of the tensors' dtype (``Tolerance.for_dtype``). A NaN or inf on either side fails
        (and is never written) unless ``allow_nonfinite``.
        """
        __tracebackhide__ = True
        if not tensors:
            raise ConfigError("golden.check needs at least one tensor")
        if tolerance is None:
            bound = Tolerance.for_dtype(next(iter(tensors.values())).dtype).field
        else:
            bound = tolerance if isinstance(tolerance, Bound) else Bound(*tolerance)
        result = self.check_tensors(
            tensors, name=name, bound=bound, allow_nonfinite=allow_nonfinite
        )
        if not result.ok:
            pytest.fail(str(result), pytrace=False)
        return result

    def check_tensors(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        name: str | None,
        bound: Bound,
        provenance: dict[str, object] | None = None,
        refuse_update: str | None = None,
        allow_nonfinite: bool = False,
    ) -> GoldenResult:
        """``check``'s comparison, returned rather than failed on: ``tensors`` against the
        golden ``name`` within ``bound``; under ``--update-goldens`` written (with
        ``provenance``), or kept as it is when ``refuse_update`` says why."""
        __tracebackhide__ = True
        path = self._path(name)
        if refuse_update and self._store.update:
            result = self._store.not_updated(path, refuse_update)
        else:
            try:
                result = self._store.check(
                    path,
                    tensors,
                    bound=bound,
                    provenance=provenance,
                    allow_nonfinite=allow_nonfinite,
                )
            except GoldenError as exc:  # corrupt, foreign, a directory, a full disk
                pytest.fail(str(exc), pytrace=False)
        self._record(path, result)
        return result

    def check_report(
        self,
        report: EquivalenceReport,
        *,
        name: str | None,
        allow_nonfinite: bool,
        provenance: dict[str, object],
    ) -> GoldenResult:
        """``report``'s reference against this test's golden, by the one golden policy
        (``harness.goldens.check_report``)."""
        __tracebackhide__ = True
        path = self._path(name)
        try:
            result = check_report(
                self._store, path, report, provenance=provenance, allow_nonfinite=allow_nonfinite
            )
        except GoldenError as exc:  # corrupt, foreign, a directory, a full disk
            pytest.fail(str(exc), pytrace=False)
        self._record(path, result)
        return result

    def _path(self, name: str | None) -> Path:
        """This test's golden path, claimed for it: another test mapping to the same file
        fails here, naming both, before it reads or writes it."""
        __tracebackhide__ = True
        path = self._store.path_for(self._node.nodeid, name)
        try:
            self._store.claim(path, self._node.nodeid)
        except GoldenError as exc:
            pytest.fail(str(exc), pytrace=False)
        return path

    def _record(self, path: Path, result: GoldenResult) -> None:
        # plain text: user properties travel to xdist's controller
        # (what a write changed rides along, for the review summary)
        change = None if result.change is None else result.change.plain()
        self._node.user_properties.append((_GOLDEN_PROP, (str(path), str(result.status), change)))


def write_error_maps(report: EquivalenceReport, directory: str, nodeid: str) -> list[str]:
    """One PNG per failing field of ``report`` under ``directory``; returns the paths, and a
    ``Not plotted:`` line for a field whose map could not be drawn (a picture is a diagnosis:
    it never takes the verdict down)."""
    out = Path(directory)
    stem = golden_stem(nodeid).replace("/", ".")
    from harness.report import plots as plots

    paths = []
    for fe in report.field_errors:
        title = f"{report.case}: |partitioned - reference| of {fe.name!r}, step {fe.step}"
        try:  # every field gets its map, whatever its layout, or says why not
            path = plots.plot_field_error(
                fe,
                out / f"{stem}.{fe.name}.step{fe.step}.png",
                title=title,
                spatial_size=report.spatial_size,
                latitudes=report.latitudes,
            )
        except Exception as exc:  # noqa: BLE001 - any failure: said, and the report stands
            paths.append(
                f"Not plotted: field {fe.name!r}, step {fe.step} ({exception_summary(exc)})"
            )
        else:
            paths.append(str(path))
    return paths


def _drawn(what: str, draw: Callable[[], str]) -> str:
    """The path ``draw`` wrote, or a ``Not plotted:`` line: a picture is a diagnosis, and
    never takes the failure it illustrates down."""
    try:
        return draw()
    except Exception as exc:  # noqa: BLE001 - any failure: said, and the report stands
        return f"Not plotted: {what} ({exception_summary(exc)})"


def write_rollout_curve(report: EquivalenceReport, directory: str, nodeid: str) -> str:
    """The rollout's per-step error curve of ``report`` as a PNG under ``directory``."""
    from harness.rollout import plot_rollout

    assert report.rollout is not None
    stem = golden_stem(nodeid).replace("/", ".")
    path = Path(directory) / f"{stem}.rollout.png"
    title = f"{report.case}: rollout of {report.rollout.steps} steps"
    return str(plot_rollout(report.rollout, path, title=title))


def _golden_fixture(request: pytest.FixtureRequest) -> GoldenFixture:
    return GoldenFixture(request.config.stash[_session_key].goldens, request.node)


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> GoldenFixture:
    """Check tensors against this test's ``.pt`` golden: ``golden.check({"loss": t})``."""
    return _golden_fixture(request)
