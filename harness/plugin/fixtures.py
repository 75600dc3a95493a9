"""The ``spatial`` and ``golden`` fixtures: the marker's options read, and the object a test
sees as ``spatial``, a thin face over one object per job (``lease``: which pool, its time
limit; ``rank_output``: what the ranks printed; ``check``: ``spatial.check`` with its golden;
``sweep``: ``spatial.check_layouts``; ``pictures``: a failure's maps)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from harness._mutation.mode import current as mutant_mode
from harness.case import SpatialCase
from harness.layouts import LayoutsReport
from harness.plugin._keys import _registry_key, _settings_key, _skipped_key
from harness.plugin.check import EquivalenceCheck
from harness.plugin.golden_fixture import GoldenFixture
from harness.plugin.lease import PoolLease
from harness.plugin.marker import read_marker
from harness.plugin.rank_output import RankOutput
from harness.plugin.session import _session_key
from harness.plugin.sweep import LayoutSweep
from harness.pool import PoolRegistry, RankPool
from harness.pool.launcher import LauncherRegistry, LauncherRunner
from harness.report import EquivalenceReport

R = TypeVar("R")  # what a function run on the ranks returns


class SpatialFixture:
    """What a test sees as ``spatial``: the rank count and a way to run on the ranks.

    A face over one object per job, which it composes and forwards to: ``PoolLease`` (which
    pool, its time limit, fresh ranks), ``RankOutput`` (what the ranks printed),
    ``EquivalenceCheck`` (``check``, with its golden) and ``LayoutSweep``
    (``check_layouts``)."""

    def __init__(
        self,
        registry: PoolRegistry | LauncherRegistry,
        node: pytest.Item,
        ranks: int,
        timeout: float,
        golden: GoldenFixture,
        *,
        fresh: bool = False,
        tmp: pytest.TempPathFactory | None = None,
    ) -> None:
        self._lease = PoolLease(registry, ranks, timeout, fresh=fresh)
        self._output = RankOutput(node, tmp)  # tmp: where long rank output is saved
        self._check = EquivalenceCheck(node, self._lease, self._output, golden)
        self._sweep = LayoutSweep(node, self._lease, self._output)
        self._node = node

    @property
    def ranks(self) -> int:
        """The test's rank count (``@pytest.mark.spatial(ranks=)``, else ``--spatial-ranks``)."""
        return self._lease.ranks

    @ranks.setter
    def ranks(self, ranks: int) -> None:
        self._lease.ranks = ranks

    @property
    def timeout(self) -> float:
        """A run's time limit in seconds (the marker's ``timeout=``, else ``--spatial-timeout``)."""
        return self._lease.timeout

    @timeout.setter
    def timeout(self, timeout: float) -> None:
        self._lease.timeout = timeout

    @property
    def fresh(self) -> bool:
        """True for ``@pytest.mark.spatial(fresh=True)``: brand-new rank processes."""
        return self._lease.fresh

    @property
    def used(self) -> bool:
        """Did the test run anything on the ranks?"""
        return self._lease.used

    @property
    def launcher(self) -> bool:
        """True when pytest runs under torchrun or srun (functions run in place)."""
        return self._lease.launcher

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
        pool = self._lease.pool(ranks)
        with self._output.heard([pool]):
            results: list[R] = pool.run(fn, *args, timeout=self._lease.seconds(timeout), **kwargs)
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
        always with ``--spatial-locate``). Under ``--spatial-layouts N`` the layouts up to
        ``N`` ranks are swept first.
        """
        __tracebackhide__ = True
        settings = self._node.config.stash[_settings_key]
        if settings.layouts and not mutant_mode().verdict_only:
            # --spatial-layouts N: the layouts first; the usual check (goldens, summary) after
            sweep = {k: v for k, v in kwargs.items() if k not in ("spatial_size", "mesh")}
            self.check_layouts(case, max_ranks=settings.layouts, timeout=timeout, **sweep)
        return self._check(
            case, golden=golden, ranks=ranks, timeout=timeout, locate=locate, **kwargs
        )

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
        return self._sweep(
            case,
            max_ranks=max_ranks,
            timeout=timeout,
            locate=locate,
            exhaustive=exhaustive,
            **kwargs,
        )

    def pool(self, ranks: int | None = None) -> RankPool | LauncherRunner:
        """The warm ``RankPool`` (or, under torchrun/srun, the in-place runner) for ``ranks``.

        Pass it as ``pool=`` to ``check_equivalence`` to get the report without failing.
        """
        return self._lease.pool(ranks)

    def discard_used(self) -> None:
        """After a fresh test: its rank processes go with it."""
        self._lease.discard_fresh()


class SpatialUnusedWarning(pytest.PytestWarning):
    """A test asked for the ``spatial`` fixture but never ran anything on the ranks."""


@pytest.fixture
def spatial(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpatialFixture]:
    """Run functions on a warm group of gloo ranks: ``spatial.run(fn, *args)``."""
    registry = request.config.stash[_registry_key]
    ranks, timeout, fresh = read_marker(request, registry.default_ranks, registry.timeout)
    if fresh and isinstance(registry, LauncherRegistry):
        pytest.skip(
            "spatial(fresh=True) needs brand-new rank processes; under torchrun/srun "
            "the ranks are the launcher's"
        )
    golden = _golden_fixture(request)
    fixture = SpatialFixture(
        registry, request.node, ranks, timeout, golden, fresh=fresh, tmp=tmp_path_factory
    )
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


def _golden_fixture(request: pytest.FixtureRequest) -> GoldenFixture:
    return GoldenFixture(request.config.stash[_session_key].goldens, request.node)


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> GoldenFixture:
    """Check tensors against this test's ``.pt`` golden: ``golden.check({"loss": t})``."""
    return _golden_fixture(request)
