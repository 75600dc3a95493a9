"""How each layout of a sweep runs (``harness.layouts.check_layouts``): ``Sweep``, the
case, pools, reference and options every layout shares, with ``start`` and ``judge`` for
``harness.layouts._lanes.side_by_side``; ``check_one``, a layout's whole check here; the
reference run once for all; a layout's timeout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from harness._base.cpus import cores
from harness._records.run import RunRecord
from harness.case import SpatialCase
from harness.case.declared import CheckOptions
from harness.layouts._covering import _Layout as Layout  # what a layout is here
from harness.report import EquivalenceReport

if TYPE_CHECKING:
    from harness.case.declared import CheckSpec
    from harness.pool import Runner
    from harness.pool.overlap import Background


L = TypeVar("L", bound=Layout)


@dataclass
class Sweep(Generic[L]):
    """What every layout of one sweep runs with: its case, pool, the shared reference, the
    sweep's timeout and options; ``start`` and ``judge`` for ``_lanes.side_by_side``."""

    cases: dict[L, SpatialCase]
    pools: Callable[[int], Runner]
    reference: RunRecord | None
    timeout: float | None
    options: CheckOptions
    _started: dict[L, tuple[CheckSpec, Runner]] = field(default_factory=dict)
    _at_once: dict[L, int] = field(default_factory=dict)

    def side_by_side(self, first: L) -> bool:
        """Whether layouts can run beside each other: the pools run their ranks in other
        processes (a launcher's run in this one), and the reference ran (else each check
        runs its own, a serial run: one at a time)."""
        from harness.pool.overlap import in_other_processes

        return self.reference is not None and in_other_processes(self.pools(first.world_size))

    def start(
        self, layout: L, at_once: int, done: Callable[[Background], None]
    ) -> Background | None:
        """The layout's ranks' run started, or ``None`` where it cannot start ahead
        (``start_ranks``); ``at_once``: the ranks running with it, for its timeout."""
        from harness.equivalence import spec_of, start_ranks
        from harness.pool.overlap import in_other_processes

        self._at_once[layout] = at_once
        runner = self.pools(layout.world_size)
        if self.reference is None or not in_other_processes(runner):
            return None
        spec = spec_of(
            self.cases[layout],
            ranks=layout.world_size,
            spatial_size=layout.spatial_size,
            mesh=layout.mesh,
            locate=False,
            timeout=layout_timeout(self.timeout, runner, at_once),
            **self.options,
        )
        started = start_ranks(spec, self.cases[layout], runner, self.reference, done)
        if started is not None:
            self._started[layout] = (spec, runner)
        return started

    def judge(self, layout: L, started: Background | None) -> EquivalenceReport:
        """The layout's report: from its ``started`` run, or its whole check run here."""
        from harness.equivalence import run_check

        at_once = self._at_once.pop(layout, layout.world_size)
        if started is None:
            case, given = self.cases[layout], self.timeout
            return check_one(
                layout, case, self.pools, self.reference, given, False, self.options, at_once
            )
        spec, runner = self._started.pop(layout)
        return run_check(spec, self.cases[layout], runner, self.reference, started)


def check_one(
    layout: Layout,
    case: SpatialCase,
    pools: Callable[[int], Runner],
    reference: RunRecord | None,
    given: float | None,
    locate: bool | None,
    options: CheckOptions,
    at_once: int = 0,
) -> EquivalenceReport:
    """``check_equivalence`` of one layout, on its world size's pool, with the sweep's
    reference and the layout's timeout (``layout_timeout``, for ``at_once`` ranks running,
    else its own)."""
    from harness.equivalence import check_equivalence

    runner = pools(layout.world_size)
    return check_equivalence(
        case,
        ranks=layout.world_size,
        spatial_size=layout.spatial_size,
        mesh=layout.mesh,
        pool=runner,
        locate=locate,
        reference=reference,
        timeout=layout_timeout(given, runner, max(at_once, layout.world_size)),
        **options,
    )


def reference_run(
    case: SpatialCase, options: CheckOptions, timeout: float | None
) -> RunRecord | None:
    """The reference's run, which does not depend on the layout (``None`` where it raises:
    each layout's check then reports the reference's error)."""
    from harness.equivalence import bounded_reference, spec_of
    from harness.pool import DEFAULT_TIMEOUT

    try:  # under the sweep's timeout (else the default pool's), as each check's reference
        spec = spec_of(case, ranks=1, **options)  # check_equivalence's defaults
        return bounded_reference(case, spec.steps, spec.lr, spec.seed, timeout or DEFAULT_TIMEOUT)
    except Exception:  # noqa: BLE001 - each layout's check reports the reference's (or the
        return None  # options') error


def layout_timeout(timeout: float | None, runner: Runner, ranks: int) -> float | None:
    """A layout's run timeout: ``timeout`` (else the runner's own) times the ranks per core
    when more ranks than cores run (the layout's, and those of the layouts beside it).
    Oversubscribed ranks time-slice every collective, so a layout of 8 ranks on 2 cores is
    several times slower than one of 2, and a clock sized for the small layouts would be a
    false timeout on the large ones; a hang is ended by the deadlock proof long before
    either clock. ``None`` when neither says."""
    base = timeout if timeout is not None else getattr(runner, "timeout", None)
    if base is None:
        return None
    return float(base) * max(1.0, ranks / cores())
