"""Which rank owns which part of the globe: pure index arithmetic, no torch.

Two partitions, one per model family:

- ``LatLonPartition``: an ``nlat x nlon`` grid over an ``h x w`` process grid (``h`` polar,
  ``w`` azimuth ranks), split with ``split_sizes``, the rule torch-harmonics' distributed
  SHT uses, so data sharded here lines up with its spectral transforms.
- ``CellPartition``: HEALPix cells in NESTED order, one contiguous range per rank; ranges
  may be empty (a rank with nothing to do must still take part in every collective).

Errors are ``ConfigError`` and read: problem, evidence, remedy.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from harness.errors import ConfigError

__all__ = [
    "CellPartition",
    "LatLonPartition",
    "Ownership",
    "cell_of",
    "ownership",
    "sht_split_rule",
    "split_sizes",
    "uneven_sizes",
]


SPLIT_RULES = ("ceil", "balanced")


@functools.cache
def sht_split_rule() -> str:
    """The split rule of the installed torch-harmonics' distributed SHT.

    Up to 0.8 ``compute_split_shapes`` splits with ceil (``ceil`` here); from 0.9 it balances
    the chunks (``balanced``). Read from the package metadata, so torch-harmonics is not
    imported (that takes seconds). Without torch-harmonics: ``ceil``.
    """
    from importlib import metadata

    try:
        version = metadata.version("torch-harmonics")
    except metadata.PackageNotFoundError:
        return "ceil"
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    return "balanced" if major_minor >= (0, 9) else "ceil"


def split_sizes(size: int, parts: int, rule: str | None = None) -> list[int]:
    """Split ``size`` items over ``parts`` ranks the way torch-harmonics does.

    ``rule="ceil"`` (torch-harmonics <= 0.8): ``ceil(size / parts)`` per rank, the
    remainder last; if that would leave the last rank nothing, floor split instead (the
    remainder then goes to the last rank). ``rule="balanced"`` (torch-harmonics >= 0.9, and
    ``numpy.array_split``): sizes differ by at most one, the first ranks get the extra.
    The default is the installed torch-harmonics' rule (``sht_split_rule``), so data
    scattered here lines up with the distributed SHT's shapes: the single source of truth
    for uneven splits.

    >>> split_sizes(10, 4, rule="ceil"), split_sizes(10, 4, rule="balanced")
    ([3, 3, 3, 1], [3, 3, 2, 2])
    >>> split_sizes(5, 4, rule="ceil")
    [1, 1, 1, 2]
    >>> split_sizes(2, 4, rule="ceil")     # fewer items than parts: leading ranks get nothing
    [0, 0, 0, 2]
    """
    _check_int("size", size, 0)
    _check_int("parts", parts, 1)
    rule = sht_split_rule() if rule is None else rule
    if rule not in SPLIT_RULES:
        raise ConfigError(f"unknown split rule {rule!r}; use one of {SPLIT_RULES}")
    size, parts = int(size), int(parts)
    if parts == 1:
        return [size]
    if rule == "balanced":
        base, extra = divmod(size, parts)
        return [base + (r < extra) for r in range(parts)]
    chunk = -(-size // parts)
    last = size - chunk * (parts - 1)
    if last <= 0:
        chunk = size // parts
        last = size - chunk * (parts - 1)
    return [chunk] * (parts - 1) + [last]


def uneven_sizes(size: int, parts: int) -> list[int]:
    """A deliberately uneven split of ``size`` items over ``parts`` ranks (``parts >= 2``):
    the first rank gets half an even share, the others share the rest (``balanced``). Every
    rank gets at least one item; sizes differ by more than one, so code that holds only for
    equal blocks shows. ``check_layouts``' ``uneven`` blocks (``SpatialCase.block_variants``).

    >>> uneven_sizes(48, 2), uneven_sizes(48, 4), uneven_sizes(12, 3)
    ([12, 36], [6, 14, 14, 14], [2, 5, 5])
    """
    _check_int("size", size, 0)
    _check_int("parts", parts, 2)
    size, parts = int(size), int(parts)
    if size < 2 * parts:
        raise ConfigError(
            f"{size} items cannot be split unevenly over {parts} ranks with every rank "
            f"holding one; uneven blocks need size >= {2 * parts}"
        )
    first = max(1, size // parts // 2)
    return [first, *split_sizes(size - first, parts - 1, rule="balanced")]


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *accumulate(sizes)]


def _check_rank(rank: object, ranks: int, what: str) -> int:
    """The one rank validator: a plain integer in ``[0, ranks)``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not (0 <= rank < ranks):
        raise ConfigError(
            f"rank {rank!r} is not a spatial rank of this {what}; use 0 <= rank < {ranks}"
        )
    return int(rank)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(
            f"{name} must be an integer >= {minimum}, got {value!r} "
            f"({type(value).__name__}); pass a plain int"
        )


# ---------------------------------------------------------------------- ownership


@dataclass(frozen=True)
class Ownership:
    """Which ranks claim each of ``size`` global positions, from every rank's index.

    The one rule behind every coverage check: each global position is owned by exactly one
    rank. ``counts[p]`` is how many ranks claim position ``p``.

    >>> own = ownership([[0, 1], [1, 3]], size=4)
    >>> own.complete, own.missing.tolist(), own.doubled.tolist()
    (False, [2], [1])
    >>> own.owners_of(1)
    [0, 1]
    >>> own.describe()
    '1 position owned by no rank (first: 2); 1 owned by several (first: 1, by ranks 0, 1)'
    >>> ownership([[0, 1], [], [2]], size=3).complete
    True
    """

    size: int
    counts: np.ndarray
    indices: tuple[np.ndarray, ...]

    @property
    def missing(self) -> np.ndarray:
        """Positions no rank claims."""
        return np.flatnonzero(self.counts == 0)

    @property
    def doubled(self) -> np.ndarray:
        """Positions claimed by more than one rank (or twice by one)."""
        return np.flatnonzero(self.counts > 1)

    @property
    def complete(self) -> bool:
        """Every position owned exactly once."""
        return bool(np.all(self.counts == 1))

    def owners_of(self, position: int) -> list[int]:
        """The ranks that claim ``position``, in rank order (a rank twice if it claims it
        twice)."""
        return [r for r, idx in enumerate(self.indices) for i in idx.tolist() if i == position]

    def describe(self, name: Callable[[int], str] = str) -> str:
        """What is wrong, for a message; ``name(position)`` renders a position."""
        parts = []
        missing, doubled = self.missing, self.doubled
        if len(missing):
            s = "" if len(missing) == 1 else "s"
            parts.append(
                f"{len(missing)} position{s} owned by no rank (first: {name(int(missing[0]))})"
            )
        if len(doubled):
            pos = int(doubled[0])
            owners = ", ".join(map(str, self.owners_of(pos)))
            parts.append(f"{len(doubled)} owned by several (first: {name(pos)}, by ranks {owners})")
        return "; ".join(parts)


def ownership(indices: Iterable[npt.ArrayLike], size: int) -> Ownership:
    """Count the ranks claiming each position of ``[0, size)``; ``indices[r]`` are rank
    ``r``'s global positions (any integer array-like; empty for an empty rank).

    Raises ``ConfigError`` for a position outside ``[0, size)``: those are named per rank
    by the caller, which knows what the positions are.
    """
    _check_int("size", size, 0)
    arrays = tuple(np.asarray(i, dtype=np.int64).reshape(-1) for i in indices)
    counts = np.zeros(int(size), dtype=np.int64)
    for r, idx in enumerate(arrays):
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise ConfigError(
                f"rank {r} claims positions {int(idx.min())}..{int(idx.max())} outside "
                f"[0, {size}); positions are global, not local"
            )
        np.add.at(counts, idx, 1)
    return Ownership(int(size), counts, arrays)


# ---------------------------------------------------------------------- lat/lon


@dataclass(frozen=True)
class LatLonPartition:
    """An ``nlat x nlon`` grid split over ``h`` polar x ``w`` azimuth ranks.

    Spatial rank ``p * w + a`` (polar index ``p``, azimuth index ``a``, as in
    ``Topology.grid``) owns latitudes ``lat_slice(p)`` and longitudes ``lon_slice(a)``.
    Every block is non-empty: the distributed SHT needs at least one latitude and one
    longitude per rank.

    >>> part = LatLonPartition(nlat=5, nlon=8, h=2, w=3)
    >>> part.lat_sizes, part.lon_sizes
    ([3, 2], [3, 3, 2])
    >>> part.slices(4)                     # p=1, a=1
    (slice(3, 5, None), slice(3, 6, None))
    >>> part.index(5).tolist()             # flat lat*nlon+lon, row-major in the block
    [30, 31, 38, 39]
    >>> part.where(39)                     # (lat, lon, owning rank)
    (4, 7, 5)
    """

    nlat: int
    nlon: int
    h: int = 1
    w: int = 1
    rule: str | None = None  # split rule; None: the installed torch-harmonics' (sht_split_rule)
    #: what reports call a position along each of the two dims: ("lat", "lon") for a grid;
    #: ("l", "m") for spectral coefficients split the same way (a distributed SHT's modes)
    axes: tuple[str, str] = field(default=("lat", "lon"), repr=False)
    lat_sizes: list[int] = field(init=False, repr=False, compare=False)
    lon_sizes: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("nlat", "nlon", "h", "w"):
            _check_int(name, getattr(self, name), 1)
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.rule is None:
            object.__setattr__(self, "rule", sht_split_rule())
        elif self.rule not in SPLIT_RULES:
            raise ConfigError(f"unknown split rule {self.rule!r}; use one of {SPLIT_RULES}")
        for dim, n, parts, axis in (
            ("nlat", self.nlat, self.h, "h"),
            ("nlon", self.nlon, self.w, "w"),
        ):
            if n < parts:
                raise ConfigError(
                    f"LatLonPartition: {dim}={n} does not fit {axis}={parts} ranks: "
                    f"{split_sizes(n, parts, self.rule)} would leave ranks without a "
                    f"{'latitude' if dim == 'nlat' else 'longitude'}; choose {axis} <= {n} "
                    f"or a grid with {dim} >= {parts}"
                )
        if (
            not isinstance(self.axes, tuple)
            or len(self.axes) != 2
            or not all(isinstance(a, str) and a for a in self.axes)
        ):
            raise ConfigError(
                f"LatLonPartition: axes={self.axes!r}; give two names for the two dims, "
                'e.g. axes=("l", "m") for spectral coefficients'
            )
        object.__setattr__(self, "lat_sizes", split_sizes(self.nlat, self.h, self.rule))
        object.__setattr__(self, "lon_sizes", split_sizes(self.nlon, self.w, self.rule))

    @property
    def ranks(self) -> int:
        """Number of spatial ranks, ``h * w``."""
        return self.h * self.w

    def _rank(self, rank: int) -> tuple[int, int]:
        return divmod(_check_rank(rank, self.ranks, f"{self.h}x{self.w} partition"), self.w)

    def lat_slice(self, p: int) -> slice:
        """Latitudes of polar index ``p``."""
        if not 0 <= p < self.h:
            raise ConfigError(f"polar index {p} out of range for h={self.h}; use 0 <= p < {self.h}")
        off = _offsets(self.lat_sizes)
        return slice(off[p], off[p + 1])

    def lon_slice(self, a: int) -> slice:
        """Longitudes of azimuth index ``a``."""
        if not 0 <= a < self.w:
            raise ConfigError(
                f"azimuth index {a} out of range for w={self.w}; use 0 <= a < {self.w}"
            )
        off = _offsets(self.lon_sizes)
        return slice(off[a], off[a + 1])

    def slices(self, rank: int) -> tuple[slice, slice]:
        """(latitude slice, longitude slice) of spatial rank ``rank``."""
        p, a = self._rank(rank)
        return self.lat_slice(p), self.lon_slice(a)

    def shape(self, rank: int) -> tuple[int, int]:
        """(local nlat, local nlon) of spatial rank ``rank``."""
        p, a = self._rank(rank)
        return self.lat_sizes[p], self.lon_sizes[a]

    def index(self, rank: int) -> np.ndarray:
        """Flat global indices ``lat * nlon + lon`` of the rank's block, row-major, int64."""
        lats, lons = self.slices(rank)
        lat = np.arange(lats.start, lats.stop, dtype=np.int64)
        lon = np.arange(lons.start, lons.stop, dtype=np.int64)
        return (lat[:, None] * self.nlon + lon[None, :]).ravel()

    def where(self, flat_index: int) -> tuple[int, int, int]:
        """(lat, lon, owning rank) of flat index ``lat * nlon + lon``."""
        if not 0 <= flat_index < self.nlat * self.nlon:
            raise ConfigError(
                f"flat index {flat_index} is outside the {self.nlat}x{self.nlon} grid; "
                f"use 0 <= index < {self.nlat * self.nlon}"
            )
        lat, lon = divmod(int(flat_index), self.nlon)
        p = bisect_right(_offsets(self.lat_sizes), lat) - 1
        a = bisect_right(_offsets(self.lon_sizes), lon) - 1
        return lat, lon, p * self.w + a


# ---------------------------------------------------------------------- HEALPix cells


def _check_nside(nside: object) -> int:
    if (
        not isinstance(nside, (int, np.integer))
        or isinstance(nside, bool)
        or nside < 1
        or nside & (nside - 1)
        or nside > 2**29
    ):
        hint = ""
        whole = isinstance(nside, (int, np.integer)) and not isinstance(nside, bool)
        if whole and isinstance(nside, (int, np.integer)) and 2 < nside < 2**29:
            # between two valid powers of two: name them (isinstance again: mypy narrows here)
            below = 1 << (int(nside).bit_length() - 1)
            hint = f" (nearest: {below} or {2 * below})"
        raise ConfigError(
            f"nside must be a power of two between 1 and 2**29 for NESTED HEALPix, got "
            f"{nside!r}; choose 1, 2, 4, 8, ...{hint}"
        )
    return int(nside)


def cell_of(nside: int, lat_deg: npt.ArrayLike, lon_deg: npt.ArrayLike) -> np.ndarray:
    """NESTED HEALPix cell of each (latitude, longitude) in degrees.

    >>> cell_of(1, [80.0, -80.0], [45.0, 45.0]).tolist()
    [0, 8]
    """
    import healpy as hp

    nside = _check_nside(nside)
    lat = np.asarray(lat_deg, dtype=np.float64)
    lon = np.asarray(lon_deg, dtype=np.float64)
    if not np.all(np.abs(lat) <= 90) or not np.all(np.isfinite(lon)):  # NaN latitudes too
        raise ConfigError(
            "cell_of needs latitudes in [-90, 90] degrees and finite longitudes; got "
            f"latitudes in [{lat.min()}, {lat.max()}]; did you swap lat and lon?"
        )
    return np.asarray(hp.ang2pix(nside, lon, lat, nest=True, lonlat=True), dtype=np.int64)


@functools.cache
def _neighbours(nside: int) -> np.ndarray:
    import healpy as hp

    cells = np.arange(12 * nside * nside, dtype=np.int64)
    around = np.asarray(hp.get_all_neighbours(nside, cells, nest=True), dtype=np.int64).T
    table = np.concatenate([cells[:, None], around], axis=1)
    # healpy marks the neighbour a base-pixel corner lacks with -1 (two per cell at nside 1,
    # one each for 24 cells above); a -1 used as an index silently reads the last cell.
    table = np.where(table < 0, cells[:, None], table)
    table.setflags(write=False)  # shared by every caller through the cache
    return table


@dataclass(frozen=True)
class CellPartition:
    """NESTED HEALPix cells, ``bounds[r]:bounds[r+1]`` owned by spatial rank ``r``.

    ``bounds`` has ``ranks + 1`` entries from 0 to ``npix``, non-decreasing; equal
    neighbours make an empty rank. Contiguous nested ranges are compact regions, so halos
    stay small.

    >>> part = CellPartition(nside=1, bounds=(0, 5, 5, 12))
    >>> part.npix, part.ranks, part.sizes
    (12, 3, [5, 0, 7])
    >>> part.cells(2)
    range(5, 12)
    >>> part.rank_of(5), part.rank_of(np.array([0, 4, 11])).tolist()
    (2, [0, 0, 2])
    >>> CellPartition.even(nside=1, ranks=5).sizes    # balanced: sizes differ by <= 1
    [3, 3, 2, 2, 2]
    >>> part.halo(1).tolist()                         # an empty rank needs nothing
    []
    >>> part.packed_slice(np.arange(12), 2)           # cell c holds c values
    slice(10, 66, None)
    """

    nside: int
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nside", _check_nside(self.nside))
        try:
            bounds = tuple(int(b) for b in self.bounds)
            exact = all(int(b) == b for b in self.bounds)
        except (TypeError, ValueError):
            bounds, exact = (), False
        npix = self.npix
        if not exact or len(bounds) < 2:
            raise ConfigError(
                f"CellPartition bounds must be integers, one more than the ranks, got "
                f"{self.bounds!r}; e.g. (0, {npix // 2}, {npix}) for 2 ranks, or "
                "CellPartition.even(nside, ranks)"
            )
        if bounds[0] != 0 or bounds[-1] != npix:
            raise ConfigError(
                f"CellPartition bounds must run from 0 to npix={npix} (nside={self.nside}), "
                f"got {bounds[0]} .. {bounds[-1]}; every cell must be owned: "
                f"start at 0 and end at {npix}"
            )
        dips = [r for r in range(len(bounds) - 1) if bounds[r + 1] < bounds[r]]
        if dips:
            r = dips[0]
            raise ConfigError(
                f"CellPartition bounds must be non-decreasing, but rank {r}'s range "
                f"{bounds[r]}:{bounds[r + 1]} runs backwards; sort the bounds "
                "(equal bounds give an empty rank)"
            )
        object.__setattr__(self, "bounds", bounds)

    @classmethod
    def even(cls, nside: int, ranks: int) -> CellPartition:
        """Split the cells over ``ranks`` as evenly as possible (sizes differ by <= 1).

        Fixed, whatever torch-harmonics is installed: HEALPix has no SHT to line up with.
        """
        nside = _check_nside(nside)
        _check_int("ranks", ranks, 1)
        sizes = split_sizes(12 * nside * nside, int(ranks), rule="balanced")
        return cls(nside, tuple(_offsets(sizes)))

    @classmethod
    def uneven(cls, nside: int, ranks: int) -> CellPartition:
        """Cells split unevenly (``uneven_sizes``: the first rank short), ``ranks >= 2``.

        >>> CellPartition.uneven(nside=2, ranks=4).sizes
        [6, 14, 14, 14]
        """
        nside = _check_nside(nside)
        return cls(nside, tuple(_offsets(uneven_sizes(12 * nside * nside, ranks))))

    @classmethod
    def with_empty_rank(cls, nside: int, ranks: int, empty: int = 1) -> CellPartition:
        """Spatial rank ``empty`` owns no cell; the others split the cells evenly.

        >>> CellPartition.with_empty_rank(nside=1, ranks=3).sizes
        [6, 0, 6]
        """
        nside = _check_nside(nside)
        _check_int("ranks", ranks, 2)
        r = _check_rank(empty, int(ranks), f"{ranks}-rank cell partition")
        sizes = split_sizes(12 * nside * nside, int(ranks) - 1, rule="balanced")
        return cls(nside, tuple(_offsets([*sizes[:r], 0, *sizes[r:]])))

    @property
    def npix(self) -> int:
        """Number of cells, ``12 * nside**2``."""
        return 12 * self.nside * self.nside

    @property
    def ranks(self) -> int:
        """Number of spatial ranks, ``len(bounds) - 1``."""
        return len(self.bounds) - 1

    @property
    def sizes(self) -> list[int]:
        """Cells per rank."""
        return [self.bounds[r + 1] - self.bounds[r] for r in range(self.ranks)]

    def cells(self, rank: int) -> range:
        """The rank's cells, in nested order."""
        r = _check_rank(rank, self.ranks, f"{self.ranks}-rank cell partition")
        return range(self.bounds[r], self.bounds[r + 1])

    def rank_of(self, cell: int | np.ndarray) -> int | np.ndarray:
        """Owning rank of each cell (never an empty rank: its range contains no cell)."""
        arr = np.asarray(cell)
        if arr.dtype.kind not in "iu" or np.any(arr < 0) or np.any(arr >= self.npix):
            raise ConfigError(
                f"rank_of needs integer cells in [0, {self.npix}) for nside={self.nside}; "
                f"got {cell!r}; are these cells of another nside, or ring-ordered?"
            )
        owner = np.searchsorted(np.asarray(self.bounds), arr, side="right") - 1
        return int(owner) if owner.ndim == 0 else owner.astype(np.int64)

    def neighbours(self) -> np.ndarray:
        """(npix, 9) int64 global cells: self, then healpy's 8 neighbours (SW, W, NW, N, NE,
        E, SE, S); a missing neighbour (-1) is replaced by the cell itself. Read-only, cached
        per nside."""
        return _neighbours(self.nside)

    def halo(self, rank: int) -> np.ndarray:
        """Sorted unique cells outside the rank's range that its cells' neighbours name."""
        r = _check_rank(rank, self.ranks, f"{self.ranks}-rank cell partition")
        lo, hi = self.bounds[r], self.bounds[r + 1]
        near = self.neighbours()[lo:hi].ravel()
        return np.unique(near[(near < lo) | (near >= hi)])

    def local_neighbours(self, rank: int) -> np.ndarray:
        """(sizes[rank], 9) neighbours table of the rank's cells, as positions in the rank's
        cells followed by its halo (``concat(own, halo_exchange(...))``)."""
        r = _check_rank(rank, self.ranks, f"{self.ranks}-rank cell partition")
        lo, hi = self.bounds[r], self.bounds[r + 1]
        near = self.neighbours()[lo:hi]
        halo = self.halo(r)
        inside = (near >= lo) & (near < hi)
        return np.where(inside, near - lo, (hi - lo) + np.searchsorted(halo, near))

    def packed_slice(self, counts: np.ndarray, rank: int) -> slice:
        """The rank's slice of variable-length data packed in cell order, ``counts[c]``
        items for cell ``c``. Empty cells and empty ranks give empty slices."""
        r = _check_rank(rank, self.ranks, f"{self.ranks}-rank cell partition")
        counts = np.asarray(counts)
        if counts.shape != (self.npix,) or counts.dtype.kind not in "iu" or np.any(counts < 0):
            raise ConfigError(
                f"packed_slice needs one non-negative integer count per cell, shape "
                f"({self.npix},) for nside={self.nside}; got shape {counts.shape} of "
                f"{counts.dtype}; use np.bincount(cells, minlength={self.npix})"
            )
        start = int(counts[: self.bounds[r]].sum())
        return slice(start, start + int(counts[self.bounds[r] : self.bounds[r + 1]].sum()))
