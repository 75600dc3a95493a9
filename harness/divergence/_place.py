"""Placing a rank's tensor in the reference's layout, from the layouts a case declares.

A rank's tensor is placed in the reference's without annotations for the layouts a case's
``partition(topo)`` names: dims of the reference's size are replicated; a dim of the rank's
block of a ``LatLonPartition`` (the last two dims), of its cells of a ``CellPartition`` or of
its ``Positions`` is that block; a block plus a halo of ``k`` on each side is recognised; the
samples of a data group are its share of dim 0. Tensors that cannot be placed are listed as
not compared, never taken as matching (by ``harness.divergence``, whose public names these
are).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from harness.partition import CellPartition, LatLonPartition

# ---------------------------------------------------------------------- the case's layouts


@dataclass(frozen=True)
class Positions:
    """This rank's positions ``index`` along one dimension of global length ``size``.

    For a case split along one dimension (positions of a line, rows of a mesh): return it
    from ``SpatialCase.partition(topo)``. ``unit`` names a position in reports.

    >>> Positions(37, range(10, 19)).positions().tolist()[:3]
    [10, 11, 12]
    """

    size: int
    index: range | slice | Sequence[int] | torch.Tensor  # 1-D LongTensor: global positions
    unit: str = "position"

    def positions(self) -> torch.Tensor:
        if isinstance(self.index, slice):
            return torch.arange(self.size)[self.index]
        return torch.as_tensor(list(self.index) if isinstance(self.index, range) else self.index)


@dataclass(frozen=True)
class Axis:
    """One partitioned dimension as seen by one rank: the global ``size``, the rank's global
    ``positions`` (ascending), the unit for reports, and the dim it must be (``-2`` for
    latitudes, ``-1`` for longitudes; ``None``: any dim of that size)."""

    size: int
    positions: torch.Tensor
    unit: str
    dim: int | None = None
    #: which of the case's partitions it comes from: a tensor's dims are named by one
    #: partition where it can (a spectral (l, m) tensor is not half lat, half m)
    group: int = 0


def axes_of(partition: object, spatial_rank: int) -> list[Axis]:
    """The partitioned dimensions that ``partition`` (one of a case's) gives this rank, each
    named by the partition's own axis names (``LatLonPartition.axes``, ``Positions.unit``).

    >>> [a.unit for a in axes_of(LatLonPartition(4, 8, 2, 1), 1)]
    ['lat', 'lon']
    >>> [a.unit for a in axes_of(LatLonPartition(4, 5, 2, 1, axes=("l", "m")), 1)]
    ['l', 'm']
    """
    if isinstance(partition, (list, tuple)):
        out = []
        for group, p in enumerate(partition):
            out += [replace(a, group=group) for a in _axes_of(p, spatial_rank)]
        return out
    return _axes_of(partition, spatial_rank)


def _axes_of(partition: object, spatial_rank: int) -> list[Axis]:
    if partition is None:
        return []
    if isinstance(partition, (list, tuple)):  # nested lists: one group
        return [a for p in partition for a in _axes_of(p, spatial_rank)]
    if isinstance(partition, LatLonPartition):
        rows, cols = partition.slices(spatial_rank)
        lat, lon = partition.axes
        return [
            Axis(partition.nlat, torch.arange(rows.start, rows.stop), lat, -2),
            Axis(partition.nlon, torch.arange(cols.start, cols.stop), lon, -1),
        ]
    if isinstance(partition, CellPartition):
        cells = partition.cells(spatial_rank)
        return [Axis(partition.npix, torch.arange(cells.start, cells.stop), "cell")]
    if isinstance(partition, Positions):
        return [Axis(partition.size, partition.positions().long(), partition.unit)]
    raise TypeError(
        f"SpatialCase.partition returned a {type(partition).__name__}; return a "
        "LatLonPartition, a CellPartition, harness.Positions, a list of them, or None"
    )


@dataclass(frozen=True)
class Placement:
    """Where a rank's tensor sits in the reference's: per dim, ``None`` (the whole dim) or
    the global position of each local index (``-1``: a halo position outside the globe,
    not compared). ``flatten``: the reference's last two dims are flattened first (a
    ``Shard.grid`` the case gave)."""

    index: tuple[torch.Tensor | None, ...]
    units: tuple[str, ...]
    flatten: tuple[int, int] | None = None


def place(
    local: Sequence[int],
    ref: Sequence[int],
    axes: Sequence[Axis],
    data: tuple[int, int] = (0, 1),
) -> Placement | None:
    """How a rank's tensor of shape ``local`` sits in the reference's of shape ``ref``, or
    ``None`` when nothing the case declared explains it.

    ``data`` is (data rank, data size): with several data groups dim 0 may be the group's
    share of the samples.

    >>> lat = Axis(4, torch.arange(2, 4), "lat", -2)
    >>> p = place((3, 2, 8), (3, 4, 8), [lat])
    >>> [None if i is None else i.tolist() for i in p.index]
    [None, [2, 3], None]
    >>> place((3, 5, 8), (3, 4, 8), [lat]) is None   # 5 rows: not a block of 4 nor a halo
    True
    >>> [i.tolist() for i in place((4, 8), (4, 8), [lat]).index if i is not None]   # whole
    []
    >>> place((4, 8), (4, 8, 1), [lat]) is None
    True
    """
    if len(local) != len(ref):
        return None
    axes = _by_fit(local, ref, axes)
    ndim, used = len(ref), set()
    index: list[torch.Tensor | None] = []
    units: list[str] = []
    for i, (n_local, n_ref) in enumerate(zip(local, ref)):
        if n_local == n_ref:  # the whole dim (a partitioned one all on this rank, too)
            index.append(None)
            whole = [a.unit for a in axes if a.dim in (None, i - ndim) and a.size == n_ref]
            units.append(whole[0] if whole else "")
            continue
        found = None
        if i == 0 and data[1] > 1 and n_ref == n_local * data[1]:
            found = torch.arange(data[0] * n_local, (data[0] + 1) * n_local), "sample"
        for k, axis in enumerate(axes):
            if found is not None:
                break
            if k in used or (axis.dim is not None and axis.dim != i - ndim):
                continue
            hit = _along(axis, n_local, n_ref)
            if hit is not None:
                used.add(k)
                found = hit, axis.unit
        if found is None:
            return None
        index.append(found[0])
        units.append(found[1])
    return Placement(tuple(index), tuple(units))


def _by_fit(local: Sequence[int], ref: Sequence[int], axes: Sequence[Axis]) -> list[Axis]:
    """The axes, those of the partition that explains most of this tensor's dims first (a
    tensor of (l, m) modes whose l count is the grid's latitude count is named l, m)."""
    ndim = len(ref)

    def fits(axis: Axis, i: int) -> bool:
        if axis.dim is not None and axis.dim != i - ndim:
            return False
        if local[i] == ref[i]:
            return axis.size == ref[i]
        return _along(axis, local[i], ref[i]) is not None

    score: dict[int, int] = {}
    for a in axes:
        score.setdefault(a.group, 0)
    for g in score:
        score[g] = sum(any(a.group == g and fits(a, i) for a in axes) for i in range(ndim))
    order = sorted(score, key=lambda g: -score[g])  # stable: the case's order on a tie
    return sorted(axes, key=lambda a: order.index(a.group))


def _along(axis: Axis, n_local: int, n_ref: int) -> torch.Tensor | None:
    """The global positions of ``n_local`` entries along ``axis``: its block, or its block
    with a halo of ``k`` each side (positions off the globe are ``-1``; a reference padded
    by the same ``k`` is indexed in its padded coordinates)."""
    own = axis.positions
    if n_ref == axis.size and n_local == len(own):
        return own
    extra = n_local - len(own)
    if extra <= 0 or extra % 2 or len(own) == 0:
        return None
    if not bool((own[1:] - own[:-1] == 1).all()):  # a halo is recognised on contiguous blocks
        return None
    k = extra // 2
    start = int(own[0])
    if n_ref == axis.size:
        pos = torch.arange(start - k, start + len(own) + k)
        return torch.where((pos >= 0) & (pos < axis.size), pos, -1)
    if n_ref == axis.size + extra:  # the reference pads too: the window of its padded tensor
        return torch.arange(start, start + n_local)
    return None


def shard_placement(
    index: torch.Tensor, dim: int, ndim: int, grid: tuple[int, int] | None
) -> Placement:
    """A ``Shard`` the case gave for a tensor: positions along one dim."""
    dim = dim % ndim
    units = tuple("position" if d == dim else "" for d in range(ndim))
    return Placement(tuple(index.long() if d == dim else None for d in range(ndim)), units, grid)


def _view(t: torch.Tensor, p: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's part that a placement names, and where it is defined (halo positions
    off the globe are not)."""
    if p.flatten is not None:
        t = t.reshape(*t.shape[:-2], -1)
    keep = torch.ones((), dtype=torch.bool)
    for d, index in enumerate(p.index):
        if index is None:
            continue
        t = t.index_select(d, index.clamp(min=0))
        shape = [1] * len(p.index)
        shape[d] = len(index)
        keep = keep & (index >= 0).reshape(shape)
    return t, keep.expand(t.shape) if t.dim() else keep


def _where(flat: int, shape: Iterable[int], p: Placement) -> str:
    """The worst element's global position: ``"[1, 3, lat 7, lon 12]"``."""
    shape = tuple(shape)
    if not shape:
        return ""
    coords = np.unravel_index(flat, shape)
    parts = []
    for d, c in enumerate(coords):
        index = p.index[d] if d < len(p.index) else None
        unit = p.units[d] if d < len(p.units) else ""
        if index is None:
            parts.append(f"{unit} {int(c)}" if unit else str(int(c)))
        else:
            parts.append(f"{unit} {int(index[int(c)])}")
    return "[" + ", ".join(parts) + "]"


# ---------------------------------------------------------------------- a misplaced block


def block_of(
    axes: Sequence[Axis], local: Sequence[int], ref: Sequence[int], like: Placement
) -> Placement | None:
    """A rank's own block of its partition (``axes``) for a tensor of shape ``local``, in
    the form of ``like`` (a ``Shard.grid``'s flattened grid, or dims of their own)."""
    if like.flatten is None:
        return place(local, ref, axes)
    rows = [a for a in axes if a.dim == -2]
    cols = [a for a in axes if a.dim == -1]
    if not rows or not cols:
        return None
    index = (rows[0].positions[:, None] * like.flatten[1] + cols[0].positions[None, :]).reshape(-1)
    dim = len(like.index) - 1
    if local[dim] != len(index):
        return None
    return replace(like, index=tuple(index if d == dim else None for d in range(len(like.index))))


def same_positions(a: Placement, b: Placement) -> bool:
    """Whether two placements name the same positions of the reference."""
    if len(a.index) != len(b.index) or a.flatten != b.flatten:
        return False
    return all(
        (i is None and j is None)
        or (i is not None and j is not None and i.shape == j.shape and bool((i == j).all()))
        for i, j in zip(a.index, b.index)
    )


def span(p: Placement, axes: Sequence[Axis] = ()) -> str:
    """The positions a placement names, in the partition's words: ``"(lat 0:4, lon 4:8)"``.

    >>> span(Placement((None, torch.arange(4, 8)), ("", "position")))
    '(position 4:8)'
    """
    parts = []
    for d, index in enumerate(p.index):
        if index is None:
            continue
        if p.flatten is not None and d == len(p.index) - 1:
            names = [a.unit for a in axes if a.dim == -2][:1] + [
                a.unit for a in axes if a.dim == -1
            ][:1]
            names = names if len(names) == 2 else ["lat", "lon"]
            ncols = p.flatten[1]
            parts += [f"{names[0]} {_range(index // ncols)}", f"{names[1]} {_range(index % ncols)}"]
        else:
            parts.append(f"{p.units[d] or f'dim {d}'} {_range(index)}")
    return "(" + ", ".join(parts) + ")"


def _range(index: torch.Tensor) -> str:
    """``"4:8"`` for contiguous positions, else the first few: ``"1, 5, 9, ... (6)"``."""
    values = sorted(set(index.tolist()))
    if not values:
        return "none"
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}:{values[-1] + 1}"
    shown = ", ".join(str(v) for v in values[:3])
    return shown if len(values) <= 3 else f"{shown}, ... ({len(values)})"
