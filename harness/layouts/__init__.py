"""``check_layouts``: one case checked on every layout up to ``max_ranks`` ranks, and the
smallest layout that fails.

A parallel bug does not show on every layout, and the layouts where it shows are neither the
smallest nor contiguous: a mean of per-rank means is exact on 2 x 2 and wrong on 3 x 1, a
shard reported at the transposed grid position shows only on 2 x 2, a halo taken from
the wrong longitude never shows on h x 1. So every layout is run: every world size
``W <= max_ranks``, every split of it into ``spatial_size x data_size``, every process grid of
``case.mesh_dims`` factors of the spatial size (``Topology.mesh``), each one
``check_equivalence`` on the warm pool of ``W`` ranks. Where the case's partition allows
them (``SpatialCase.block_variants``), each grid also runs with uneven blocks and with a
rank owning nothing (``Layout.blocks``), right after the even layouts of its size.

A layout the case refuses (a ``ConfigError`` its own code raised while building or batching
on the ranks: a batch that does not split over 3 data groups, a grid too small for 8 polar
ranks) is not run, and is listed with the case's reason; it is neither a pass nor a failure.
What the harness refuses in what build or batch returned (``None``: a missing ``return``)
is the case's bug on that layout, a failure. A sweep in which no layout that ran split the
domain (``max_ranks=1``; every spatial size 1) checked nothing of the parallel code: it
fails as ``vacuous`` unless the case says why with ``vacuous_ok``. The
smallest failing layout is the one with the fewest ranks, then the simplest: fewest ranks
splitting the domain, then even blocks before uneven before an empty rank, then fewest
split grid axes, then the first axis split first (``Layout.order``).

By default a sweep runs the covering set of these layouts (``harness.layouts._covering``): the
smallest layout with each feature level (a split axis of 2, of 3, of more; both axes split;
uneven blocks; a rank owning nothing; data groups; an odd rank count) and with each pair
of a level of how the ranks are grouped and one of how the domain is cut; a layout the
case refuses does not count, so the next with its levels runs. ``exhaustive=True`` runs
every layout (a nightly job).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness._records.observe import observed
from harness._records.run import RunRecord
from harness.case import SpatialCase
from harness.case.declared import CheckOptions
from harness.compare import FAILURES, Quantity
from harness.errors import ConfigError
from harness.layouts._covering import Covering
from harness.layouts._lanes import rank_budget
from harness.layouts._lanes import side_by_side as run_layouts
from harness.layouts._run import Sweep, check_one, layout_timeout, reference_run
from harness.report import EquivalenceReport

if TYPE_CHECKING:
    from typing import Unpack

    from harness.pool import Runner

__all__ = [
    "BLOCKS",
    "Layout",
    "LayoutResult",
    "LayoutsReport",
    "check_layouts",
    "layout_timeout",
    "layouts",
]

#: How a layout's blocks are cut, simplest first: ``"even"``, the case's own split of the
#: grid; ``"uneven"``, blocks of different sizes; ``"empty-rank"``, a rank owning nothing.
#: A case names the last two it allows in ``SpatialCase.block_variants``.
BLOCKS = ("even", "uneven", "empty-rank")
_BLOCK_TEXT = {"uneven": "uneven blocks", "empty-rank": "a rank owning nothing"}


@dataclass(frozen=True)
class Layout:
    """Where the ranks of one partitioned run sit: ``world_size`` ranks in ``data_size``
    spatial groups of ``spatial_size`` ranks, each group on the process grid ``mesh`` (a
    tuple of ``mesh_dims`` sizes whose product is ``spatial_size``), its blocks cut as
    ``blocks`` says (one of ``BLOCKS``; not ``"even"``: the case of
    ``case.block_variants(mesh)[blocks]`` runs it)."""

    world_size: int
    spatial_size: int
    data_size: int
    mesh: tuple[int, ...]
    blocks: str = "even"

    @property
    def grid(self) -> str:
        """The process grid as text: ``"2x2"``, ``"3"``."""
        return "x".join(str(n) for n in self.mesh)

    def case_for(self, case: SpatialCase) -> SpatialCase | None:
        """The case that runs this layout: ``case`` itself for even blocks, else its
        ``block_variants(mesh)[blocks]``; ``None`` where the case does not allow these
        blocks (a drawn layout to skip: ``hypothesis.assume(...)``)."""
        if self.blocks == "even":
            return case
        return block_cases(case, self.mesh).get(self.blocks) if self.spatial_size > 1 else None

    @property
    def row(self) -> str:
        """The map's row: the grid, and the blocks unless even (``"2x1 uneven"``)."""
        return self.grid if self.blocks == "even" else f"{self.grid} {self.blocks}"

    @property
    def order(self) -> tuple[Any, ...]:
        """Smallest first: fewest ranks, fewest ranks splitting the domain, even blocks
        before uneven before an empty rank, fewest split grid axes, then the first axis
        split first (``3x1`` before ``1x3``)."""
        split = sum(1 for n in self.mesh if n > 1)
        blocks = BLOCKS.index(self.blocks) if self.blocks in BLOCKS else len(BLOCKS)
        mesh = tuple(-n for n in self.mesh)
        return (self.world_size, self.spatial_size, blocks, split, mesh)

    def __str__(self) -> str:
        groups = f", {self.data_size} data groups" if self.data_size > 1 else ""
        noun = "rank" if self.world_size == 1 else "ranks"
        blocks = f", {_BLOCK_TEXT.get(self.blocks, self.blocks)}" if self.blocks != "even" else ""
        return f"{self.world_size} {noun}: grid {self.grid}{blocks}{groups}"


def _grids(size: int, dims: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``dims`` factors whose product is ``size``."""
    if dims == 1:
        return [(size,)]
    return [
        (d, *rest)
        for d in range(1, size + 1)
        if size % d == 0
        for rest in _grids(size // d, dims - 1)
    ]


def layouts(
    max_ranks: int,
    mesh_dims: int = 1,
    world_sizes: Iterable[int] | None = None,
    blocks: Iterable[str] = ("even",),
) -> list[Layout]:
    """Every layout up to ``max_ranks`` ranks (or of ``world_sizes``), smallest first; with
    ``blocks``, each grid of at least 2 ranks once per name of ``BLOCKS`` given.

    >>> [x.grid for x in layouts(2, mesh_dims=2)]  # 1 rank; 2 data groups of 1; 2 x 1; 1 x 2
    ['1x1', '1x1', '2x1', '1x2']
    >>> [x.row for x in layouts(2, blocks=BLOCKS)][2:]
    ['2', '2 uneven', '2 empty-rank']
    """
    _check_int(max_ranks, "max_ranks", "e.g. max_ranks=8")
    _check_int(mesh_dims, "mesh_dims", "1 for bands or cell ranges, 2 for lat x lon blocks")
    kinds = _check_blocks(blocks)
    sizes = range(1, max_ranks + 1) if world_sizes is None else sorted(set(world_sizes))
    found = [
        Layout(w, s, w // s, grid, kind)
        for w in sizes
        for s in range(1, w + 1)
        if w % s == 0
        for grid in _grids(s, mesh_dims)
        for kind in kinds
        if kind == "even" or s > 1
    ]
    return sorted(found, key=lambda x: x.order)


def _check_blocks(blocks: Iterable[str]) -> list[str]:
    kinds = [blocks] if isinstance(blocks, str) else list(blocks)
    unknown = [k for k in kinds if k not in BLOCKS]
    if unknown or not kinds:
        raise ConfigError(
            f"blocks={kinds!r}: unknown block kind(s) {unknown}; choose from {BLOCKS}, "
            'e.g. blocks=("even", "uneven")'
        )
    return sorted(set(kinds), key=BLOCKS.index)


def block_cases(case: SpatialCase, mesh: tuple[int, ...]) -> dict[str, SpatialCase]:
    """``case.block_variants(mesh)``, checked: names of ``BLOCKS`` other than ``"even"``,
    each mapped to a ``SpatialCase``; else one ``ConfigError`` naming the problem."""
    found = case.block_variants(mesh)
    if not isinstance(found, dict):
        raise ConfigError(
            f"{case.label}.block_variants({mesh}) returned {type(found).__name__}; return a "
            'dict such as {"uneven": case_with_uneven_blocks}, or {} for none'
        )
    for name, variant in found.items():
        if name not in BLOCKS[1:] or not isinstance(variant, SpatialCase):
            raise ConfigError(
                f"{case.label}.block_variants({mesh}) gave {name!r}: "
                f"{type(variant).__name__}; keys are {BLOCKS[1:]}, values SpatialCases "
                "(this case with only its split of the domain changed)"
            )
    return found


def check_max_ranks(max_ranks: Any) -> None:
    """A sweep's ``max_ranks``: an integer >= 1, else one ``ConfigError`` line."""
    _check_int(max_ranks, "max_ranks", "e.g. max_ranks=4 (the most ranks a layout may use)")


def _check_int(value: Any, name: str, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}; {example}")


@dataclass
class LayoutResult:
    """One layout's outcome: ``report`` (``None`` when the case refused the layout, with
    ``refused`` its reason)."""

    layout: Layout
    report: EquivalenceReport | None
    refused: str = ""

    @property
    def status(self) -> str:
        """``"pass"``, ``"FAIL"`` or ``"n/a"`` (the case refused the layout)."""
        if self.report is None:
            return "n/a"
        return "pass" if self.report.ok else "FAIL"


@dataclass
class LayoutsReport:
    """Every layout of one case (``check_layouts``): ``.ok``, ``.smallest_failing``, and
    ``str(report)``: the smallest failing layout's whole report first, then the map of
    every layout (grid x world size), then the layouts the case refused and why."""

    case: str
    max_ranks: int
    mesh_dims: int
    results: list[LayoutResult] = field(default_factory=list)
    seconds: float = 0.0
    #: the case's ``vacuous_ok``: a sweep that split nothing may pass, for this reason
    vacuous_ok: str | None = None
    #: a covering sweep (``exhaustive=False``); ``left_out``: the layouts it did not run
    covering: bool = False
    left_out: list[Layout] = field(default_factory=list)

    @property
    def failing(self) -> list[LayoutResult]:
        """The layouts that failed, smallest (fewest ranks, simplest grid) first."""
        return sorted((r for r in self.results if r.status == "FAIL"), key=lambda r: r.layout.order)

    @property
    def passed(self) -> list[LayoutResult]:
        """The layouts that passed, in the order they ran."""
        return [r for r in self.results if r.status == "pass"]

    @property
    def refused(self) -> list[LayoutResult]:
        """The layouts the case could not run (its ``ConfigError``: ``n/a`` in the map)."""
        return [r for r in self.results if r.status == "n/a"]

    @property
    def vacuous(self) -> bool:
        """Layouts passed, but none of them split the domain (each of spatial size 1): the
        sweep proved nothing about the parallel code (``max_ranks=1``, say)."""
        return bool(self.passed) and all(r.layout.spatial_size == 1 for r in self.passed)

    @property
    def ok(self) -> bool:
        """Every layout run passed, at least one ran (a sweep that ran nothing proves
        nothing), and one that passed split the domain (else ``vacuous``), unless the case
        is replicated on purpose (``vacuous_ok``)."""
        split = not self.vacuous or bool(self.vacuous_ok)
        return not self.failing and bool(self.passed) and split

    def __bool__(self) -> bool:
        return self.ok

    @property
    def smallest_failing(self) -> Layout | None:
        """The failing layout with the fewest ranks, then the simplest grid; ``None``."""
        failing = self.failing
        return failing[0].layout if failing else None

    @property
    def smallest_report(self) -> EquivalenceReport | None:
        """The whole ``EquivalenceReport`` of ``smallest_failing``."""
        failing = self.failing
        return failing[0].report if failing else None

    def result(self, layout: Layout) -> LayoutResult:
        """What ``layout`` gave (a ``StopIteration`` if the sweep did not run it)."""
        return next(r for r in self.results if r.layout == layout)

    def _rows(self) -> list[tuple[tuple[int, ...], str]]:
        """The map's rows, (grid, blocks), simplest first."""
        every = [r.layout for r in self.results] + self.left_out
        return sorted(
            {(x.mesh, x.blocks) for x in every},
            key=lambda row: Layout(0, math.prod(row[0]), 1, *row).order[1:],
        )

    def map(self) -> str:
        """Grid and blocks (rows: ``2x1``, ``2x1 uneven``...) x world size (columns):
        ``pass``, ``FAIL``, ``n/a`` (refused), ``-`` (left out by the covering sweep) or ``.``
        (no such layout: the grid's ranks do not divide the world)."""
        by = {(x.mesh, x.blocks, x.world_size): "-" for x in self.left_out}
        for r in self.results:
            by[(r.layout.mesh, r.layout.blocks, r.layout.world_size)] = r.status
        sizes = sorted({w for _m, _b, w in by})
        rows = self._rows()
        names = [Layout(0, 0, 0, *row).row for row in rows]
        width = max([len("grid"), *map(len, names)])
        head = f"{'grid':<{width}}  " + " ".join(f"{f'W={w}':>5}" for w in sizes)
        lines = [head.rstrip()]
        for (mesh, blocks), name in zip(rows, names, strict=True):
            cells = " ".join(f"{by.get((mesh, blocks, w), '.'):>5}" for w in sizes)
            lines.append(f"{name:<{width}}  {cells}".rstrip())
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """The map as a picture (needs matplotlib): grid (rows) x world size (columns),
        green pass, red FAIL, grey refused, blank no such layout; the smallest failing
        layout framed."""
        import numpy as np
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone
        from matplotlib.patches import Rectangle

        sizes = sorted({x.world_size for x in [r.layout for r in self.results] + self.left_out})
        grids = self._rows()
        codes = {"pass": 1.0, "FAIL": 2.0, "n/a": 0.0}
        cells = np.full((len(grids), len(sizes)), np.nan)
        for r in self.results:
            row = grids.index((r.layout.mesh, r.layout.blocks))
            cells[row, sizes.index(r.layout.world_size)] = codes[r.status]
        colours = ListedColormap(["#bbbbbb", "#4caf50", "#e53935"])
        fig = Figure(figsize=(1 + 0.6 * len(sizes), 1 + 0.35 * len(grids)))
        ax = fig.add_subplot()
        ax.imshow(cells, cmap=colours, vmin=-0.5, vmax=2.5, aspect="auto")
        ax.set_xticks(range(len(sizes)), [str(w) for w in sizes])
        ax.set_yticks(range(len(grids)), [Layout(0, 0, 0, *row).row for row in grids])
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("process grid (blocks)")
        smallest = self.smallest_failing
        if smallest is not None:
            y = grids.index((smallest.mesh, smallest.blocks))
            x = sizes.index(smallest.world_size)
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, lw=3))
        ax.set_title(f"{self.case}: pass / FAIL / refused per layout", fontsize=9)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, bbox_inches="tight")
        return out

    def summary(self) -> str:
        """One line: how many layouts ran, passed, failed and were refused, and how long."""
        n = len(self.results)
        sizes = sorted({r.layout.world_size for r in self.results})
        span = f"up to {self.max_ranks} ranks"
        if sizes and sizes != list(range(1, self.max_ranks + 1)):  # a restricted sweep
            span = f"of {'/'.join(map(str, sizes))} ranks only (up to {self.max_ranks} asked)"
        count = f"{n} layout(s)"
        if self.covering:  # how many of the exhaustive sweep's layouts it ran
            count = f"layouts {n} of {n + len(self.left_out)} (covering)"
        head = (
            f"{self.case}: {count} {span}, "
            f"{len(self.passed)} passed, {len(self.failing)} failed, "
            f"{len(self.refused)} refused by the case ({self.seconds:.1f} s)"
        )
        smallest = self.smallest_failing
        if smallest is not None:
            return head + f"; smallest failing layout: {smallest}"
        if not self.passed:
            return head + "; no layout ran, so nothing was checked"
        if self.vacuous:
            why = (
                f" (vacuous_ok: {self.vacuous_ok})"
                if self.vacuous_ok
                else ": vacuous, nothing about the parallel code was checked; sweep layouts "
                "that split the domain (max_ranks=2 or more)"
            )
            return head + "; no layout run split the domain (every one has spatial size 1)" + why
        return head + "; every layout run is equivalent to the reference"

    def __str__(self) -> str:
        parts = [self.summary()]
        first = self.smallest_report
        if first is not None:
            parts.append(f"Smallest failing layout, {self.smallest_failing}:\n{first}")
        parts.append(
            "Every layout (grid x world size W; data groups = W / grid ranks; 'uneven': "
            "blocks of different sizes, 'empty-rank': a rank owning nothing; n/a: refused "
            f"by the case; {_LEFT_OUT if self.covering else ''}'.': no such layout):\n" + self.map()
        )
        failing = self.failing
        if len(failing) > 1:
            lines = [f"  {r.layout}: {_first_line(r.report)}" for r in failing]
            parts.append("Failing layouts, smallest first:\n" + "\n".join(lines))
        if self.refused:
            lines = [f"  {r.layout}: {r.refused}" for r in self.refused]
            parts.append("Not run (the case refused the layout):\n" + "\n".join(lines))
        return "\n\n".join(parts)

    def __repr__(self) -> str:
        return str(self)

    def raise_if_failed(self) -> None:
        """An ``AssertionError`` carrying the whole report, if any layout failed, none ran
        or none that ran split the domain."""
        __tracebackhide__ = True
        if not self.ok:
            raise AssertionError(str(self))


_LEFT_OUT = (
    "'-': left out by the covering sweep (exhaustive=True or --spatial-layouts-all: every layout); "
)


def _first_line(report: EquivalenceReport | None) -> str:
    text = str(report).splitlines() if report is not None else []
    first = next((line for line in text if line.startswith("First:")), "")
    return first or (text[0] if text else "")


#: the phases in which a ``ConfigError`` means the case refused the layout (not a bug of
#: the run: a wrong shard shape in ``forward`` is one)
_REFUSING_PHASES = ("build", "batch")


def refusal(report: EquivalenceReport) -> str:
    """The case's reason when it refused the layout (a ``ConfigError`` on the rank that
    failed first, raised by the case's own code while building or batching), else ``""``.

    Raised by the case's code: its traceback holds a frame of the case (its ``build``, or a
    helper it called there). The harness's own checks of what build and batch returned
    (``None``: a missing ``return model``), of the partition and shards it declares, leave
    none (``user_traceback`` drops the harness's frames): those are the case's bug on this
    layout, and counting them as a refusal let a sweep of a broken case pass."""
    first = next((m for m in report.mismatches if m.quantity is Quantity.ERROR), None)
    if first is None or not first.where.startswith("ConfigError"):
        return ""
    if not any(p in first.phase for p in _REFUSING_PHASES):
        return ""
    if not first.detail.startswith("Traceback"):  # no frame of the case's: the harness's
        return ""
    return first.where.removeprefix("ConfigError: ")


@observed  # the plugin's summary hears of it (harness._records.observe)
def check_layouts(
    case: SpatialCase,
    *,
    max_ranks: int = 8,
    world_sizes: Iterable[int] | None = None,
    pools: Callable[[int], Runner] | None = None,
    locate: bool | None = None,
    progress: Callable[[LayoutResult], None] | None = None,
    exhaustive: bool = False,
    oversubscribe: bool = False,
    timeout: float | None = None,
    side_by_side: bool = True,
    **options: Unpack[CheckOptions],
) -> LayoutsReport:
    """``check_equivalence(case, ...)`` on the covering set of the layouts up to
    ``max_ranks`` ranks (``harness.layouts._covering``), or on every one with ``exhaustive=True``.

    ``world_sizes`` restricts the sweep to those world sizes; ``pools(W)`` gives the runner
    of ``W`` ranks (default: the process-wide warm pools, one per world size); ``options``
    go to every ``check_equivalence`` (``steps``, ``lr``, ``seed``, ``tolerance``,
    ``rollout``... : ``CheckOptions``).
    The layouts of one world size run one after another on its pool, smallest first, and
    with ``side_by_side`` (the default) those of other world sizes at the same time on
    theirs, within a cap of ranks per core (``harness.layouts._lanes``; every verdict is
    reached in this thread); ``side_by_side=False``: one layout at a time. A layout's hang
    is ended by the deadlock proof, not a clock, so a layout that is merely slow still runs
    to its verdict: its timeout (``timeout``, else its pool's) is multiplied by the ranks
    running per core (``layout_timeout``). ``locate``: as for ``check_equivalence``, for the
    smallest failing layout only (the sweep itself never locates: the first failing layout
    is the one worth the cost); ``progress`` is told each layout's result as it comes;
    ``oversubscribe=True`` allows more than 4 ranks a core.
    """
    dims = _validate(case, options, max_ranks, oversubscribe)
    if pools is None:
        from harness.pool import shared_registry

        pools = shared_registry().get
    t0 = time.perf_counter()
    out = LayoutsReport(case.label, max_ranks, dims, vacuous_ok=case.vacuous_ok)
    out.covering = not exhaustive
    cases = _cases(case, layouts(max_ranks, dims, world_sizes))
    order = sorted(cases, key=lambda x: x.order)
    reference = reference_run(case, options, timeout)  # the same for every layout: run once
    sweep = Sweep(cases, pools, reference, timeout, options)
    beside = side_by_side and bool(order) and sweep.side_by_side(order[0])
    budget = rank_budget(order[-1].world_size) if beside else 0  # 0: one at a time
    done: dict[Layout, LayoutResult] = {}
    while todo := [x for x in (order if exhaustive else _wanted(order, done)) if x not in done]:
        for layout, report in run_layouts(todo, sweep.start, sweep.judge, budget):
            why = refusal(report) if not report.ok else ""
            done[layout] = result = LayoutResult(layout, None if why else report, why)
            if progress is not None:
                progress(result)
    out.results = [done[x] for x in order if x in done]
    out.left_out = [x for x in order if x not in done]
    if locate is not False and out.failing:
        locate_smallest(out.failing[0], cases, pools, reference, timeout, locate, options)
    out.seconds = time.perf_counter() - t0
    return out


def _wanted(order: list[Layout], done: dict[Layout, LayoutResult]) -> list[Layout]:
    """The covering walk over ``order`` given what ``done`` holds: each layout not run yet
    that has a level no smaller layout that ran (or is wanted now) has. A refused layout
    does not count, so once it is known the walk wants the next with its levels: the
    sweep runs these, then walks again, until the walk wants nothing new."""
    walk, wanted = Covering(), []
    for layout in order:
        result = done.get(layout)
        if result is not None:
            if not result.refused:
                walk.ran(layout)
        elif walk.wants(layout):
            wanted.append(layout)
            walk.ran(layout)  # as if it ran: a refusal is seen on the next walk
    return wanted


def _validate(case: SpatialCase, options: CheckOptions, max_ranks: Any, allow: bool) -> int:
    """One clear error for what a sweep cannot take; the case's ``mesh_dims``."""
    from harness.pool import check_oversubscription

    check_max_ranks(max_ranks)
    check_oversubscription(max_ranks, allow=allow, how="pass oversubscribe=True")
    if not isinstance(case, SpatialCase):
        raise ConfigError(
            f"check_layouts needs a harness.SpatialCase, got {type(case).__name__}; "
            "subclass SpatialCase and implement build, batch and forward"
        )
    for bad in ("ranks", "spatial_size", "mesh", "pool", "reference"):
        if bad in options:
            raise ConfigError(
                f"check_layouts chooses {bad}= itself for every layout; drop {bad}= "
                "(restrict the sweep with max_ranks= or world_sizes=)"
            )
    dims = case.mesh_dims
    _check_int(dims, f"{case.label}.mesh_dims", "1 for bands or cell ranges, 2 for lat x lon")
    return dims


def _cases(case: SpatialCase, todo: list[Layout]) -> dict[Layout, SpatialCase]:
    """Every layout of the sweep and the case that runs it: the even layouts, then the
    uneven and empty blocks the case allows on each grid (``block_variants``)."""
    variants = {m: block_cases(case, m) for m in {x.mesh for x in todo if x.spatial_size > 1}}
    cases = {x: case for x in todo}
    for x in todo:
        for kind, variant in variants.get(x.mesh, {}).items():
            cases[Layout(x.world_size, x.spatial_size, x.data_size, x.mesh, kind)] = variant
    return cases


def locate_smallest(
    smallest: LayoutResult,
    cases: dict[Layout, SpatialCase],
    pools: Callable[[int], Runner],
    reference: RunRecord | None,
    given: float | None,
    locate: bool | None,
    options: CheckOptions,
) -> None:
    """Rerun the smallest failing layout with locating, and keep that report when it fails
    the same way (now with where it first departs). Not for a raise or a hang, whose
    traceback or stacks say where, nor for a mutant's rerun, which never locates."""
    from harness._mutation.mode import current as mutant_mode

    if smallest.report is None or smallest.report.quantities & set(FAILURES):
        return
    if mutant_mode().verdict_only:
        return
    layout = smallest.layout
    located = check_one(layout, cases[layout], pools, reference, given, locate, options)
    if not located.ok:
        smallest.report = located


def sweep_cases(
    cases: Iterable[tuple[str, SpatialCase]],
    max_ranks: int,
    pools: Callable[[int], Runner],
    *,
    timeout: float | None = None,
    out: Callable[[str], None] = print,
    exhaustive: bool = False,
) -> list[str]:
    """``harness-check --layouts N``: ``check_layouts`` of each ``(label, case)``, printed as
    it goes (a line per layout, then the report); returns one failure line per failing case.
    ``exhaustive`` (``--layouts-all``): every layout, not the covering set."""
    failures = []
    which = "every layout" if exhaustive else "the covering layouts"
    for label, case in cases:
        out(f"\n{label}: {which} up to {max_ranks} ranks (mesh_dims {case.mesh_dims})")

        def tell(result: LayoutResult) -> None:
            out(f"  {result.status:<4}  {result.layout}")

        report = check_layouts(
            case,
            max_ranks=max_ranks,
            pools=pools,
            timeout=timeout,
            progress=tell,
            exhaustive=exhaustive,
            oversubscribe=True,  # harness-check refused it already, naming --oversubscribe
        )
        out(str(report) if not report.ok else report.summary() + "\n" + report.map())
        if not report.ok:
            failures.append(f"{label}: {report.summary()}")
    return failures
