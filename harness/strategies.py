"""Hypothesis strategies for partitions, process grids and observation sets.

Partitioned code goes wrong at the edges: uneven splits, ranks that own nothing, cells with
no observations. These strategies draw those cases often, and shrink towards the plain ones
(even splits, no empty ranks, few points), so a failing example reads as the smallest
partition that still shows the bug.

Arguments are keyword-only and checked when the strategy is made, not when it is drawn:
a mistake fails at once with ``InvalidArgument`` naming the likely slip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from harness.errors import ConfigError
from harness.layouts import Layout
from harness.layouts import layouts as _all_layouts
from harness.partition import CellPartition, LatLonPartition, cell_of

__all__ = [
    "PHASES",
    "ObservationSet",
    "cell_partitions",
    "check_settings",
    "latlon_partitions",
    "layouts",
    "observation_sets",
    "process_grids",
    "register_profiles",
]


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(
            f"{name}={value!r} must be an int (got {type(value).__name__}); strategies here "
            "take plain numbers, not strategies"
        )
    if value < minimum:
        raise InvalidArgument(f"{name}={value!r} must be >= {minimum}")
    return int(value)


def _nside(nside: object) -> int:
    n = _int("nside", nside, 1)
    if n & (n - 1):
        raise InvalidArgument(
            f"nside={n} is not a power of two, which NESTED HEALPix needs; did you pass "
            f"npix ({12 * n * n if n < 2**20 else '...'} cells) or a resolution? "
            f"Try nside={1 << (n.bit_length() - 1)}"
        )
    return n


def _grids(ranks: int) -> list[tuple[int, int]]:
    return [(h, ranks // h) for h in range(ranks, 0, -1) if ranks % h == 0]


# ---------------------------------------------------------------------- process grids


def process_grids(ranks: int) -> st.SearchStrategy[tuple[int, int]]:
    """``(h, w)`` process grids with ``h * w == ranks``.

    Shrinks towards ``(ranks, 1)``: a pure polar split, no azimuth ranks.
    """
    ranks = _int("ranks", ranks, 1)
    return st.sampled_from(_grids(ranks))


def layouts(
    *, max_ranks: int = 8, mesh_dims: int = 1, blocks: Sequence[str] = ("even",)
) -> st.SearchStrategy[Layout]:
    """``harness.layouts.Layout`` s up to ``max_ranks`` ranks: a world size, its spatial x
    data split, a process grid of ``mesh_dims`` axes and, with ``blocks`` (names of
    ``harness.layouts.BLOCKS``; ``blocks=BLOCKS`` for all), how its blocks are cut; for
    ``check_equivalence(l.case_for(case), ranks=l.world_size, spatial_size=l.spatial_size,
    mesh=l.mesh)`` (``case_for`` is ``None`` where the case does not allow those blocks:
    ``assume`` it is not).

    Shrinks towards the smallest layout (``Layout.order``: fewest ranks, even blocks, then
    the simplest grid), so a failing example reads as the smallest layout that shows the bug.
    """
    max_ranks = _int("max_ranks", max_ranks, 1)
    mesh_dims = _int("mesh_dims", mesh_dims, 1)
    try:
        found = _all_layouts(max_ranks, mesh_dims, blocks=blocks)
    except ConfigError as exc:
        raise InvalidArgument(str(exc)) from None
    # drawn as "this one?" for each layout in turn (smallest first), each a choice among
    # the layouts left, not as one index into the list: Hypothesis shrinks a choice toward
    # its first value ("this one"), so it tries every earlier layout and lands on the
    # smallest that still fails (one index shrinks by steps and stops at the first layout
    # that passes: the grids and blocks of one size interleave, so that is rarely the end)

    @st.composite
    def draw(draw: st.DrawFn) -> Layout:
        for i, layout in enumerate(found[:-1]):
            if draw(st.sampled_from(range(len(found) - i))) == 0:
                return layout
        return found[-1]

    return draw()


# ---------------------------------------------------------------------- lat/lon


def latlon_partitions(
    *,
    ranks: int,
    min_nlat: int = 1,
    max_nlat: int = 32,
    min_nlon: int = 1,
    max_nlon: int = 64,
    grid: tuple[int, int] | None = None,
) -> st.SearchStrategy[LatLonPartition]:
    """``LatLonPartition`` s of ``ranks`` ranks, even and uneven, every block non-empty.

    The process grid is ``grid`` or any ``(h, w)`` with ``h * w == ranks`` that fits the
    size bounds (``nlat >= h``, ``nlon >= w``: the distributed SHT needs at least one
    latitude and one longitude per rank). Shrinks towards the first grid that fits (see
    ``process_grids``) and the fewest latitudes and longitudes it allows.
    """
    ranks = _int("ranks", ranks, 1)
    bounds = _size_bounds(
        min_nlat=min_nlat, max_nlat=max_nlat, min_nlon=min_nlon, max_nlon=max_nlon
    )
    candidates = _grid_candidates(ranks, grid)
    fits = [(h, w) for h, w in candidates if h <= bounds["max_nlat"] and w <= bounds["max_nlon"]]
    if not fits:
        h, w = candidates[-1] if grid is None else grid
        raise InvalidArgument(
            f"no process grid of {ranks} ranks fits max_nlat={bounds['max_nlat']}, "
            f"max_nlon={bounds['max_nlon']}: grid {h}x{w} needs nlat >= {h} and nlon >= {w} "
            "(every rank owns at least one latitude and longitude); raise max_nlat/max_nlon"
        )

    @st.composite
    def draw_partition(draw: st.DrawFn) -> LatLonPartition:
        h, w = draw(st.sampled_from(fits))
        nlat = draw(st.integers(max(bounds["min_nlat"], h), bounds["max_nlat"]))
        nlon = draw(st.integers(max(bounds["min_nlon"], w), bounds["max_nlon"]))
        return LatLonPartition(nlat=nlat, nlon=nlon, h=h, w=w)

    return draw_partition()


def _size_bounds(**given: object) -> dict[str, int]:
    """``latlon_partitions``' size bounds, each an int >= 1 and each min <= its max."""
    bounds = {name: _int(name, value, 1) for name, value in given.items()}
    for dim in ("nlat", "nlon"):
        if bounds[f"min_{dim}"] > bounds[f"max_{dim}"]:
            raise InvalidArgument(
                f"min_{dim}={bounds[f'min_{dim}']} > max_{dim}={bounds[f'max_{dim}']}; "
                "did you swap them?"
            )
    return bounds


def _grid_candidates(ranks: int, grid: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The given ``grid`` (checked), or every process grid of ``ranks``."""
    if grid is not None:
        if (
            not isinstance(grid, tuple)
            or len(grid) != 2
            or any(isinstance(g, bool) or not isinstance(g, int) for g in grid)
            or grid[0] * grid[1] != ranks
        ):
            raise InvalidArgument(
                f"grid={grid!r} must be an (h, w) tuple of ints with h * w == ranks={ranks}; "
                f"choose one of {_grids(ranks)} or leave grid=None to draw one"
            )
        return [grid]
    return _grids(ranks)


# ---------------------------------------------------------------------- HEALPix cells


def _empty_ranks(bounds: list[int], emptied: Sequence[bool]) -> list[int]:
    """Hand the cells of each emptied rank to the next kept rank (or the previous one at the
    end), so ranges stay contiguous."""
    sizes = np.diff(bounds).tolist()
    keep = [not e for e in emptied]
    if not any(keep):
        keep[-1] = True
    kept = [r for r, k in enumerate(keep) if k]
    for r, k in enumerate(keep):
        if not k and sizes[r]:
            later = [q for q in kept if q > r]
            target = later[0] if later else kept[-1]
            sizes[target] += sizes[r]
            sizes[r] = 0
    return [0, *np.cumsum(sizes).tolist()]


def cell_partitions(
    *, nside: int, ranks: int, allow_empty: bool = True
) -> st.SearchStrategy[CellPartition]:
    """``CellPartition`` s of the ``12 * nside**2`` cells over ``ranks`` ranks.

    Any monotone bounds can appear: each interior bound of the even split moves by a drawn
    shift. With ``allow_empty`` about half of the examples also empty a random subset of
    ranks (their cells go to a neighbour), because empty ranks are where collectives hang.
    Shrinks towards ``CellPartition.even(nside, ranks)`` (shifts 0, nothing emptied).
    """
    nside = _nside(nside)
    ranks = _int("ranks", ranks, 1)
    npix = 12 * nside * nside
    if not allow_empty and ranks > npix:
        raise InvalidArgument(
            f"allow_empty=False needs ranks <= npix, but nside={nside} has {npix} cells for "
            f"{ranks} ranks; raise nside to {1 << math.ceil(math.log2(math.sqrt(ranks / 12)))} "
            "or allow empty ranks"
        )
    even = CellPartition.even(nside, ranks).bounds

    @st.composite
    def draw_partition(draw: st.DrawFn) -> CellPartition:
        shifts = draw(st.lists(st.integers(-npix, npix), min_size=ranks - 1, max_size=ranks - 1))
        inner = sorted(min(max(b + d, 0), npix) for b, d in zip(even[1:-1], shifts, strict=True))
        bounds = [0, *inner, npix]
        if allow_empty and ranks > 1 and draw(st.booleans()):
            emptied = draw(st.lists(st.booleans(), min_size=ranks, max_size=ranks))
            bounds = _empty_ranks(bounds, emptied)
        if not allow_empty:  # push bounds apart: one cell at least per rank
            for r in range(1, ranks + 1):
                bounds[r] = max(bounds[r], bounds[r - 1] + 1)
            bounds[ranks] = npix
            for r in range(ranks - 1, 0, -1):
                bounds[r] = min(bounds[r], bounds[r + 1] - 1)
        return CellPartition(nside, tuple(bounds))

    return draw_partition()


# ---------------------------------------------------------------------- observations


@dataclass(frozen=True)
class ObservationSet:
    """Point observations on the sphere: ``lat``, ``lon`` (degrees, float64, shape ``(n,)``)
    and ``values`` (float64, ``(n, channels)``)."""

    nside: int
    lat: np.ndarray
    lon: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.lat)

    @property
    def cells(self) -> np.ndarray:
        """NESTED cell of each point at ``nside``."""
        return cell_of(self.nside, self.lat, self.lon)

    def counts(self) -> np.ndarray:
        """Points per cell, shape ``(npix,)``: what ``CellPartition.packed_slice`` takes."""
        return np.bincount(self.cells, minlength=12 * self.nside**2).astype(np.int64)

    def sorted_by_cell(self) -> ObservationSet:
        """The same points, packed in cell order (stable within a cell)."""
        order = np.argsort(self.cells, kind="stable")
        return ObservationSet(self.nside, self.lat[order], self.lon[order], self.values[order])


# Sub-cells at this depth below nside give points strictly inside their cell: a child
# pixel's centre lies inside the child, hence inside its nested parent.
_DEPTH = 6
#: a drawn point: its cell, its sub-cell at ``_DEPTH`` and its channel values
_Point = tuple[int, int, list[float]]


def observation_sets(
    *,
    nside: int,
    min_points: int = 0,
    max_points: int = 32,
    channels: int = 1,
    partition: CellPartition | None = None,
    allow_empty_ranks: bool = True,
) -> st.SearchStrategy[ObservationSet]:
    """``ObservationSet`` s of ``min_points`` to ``max_points`` points with ``channels`` values.

    Points fall inside a drawn pool of cells: all cells, a contiguous nested range (a compact
    region: every rank of a contiguous partition outside it is empty), or, given a
    ``partition``, the cells of a random subset of its ranks. So some cells are always empty
    and whole ranks' domains often are. ``allow_empty_ranks=False`` (needs ``partition``)
    gives every rank that owns cells at least one point instead. Shrinks towards few points,
    in the first cells of the pool, with values 0.
    """
    nside = _nside(nside)
    min_points = _int("min_points", min_points, 0)
    max_points = _int("max_points", max_points, 0)
    channels = _int("channels", channels, 1)
    owning = _owning_ranks(nside, min_points, max_points, partition, allow_empty_ranks)
    npix = 12 * nside * nside
    depth = min(_DEPTH, 29 - (nside.bit_length() - 1))
    children = 4**depth
    value = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)

    def points(pool: Sequence[int], n_min: int, n_max: int) -> st.SearchStrategy[list[_Point]]:
        point = st.tuples(
            st.integers(0, len(pool) - 1),
            st.integers(0, children - 1),
            st.lists(value, min_size=channels, max_size=channels),
        )
        return st.lists(point, min_size=n_min, max_size=n_max).map(
            lambda ps: [(pool[i], c, v) for i, c, v in ps]
        )

    @st.composite
    def draw_set(draw: st.DrawFn) -> ObservationSet:
        drawn: list[_Point] = []
        if not allow_empty_ranks:
            assert partition is not None
            for r in owning:
                drawn += draw(points(partition.cells(r), 1, 1))
            pool: Sequence[int] = range(npix)
        else:
            pool = _draw_pool(draw, npix, owning, partition)
        n_min = max(min_points - len(drawn), 0)
        drawn += draw(points(pool, n_min, max_points - len(drawn)))
        return _observations(nside, depth, drawn, channels)

    return draw_set()


def _draw_pool(
    draw: st.DrawFn, npix: int, owning: list[int], partition: CellPartition | None
) -> Sequence[int]:
    """The cells the points fall in: all, a contiguous nested range, or some ranks' cells."""
    kind = draw(st.sampled_from(["all", "region", "ranks"] if owning else ["all", "region"]))
    if kind == "all":
        return range(npix)
    if kind == "region":
        lo = draw(st.integers(0, npix - 1))
        return range(lo, draw(st.integers(lo + 1, npix)))
    assert partition is not None
    chosen = draw(st.lists(st.sampled_from(owning), min_size=1, unique=True))
    return [c for r in sorted(chosen) for c in partition.cells(r)]


def _owning_ranks(
    nside: int,
    min_points: int,
    max_points: int,
    partition: CellPartition | None,
    allow_empty_ranks: bool,
) -> list[int]:
    """Check ``observation_sets``' arguments together; the partition's ranks that own cells."""
    if min_points > max_points:
        raise InvalidArgument(f"min_points={min_points} > max_points={max_points}; swapped?")
    owning: list[int] = []
    if partition is not None:
        if not isinstance(partition, CellPartition):
            raise InvalidArgument(
                f"partition must be a CellPartition, got {type(partition).__name__}; to draw "
                "one per example use st.data() or .flatmap on cell_partitions(...)"
            )
        if partition.nside != nside:
            raise InvalidArgument(
                f"partition.nside={partition.nside} but nside={nside}; pass the same nside"
            )
        owning = [r for r in range(partition.ranks) if partition.sizes[r]]
    if not allow_empty_ranks:
        if partition is None:
            raise InvalidArgument(
                "allow_empty_ranks=False needs partition=...: which ranks exist depends on "
                "the partition"
            )
        if max_points < len(owning):
            raise InvalidArgument(
                f"allow_empty_ranks=False gives each of the {len(owning)} ranks that own cells "
                f"a point, but max_points={max_points}; raise max_points to {len(owning)}"
            )
    return owning


def _observations(nside: int, depth: int, drawn: list[_Point], channels: int) -> ObservationSet:
    import healpy as hp

    if not drawn:
        empty = np.zeros(0, dtype=np.float64)
        return ObservationSet(nside, empty, empty.copy(), np.zeros((0, channels)))
    cells = np.array([c for c, _, _ in drawn], dtype=np.int64)
    child = np.array([k for _, k, _ in drawn], dtype=np.int64)
    fine = (cells << (2 * depth)) + child
    lon, lat = hp.pix2ang(nside << depth, fine, nest=True, lonlat=True)
    values = np.array([v for _, _, v in drawn], dtype=np.float64).reshape(len(drawn), channels)
    return ObservationSet(
        nside, np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64), values
    )


# ---------------------------------------------------------------------- profiles


#: Hypothesis's phases but ``Phase.explain``: after shrinking, explain reruns the failing
#: example once per choice it made, to say which parts of it matter; with an equivalence
#: check per example that is most of the time (92 reruns, 300 of 351 s, on one HEALPix bug)
#: for a diagnosis the report itself already gives.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)


def check_settings(max_examples: int = 10, **overrides: object) -> settings:
    """Hypothesis settings for a test whose examples are equivalence checks (seconds each).

    Reproducible: ``derandomize=True`` and no example database, so every run draws the same
    examples and shrinks a failure to the same one (a database replays what an earlier run
    found, so two runs, or two machines, could report different examples). Fast: no
    explain phase (``PHASES``), ``max_examples=10``, no deadline (an example's time depends
    on the machine's load), and no health check that a pool fixture or slow examples trip.
    ``overrides`` go to ``hypothesis.settings`` as they are. Use it as the decorator:

    >>> from hypothesis import given, strategies as st
    >>> @check_settings(max_examples=3)
    ... @given(st.integers(0, 3))
    ... def test_even(n):
    ...     assert n < 10
    >>> test_even()
    """
    fields: dict[str, object] = {
        "max_examples": max_examples,
        "deadline": None,
        "derandomize": True,
        "database": None,
        "phases": PHASES,
        "suppress_health_check": [
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
        ],
    }
    fields.update(overrides)
    return settings(**fields)  # type: ignore[arg-type]


def register_profiles() -> None:
    """Register the Hypothesis settings profiles ``ci``, ``dev`` and ``thorough``.

    ``ci`` is reproducible (derandomized) and prints the blob to replay a failure; none has a
    deadline, since a distributed example's time depends on the machine's load, and none
    runs the explain phase (``PHASES``: it reruns a failing check dozens of times).
    Load one with ``settings.load_profile(name)`` or ``--hypothesis-profile=name``.
    """
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=25,
        derandomize=True,
        print_blob=True,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", deadline=None, max_examples=10, phases=PHASES)
    settings.register_profile("thorough", deadline=None, max_examples=250, phases=PHASES)
