"""Autograd-aware collectives over a Topology's spatial group.

Each operation is a private ``torch.autograd.Function`` with a public verb. The first line
of each docstring says what forward and backward do: picking the wrong backward is the most
common way a spatially parallel model silently computes wrong gradients (FAULTS.md).

With the reference's topology (``Topology.single()``, no groups) every operation is local:
the identity, ``assemble`` places values in one tensor, ``halo_exchange`` returns an empty
halo. So one model code path serves both the reference and the partitioned run.

Gloo notes (checked on torch 2.13): ``all_gather`` needs equal shapes, so uneven shards are
padded to the longest and stripped after; gloo has no ``reduce_scatter``, so backward of a
gather all-reduces the gradient and each rank keeps its own slice. ``all_to_all_single``
with uneven and zero split sizes works on gloo (also in subgroups), so the halo exchange
sends each rank exactly the cells it needs, no padding.

Argument checks that could fail on one rank only are decided together (one small
all-gather of every rank's verdict), so a bad call raises the same ``ConfigError`` on every
rank instead of leaving the others waiting in the next collective.

Every backward here is a collective too: each rank must back-propagate through every
collective it called (an empty rank included: its loss part is a zero that still depends on
the output), or the ranks that do will wait for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from harness.errors import ConfigError
from harness.partition import CellPartition, LatLonPartition, ownership
from harness.topology import Topology

# ---------------------------------------------------------------------- sums


def apply(function: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """``function.apply(*args)``, typed: torch's stubs leave ``Function.apply`` untyped."""
    return cast(torch.Tensor, function.apply(*args))


class _Ctx(FunctionCtx):
    """Autograd's ``ctx`` with the fields these functions keep on it (torch leaves it untyped)."""

    group: ProcessGroup | None
    dim: int
    sizes: list[int]
    rank: int
    saved_tensors: tuple[torch.Tensor, ...]


#: (local positions to send, in send order; send counts per rank; receive counts per rank)
_HaloPlan = tuple[torch.Tensor, list[int], list[int]]


class _HaloCtx(_Ctx):
    plan: _HaloPlan
    local_shape: torch.Size


class _GridCtx(_Ctx):
    plan: tuple[torch.Tensor, ...]
    shape: torch.Size


class _SpatialSum(torch.autograd.Function):
    """Forward: all-reduce SUM over the group. Backward: all-reduce SUM of the gradient."""

    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out  # replicated: every rank holds the same global sum

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        # every rank used the sum; each rank's part influenced all of those uses
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def spatial_sum(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Sum ``x`` over the spatial group; gradients summed back over the group too.

    For a global value inside the model (a global mean feeding every rank's next layer):
    every rank's use of the sum depends on every rank's part, so each part's gradient is the
    sum of all ranks' gradients. Identity for the reference.
    """
    if topo.spatial_group is None or topo.spatial_size == 1:
        return x
    out = apply(_SpatialSum, x, topo.spatial_group)
    return out


class _ReduceLoss(torch.autograd.Function):
    """Forward: all-reduce SUM over the group. Backward: identity (the value is counted once)."""

    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out  # replicated: the global loss on every rank

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Each rank back-propagates the same replicated loss; summing here too would count
        # every local part S times (the gradient sync over the group already adds them up).
        return grad, None


def reduce_loss(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Sum per-rank loss parts into the global loss; identity backward.

    For the loss (or any replicated scalar that ends the graph): each rank gets d loss / d its
    local part, and parameter gradients are summed over the group afterwards
    (``sync_gradients``). Using ``spatial_sum`` here counts each part S times; using this
    inside the model drops the other ranks' share. Identity for the reference.
    """
    if topo.spatial_group is None or topo.spatial_size == 1:
        return x
    out = apply(_ReduceLoss, x, topo.spatial_group)
    return out


# ---------------------------------------------------------------------- gathers

_META_DIMS = 8  # trailing-shape slots compared across ranks (more dims: only the first 8)


def _agree(
    x: torch.Tensor, dim: int, group: ProcessGroup, size: int, problem: int = 0
) -> list[int]:
    """Every rank's length along ``dim``, after checking together that the call is sound.

    One small all-gather carries each rank's length, its other dims and ``problem`` (a
    nonzero code from its local argument checks). Every rank then sees every rank's verdict
    and raises the same ``ConfigError``: a rank that raised alone would leave the others
    waiting in the next collective.
    """
    others = [d for i, d in enumerate(x.shape) if i != dim][:_META_DIMS]
    meta = torch.tensor(
        [x.shape[dim], problem, x.dim(), *others] + [-1] * (_META_DIMS - len(others)),
        dtype=torch.long,
    )
    parts = [torch.empty_like(meta) for _ in range(size)]
    dist.all_gather(parts, meta, group=group)
    table = torch.stack(parts).tolist()
    for r, row in enumerate(table):
        if row[1]:
            raise ConfigError(f"rank {r}/{size}: {_PROBLEMS[row[1]]}")
    shapes = {tuple(row[2:]) for row in table}
    if len(shapes) > 1:
        seen = {r: (row[2], [d for d in row[3:] if d >= 0]) for r, row in enumerate(table)}
        raise ConfigError(
            f"shards disagree outside dim {dim}: (ndim, other dims) per rank {seen}; every "
            "rank's shard must have the same shape except along the gathered dim"
        )
    return [row[0] for row in table]


_PROBLEMS = {
    1: "index must be a 1-D integer tensor (or a slice) of global positions",
    2: "index and values disagree: len(index) != values.shape[dim]; give one position per value",
    3: "index holds positions outside [0, size); positions are global, not local",
    4: "x's length along dim is not the rank's number of cells in the partition; pass only "
    "this rank's cells, in cell order",
}


def _gather_padded(
    x: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int]
) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` in rank order (no autograd)."""
    longest = max(max(sizes), 1)  # gloo dislikes zero-element tensors
    pad_shape = list(x.shape)
    pad_shape[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    # gloo's all_gather needs equal shapes: pad to the longest shard, strip after
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


class _AllGatherUneven(torch.autograd.Function):
    """Forward: pad, all-gather, strip, concatenate in rank order. Backward: all-reduce SUM of
    the gradient, then each rank keeps the slice of its own shard."""

    @staticmethod
    def forward(
        ctx: _Ctx, x: torch.Tensor, dim: int, group: ProcessGroup, size: int
    ) -> torch.Tensor:
        dim = dim % x.dim()
        sizes = _agree(x, dim, group, size)
        out = _gather_padded(x, dim, group, sizes)
        # replicated: every rank holds all shards, padding stripped, in rank order
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        ctx.rank = dist.get_rank(group)
        return out

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous().clone()
        # every rank used the whole gathered tensor: a shard's gradient is the sum of all uses
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]).contiguous(), None, None, None


def all_gather_uneven(x: torch.Tensor, topo: Topology, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's shard of ``x`` along ``dim`` in spatial-rank order.

    Shards may differ in length (or be empty). Backward sums the gradient over the group and
    returns each rank the part for its own shard: the autograd gather that
    ``torch.distributed.nn.functional.all_gather`` fails to be on gloo subgroups.
    """
    if topo.spatial_group is None or topo.spatial_size == 1:
        return x
    out = apply(_AllGatherUneven, x, dim, topo.spatial_group, topo.spatial_size)
    return out


def _index_problem(index: object, n: int, size: int) -> int:
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
        return 1
    if index.numel() != n:
        return 2
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= size):
        return 3
    return 0


def _check_coverage(index: torch.Tensor, sizes: list[int], size: int) -> None:
    """Raise unless the gathered ``index`` names every position in ``[0, size)`` exactly once."""
    per_rank = torch.split(index.cpu(), sizes)
    own = ownership([i.numpy() for i in per_rank], size)
    if own.complete:
        return
    raise ConfigError(
        f"assemble: the ranks' indices do not own each of the {size} positions exactly once: "
        f"{own.describe()}; shard lengths per rank {sizes}. Give every global position "
        "to exactly one rank (see LatLonPartition.index / CellPartition.cells)"
    )


class _Assemble(torch.autograd.Function):
    """Forward: all-gather every rank's values and positions, place them in the global tensor
    (replicated). Backward: all-reduce SUM of the gradient, each rank keeps its positions."""

    @staticmethod
    def forward(
        ctx: _Ctx,
        values: torch.Tensor,
        index: torch.Tensor,
        size: int,
        dim: int,
        group: ProcessGroup,
        world: int,
        problem: int,
    ) -> torch.Tensor:
        dim = dim % values.dim()
        sizes = _agree(values, dim, group, world, problem)
        everywhere = _gather_padded(index, 0, group, sizes)
        _check_coverage(everywhere, sizes, size)  # same data on every rank: same verdict
        shape = list(values.shape)
        shape[dim] = size
        gathered = _gather_padded(values, dim, group, sizes)
        out = values.new_zeros(shape).index_copy_(dim, everywhere, gathered)
        # replicated: every rank holds the whole global tensor
        ctx.dim, ctx.group = dim, group
        ctx.save_for_backward(index)
        return out

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        grad = grad.contiguous().clone()
        # every rank used the replicated tensor: a position's gradient is the sum of all uses
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(ctx.dim, index), None, None, None, None, None, None


def assemble(
    values: torch.Tensor, index: torch.Tensor | slice, size: int, topo: Topology, dim: int = -1
) -> torch.Tensor:
    """Place every rank's shard at its global positions: the global tensor, on every rank.

    ``values`` holds this rank's entries at global positions ``index`` (a 1-D integer tensor,
    or a slice) along ``dim``; the result has length ``size`` along ``dim`` and is replicated.
    Every position must be owned by exactly one rank (checked together on every rank: a
    ``ConfigError`` names the missing or doubly owned positions). Backward gives each rank
    the sum over ranks of the gradient at its positions. For the reference it places
    ``values`` locally (the same coverage check applies).
    """
    if isinstance(index, slice):
        index = torch.arange(size)[index]
    dim_ = dim % values.dim() if values.dim() else 0
    problem = _index_problem(index, values.shape[dim_] if values.dim() else -1, size)
    if problem == 0:
        index = index.to(device=values.device, dtype=torch.long)
    if topo.spatial_group is None or topo.spatial_size == 1:
        if problem:
            raise ConfigError(_PROBLEMS[problem])
        _check_coverage(index, [index.numel()], size)
        shape = list(values.shape)
        shape[dim_] = size
        return values.new_zeros(shape).index_copy(dim_, index, values)
    if problem:
        index = torch.zeros(0, dtype=torch.long, device=values.device)
    out = apply(
        _Assemble, values, index, size, dim_, topo.spatial_group, topo.spatial_size, problem
    )
    return out


# ---------------------------------------------------------------------- halo exchange


@functools.lru_cache(maxsize=32)
def _halo_plan(partition: CellPartition, rank: int) -> _HaloPlan:
    """(local positions to send, in send order; send counts per rank; receive counts per
    rank) for ``rank``. Every rank derives it from the same partition: no negotiation."""
    lo = partition.bounds[rank]
    halos = [partition.halo(q) for q in range(partition.ranks)]
    owners = [np.asarray(partition.rank_of(h)) for h in halos]
    # halo(q) is sorted and ranges are contiguous in rank order, so the cells q receives
    # arrive grouped by owner in halo order: no reordering on the receiving side
    sends = [h[o == rank] - lo for h, o in zip(halos, owners, strict=True)]
    send_index = torch.from_numpy(np.concatenate(sends).astype(np.int64))
    send_splits = [len(s) for s in sends]
    recv_splits = np.bincount(owners[rank], minlength=partition.ranks).tolist()
    return send_index, send_splits, recv_splits


class _HaloExchange(torch.autograd.Function):
    """Forward: all-to-all each rank's cells to the ranks whose halo names them. Backward:
    all-to-all the halo gradients back to their owners, which add them to their cells."""

    @staticmethod
    def forward(
        ctx: _HaloCtx,
        x: torch.Tensor,
        plan: _HaloPlan,
        dim: int,
        group: ProcessGroup,
    ) -> torch.Tensor:
        send_index, send_splits, recv_splits = plan
        local = x.movedim(dim, 0)
        send = local.index_select(0, send_index.to(x.device)).contiguous()
        recv = local.new_empty((sum(recv_splits), *local.shape[1:]))
        # gloo's all_to_all_single takes uneven (and zero) split sizes (checked on torch 2.13)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        # sharded: each rank holds its own halo cells, in halo order
        ctx.plan, ctx.dim, ctx.group, ctx.local_shape = plan, dim, group, local.shape
        return recv.movedim(0, dim)

    @staticmethod
    def backward(ctx: _HaloCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        send_index, send_splits, recv_splits = ctx.plan
        g = grad.movedim(ctx.dim, 0).contiguous()
        back = g.new_empty((sum(send_splits), *g.shape[1:]))
        dist.all_to_all_single(back, g, send_splits, recv_splits, group=ctx.group)
        # a cell in several halos collects every copy's gradient
        out = g.new_zeros(ctx.local_shape).index_add_(0, send_index.to(g.device), back)
        return out.movedim(0, ctx.dim), None, None, None


def halo_exchange(
    x: torch.Tensor, partition: CellPartition, topo: Topology, dim: int = -1
) -> torch.Tensor:
    """Fetch this rank's halo cells from their owners; halo gradients go back to the owners.

    ``x`` holds this rank's cells (``partition.sizes[spatial_rank]`` along ``dim``, in cell
    order). Returns the values of ``partition.halo(spatial_rank)``, in that order, along
    ``dim``; ``concat([x, halo], dim)`` is what ``partition.local_neighbours`` indexes.
    Every rank must call it, empty ranks included. For the reference (one rank, no halo) the
    result is empty along ``dim``.
    """
    if partition.ranks != topo.spatial_size:
        raise ConfigError(
            f"halo_exchange: the partition has {partition.ranks} ranks but the spatial group "
            f"{topo.spatial_size}; build it with CellPartition.even(nside, topo.spatial_size)"
        )
    dim = dim % x.dim()
    rank = topo.spatial_rank
    if topo.spatial_group is None or topo.spatial_size == 1:
        if x.shape[dim] != partition.npix:
            raise ConfigError(f"{_PROBLEMS[4]} (expected {partition.npix}, got {x.shape[dim]})")
        return x.narrow(dim, 0, 0)
    problem = 4 if x.shape[dim] != partition.sizes[rank] else 0
    _agree(x, dim, topo.spatial_group, topo.spatial_size, problem)
    out = apply(_HaloExchange, x, _halo_plan(partition, rank), dim, topo.spatial_group)
    return out


# ---------------------------------------------------------------------- lat x lon halo

#: what ``grid_halo_exchange`` puts beyond a pole: zeros, or the pole row again
POLES = ("zeros", "edge")


def _padded_sources(
    partition: LatLonPartition, q: int, width: int, pole: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each padded position of rank ``q`` (row-major): the owner rank, the owner-local
    flat index (-1: no source, a zero), and whether it lies on the globe at all."""
    nlon = partition.nlon
    lats, lons = partition.slices(q)
    rows = np.arange(lats.start - width, lats.stop + width)
    cols = np.arange(lons.start - width, lons.stop + width) % nlon
    if pole == "edge":
        rows = np.clip(rows, 0, partition.nlat - 1)
    lat, lon = np.meshgrid(rows, cols, indexing="ij")
    lat, lon = lat.ravel(), lon.ravel()
    valid = (lat >= 0) & (lat < partition.nlat)
    owner = np.full(lat.shape, -1, dtype=np.int64)
    local = np.full(lat.shape, -1, dtype=np.int64)
    for r in range(partition.ranks):
        (r_lats, r_lons), (_, r_nlon) = partition.slices(r), partition.shape(r)
        mine = valid & (lat >= r_lats.start) & (lat < r_lats.stop)
        mine &= (lon >= r_lons.start) & (lon < r_lons.stop)
        owner[mine] = r
        local[mine] = (lat[mine] - r_lats.start) * r_nlon + (lon[mine] - r_lons.start)
    return owner, local, valid


@functools.lru_cache(maxsize=32)
def _grid_halo_plan(
    partition: LatLonPartition, rank: int, width: int, pole: str
) -> tuple[torch.Tensor, ...]:
    """Where each cell of every rank's padded block comes from, as index tensors for
    ``rank``: (local source, local destination, send index, remote destination, fill
    destination) and the send / receive split sizes (last two, as tensors). Every rank
    derives it from the same partition: no negotiation.

    The padded block of rank ``q`` is its own block grown by ``width`` cells on each side.
    Longitudes wrap around the globe; latitudes beyond a pole are zeros (``pole="zeros"``)
    or the pole row repeated (``pole="edge"``).
    """
    own_owner, own_local, own_valid = _padded_sources(partition, rank, width, pole)
    positions = np.arange(own_owner.size)
    local_dst = positions[own_owner == rank]
    local_src = own_local[own_owner == rank]
    fill_dst = positions[~own_valid]
    # what arrives from each rank p, in rank order; within p in my padded order
    remote_dst = np.concatenate(
        [positions[own_owner == p] for p in range(partition.ranks) if p != rank]
        or [np.zeros(0, dtype=np.int64)]
    )
    recv_splits = [int((own_owner == p).sum()) if p != rank else 0 for p in range(partition.ranks)]
    sends, send_splits = [], []
    for q in range(partition.ranks):
        if q == rank:
            send_splits.append(0)
            continue
        owner, local, _ = _padded_sources(partition, q, width, pole)
        chunk = local[owner == rank]
        sends.append(chunk)
        send_splits.append(len(chunk))
    send_index = np.concatenate(sends or [np.zeros(0, dtype=np.int64)])

    def as_tensor(a: npt.ArrayLike) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64))

    return (
        as_tensor(local_src),
        as_tensor(local_dst),
        as_tensor(send_index),
        as_tensor(remote_dst),
        as_tensor(fill_dst),
        as_tensor(send_splits),
        as_tensor(recv_splits),
    )


class _GridHalo(torch.autograd.Function):
    """Forward: the rank's block padded with its neighbours' edge cells (own cells copied,
    others' received in one all-to-all). Backward: each padded cell's gradient goes back to
    the rank that owns the cell, which adds it to that cell (a cell in several halos, or in
    its own wrapped halo, collects every copy's gradient)."""

    @staticmethod
    def forward(
        ctx: _GridCtx,
        x: torch.Tensor,
        plan: tuple[torch.Tensor, ...],
        padded: tuple[int, int],
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        local_src, local_dst, send_index, remote_dst, _fill, send_splits, recv_splits = plan
        flat = x.reshape(*x.shape[:-2], -1)
        out = flat.new_zeros((*flat.shape[:-1], padded[0] * padded[1]))
        out[..., local_dst] = flat[..., local_src]
        if group is not None and int(send_splits.sum() + recv_splits.sum()):
            send = flat[..., send_index].movedim(-1, 0).contiguous()
            recv = send.new_empty((int(recv_splits.sum()), *send.shape[1:]))
            # gloo's all_to_all_single takes uneven and zero split sizes (torch 2.13)
            dist.all_to_all_single(
                recv, send, recv_splits.tolist(), send_splits.tolist(), group=group
            )
            out[..., remote_dst] = recv.movedim(0, -1)
        # sharded: each rank holds its own block plus a ring of its neighbours' cells
        ctx.plan, ctx.group, ctx.shape = plan, group, x.shape
        return out.reshape(*flat.shape[:-1], *padded)

    @staticmethod
    def backward(ctx: _GridCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local_src, local_dst, send_index, remote_dst, _fill, send_splits, recv_splits = ctx.plan
        g = grad.reshape(*grad.shape[:-2], -1)
        out = g.new_zeros((*g.shape[:-1], ctx.shape[-2] * ctx.shape[-1]))
        out.index_add_(-1, local_src, g[..., local_dst])
        if ctx.group is not None and int(send_splits.sum() + recv_splits.sum()):
            back = g[..., remote_dst].movedim(-1, 0).contiguous()
            mine = back.new_empty((int(send_splits.sum()), *back.shape[1:]))
            dist.all_to_all_single(
                mine, back, send_splits.tolist(), recv_splits.tolist(), group=ctx.group
            )
            out.index_add_(-1, send_index, mine.movedim(0, -1))
        return out.reshape(ctx.shape), None, None, None


def grid_halo_exchange(
    x: torch.Tensor,
    partition: LatLonPartition,
    topo: Topology,
    width: int = 1,
    pole: str = "zeros",
) -> torch.Tensor:
    """This rank's lat x lon block with a halo of ``width`` cells on every side.

    ``x`` is ``(..., nlat_local, nlon_local)``, the rank's block of ``partition`` (spatial
    rank ``topo.spatial_rank``); the result is ``(..., nlat_local + 2 width, nlon_local + 2
    width)``: the block in the middle, its neighbours' edge cells around it, for a stencil
    (a 3 x 3 convolution needs ``width=1``). Longitudes wrap around the globe; beyond a pole
    the halo is zeros (``pole="zeros"``) or the pole row again (``pole="edge"``).
    Gradients of halo cells go back to their owners. The reference (one rank, the whole
    grid) gets the same padding with no communication, so one model serves both. Every rank
    must call it, with the same arguments.
    """
    if pole not in POLES:
        raise ConfigError(f"pole must be one of {POLES}, got {pole!r}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ConfigError(f"width must be an integer >= 0, got {width!r}")
    if partition.ranks != topo.spatial_size:
        raise ConfigError(
            f"grid_halo_exchange: the partition has {partition.ranks} ranks but the spatial "
            f"group {topo.spatial_size}; use LatLonPartition(nlat, nlon, h, w) with "
            f"h * w == {topo.spatial_size} (or nlat, nlon alone for the reference)"
        )
    rank = topo.spatial_rank
    shape = partition.shape(rank)
    if tuple(x.shape[-2:]) != shape:
        raise ConfigError(
            f"grid_halo_exchange: x ends in {tuple(x.shape[-2:])} but spatial rank {rank}'s "
            f"block of the {partition.nlat}x{partition.nlon} grid is {shape}; pass the rank's "
            "own block (partition.slices(rank))"
        )
    if width > min(min(partition.lat_sizes), min(partition.lon_sizes)):
        raise ConfigError(
            f"grid_halo_exchange: width {width} is more than the narrowest block "
            f"({min(partition.lat_sizes)} rows, {min(partition.lon_sizes)} columns): a halo "
            "would need cells of ranks beyond the neighbours; use a coarser process grid"
        )
    plan = _grid_halo_plan(partition, rank, width, pole)
    padded = (shape[0] + 2 * width, shape[1] + 2 * width)
    group = topo.spatial_group if topo.spatial_size > 1 else None
    return apply(_GridHalo, x, plan, padded, group)


# ---------------------------------------------------------------------- gradient sync


def sync_gradients(module: torch.nn.Module, topo: Topology) -> list[RemovableHandle]:
    """Hook every parameter so its gradient is summed over the spatial group as it lands.

    With data groups (``topo.data_size > 1``) the summed gradient is then averaged over the
    data group, as DDP would. Every rank must produce a gradient for every parameter (an
    empty rank still runs every module, giving zeros, not ``None``), in the same order:
    hooks fire during backward, and a rank whose hook never fires leaves the others waiting.
    Each backward's contribution is reduced before it is accumulated into ``.grad``, so
    several backward passes before ``zero_grad`` (gradient accumulation) stay correct.
    Returns the hook handles (``handle.remove()`` undoes it). No-op for the reference.
    """
    if topo.spatial_group is None and topo.data_group is None:
        return []
    handles: list[RemovableHandle] = []
    for param in module.parameters():
        if param.requires_grad:
            # A hook on the incoming gradient, not a post-accumulate hook: reducing the
            # accumulated .grad would sum the earlier, already reduced, backward S times again.
            handles.append(param.register_hook(_hook(topo)))
    return handles


def _hook(topo: Topology) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        # the incoming gradient may be an expanded view or shared with other uses: own it
        grad = grad.clone(memory_format=torch.contiguous_format)
        reduce_gradient(grad, topo)
        return grad

    return reduce


def reduce_gradient(grad: torch.Tensor | None, topo: Topology) -> None:
    """In place: sum ``grad`` over the spatial group, then average over the data group."""
    if grad is None:
        return
    if topo.spatial_group is not None and topo.spatial_size > 1:
        dist.all_reduce(grad, group=topo.spatial_group)  # now the full gradient of this sample set
    if topo.data_group is not None and topo.data_size > 1:
        dist.all_reduce(grad, group=topo.data_group)
        grad.div_(topo.data_size)  # replicated on every rank: the mean over data groups


def reduce_gradients(params: Sequence[torch.nn.Parameter], topo: Topology) -> None:
    """Explicit alternative to hooks: after ``backward``, reduce every gradient in order.

    A missing gradient (``None``) is treated as zeros, so a rank whose domain is empty cannot
    leave the others waiting.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        reduce_gradient(p.grad, topo)
