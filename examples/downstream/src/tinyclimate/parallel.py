"""Latitude bands and the two collectives the model needs, written against torch.distributed.

``group`` is the process group of the ranks that share one globe, or ``None`` for the
serial model. Rank ``r`` of the group owns band ``r`` (bands run north to south), so its
neighbours are ``r - 1`` (north) and ``r + 1`` (south); the poles have no neighbour.

Two deliberate bugs can be switched on (argument ``bug``, or env ``TINYCLIMATE_BUG``), so a
test suite can show that it catches them:

- ``halo``: each band sends its *first* row south and its *last* row north (edge rows
  swapped): neighbours receive the wrong halo rows;
- ``halo-backward``: the halo is exchanged outside autograd, so the gradient a neighbour
  computes for a halo row never reaches the band that owns it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

BUGS = ("halo", "halo-backward")


def resolve_bug(bug: str | None) -> str | None:
    """``bug``, else ``$TINYCLIMATE_BUG``; ``None`` when neither is set. Unknown names raise."""
    bug = bug if bug is not None else (os.environ.get("TINYCLIMATE_BUG") or None)
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown tinyclimate bug {bug!r}; choose one of {BUGS} (or unset it)")
    return bug


def latitude_band(nlat: int, rank: int, size: int) -> slice:
    """Rows of band ``rank`` out of ``size``: contiguous, sizes differ by at most one.

    >>> [latitude_band(10, r, 4) for r in range(4)]
    [slice(0, 3, None), slice(3, 6, None), slice(6, 8, None), slice(8, 10, None)]
    """
    if not 0 < size <= nlat:
        raise ValueError(
            f"{nlat} latitudes cannot be split into {size} bands of at least one row each; "
            f"use at most {nlat} ranks per globe"
        )
    base, extra = divmod(nlat, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _neighbours(group: Any) -> tuple[int | None, int | None]:
    """Global ranks of the northern and southern neighbour band (``None`` at a pole)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    north = dist.get_global_rank(group, rank - 1) if rank > 0 else None
    south = dist.get_global_rank(group, rank + 1) if rank < size - 1 else None
    return north, south


def _swap(
    up: torch.Tensor, down: torch.Tensor, north: int | None, south: int | None, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``up`` to the northern and ``down`` to the southern neighbour; return what the
    northern and the southern neighbour sent. Zeros where there is no neighbour."""
    up, down = up.contiguous(), down.contiguous()
    from_north, from_south = torch.zeros_like(down), torch.zeros_like(up)
    requests = []
    if north is not None:
        requests.append(dist.isend(up, north, group=group))
        requests.append(dist.irecv(from_north, north, group=group))
    if south is not None:
        requests.append(dist.isend(down, south, group=group))
        requests.append(dist.irecv(from_south, south, group=group))
    for request in requests:
        request.wait()
    return from_north, from_south


class _ExchangeRows(torch.autograd.Function):
    """Forward: send the first row north and the last row south, receive the neighbours' edge
    rows. Backward: send each halo row's gradient back to its owner, which adds it to that row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, swapped: bool) -> tuple[torch.Tensor, ...]:
        north, south = _neighbours(group)
        first, last = x[..., :1, :], x[..., -1:, :]
        if swapped:  # the "halo" bug: edge rows go to the wrong neighbour
            first, last = last, first
        ctx.group, ctx.swapped, ctx.shape = group, swapped, x.shape
        # each band now also holds copies of its neighbours' edge rows
        return _swap(first, last, north, south, group)

    @staticmethod
    def backward(ctx: Any, g_north: torch.Tensor, g_south: torch.Tensor) -> tuple[Any, ...]:
        north, south = _neighbours(ctx.group)
        # the north halo is the northern band's last row: its gradient goes back north
        g_first, g_last = _swap(g_north, g_south, north, south, ctx.group)
        if ctx.swapped:
            g_first, g_last = g_last, g_first
        grad = g_north.new_zeros(ctx.shape)
        grad[..., :1, :] += g_first
        grad[..., -1:, :] += g_last  # a one-row band gets both
        return grad, None, None


def exchange_rows(
    x: torch.Tensor, group: Any, bug: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The northern neighbour's last row and the southern neighbour's first row of ``x``.

    ``x`` is this band's (..., rows, lon) field. Returns two (..., 1, lon) tensors, zeros
    where there is no neighbour (at a pole). Every rank of ``group`` must call it.
    Differentiable: a halo row's gradient is added to the row it was copied from.
    """
    bug = resolve_bug(bug)
    if bug == "halo-backward":
        with torch.no_grad():  # the bug: autograd never sees the exchange
            return _swap(x[..., :1, :], x[..., -1:, :], *_neighbours(group), group)
    return _ExchangeRows.apply(x, group, bug == "halo")


def pad_rows(x: torch.Tensor, group: Any, bug: str | None = None) -> torch.Tensor:
    """``x`` with one halo row above and below: the neighbours' edge rows, or at a pole a
    copy of the band's own edge row (a zero-flux boundary, as the serial model has)."""
    first, last = x[..., :1, :], x[..., -1:, :]
    if group is None or dist.get_world_size(group) == 1:
        return torch.cat([first, x, last], dim=-2)
    from_north, from_south = exchange_rows(x, group, bug)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    north = from_north if rank > 0 else first
    south = from_south if rank < size - 1 else last
    return torch.cat([north, x, south], dim=-2)


class _GlobalSum(torch.autograd.Function):
    """Forward: all-reduce SUM over the group. Backward: all-reduce SUM of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out  # replicated: every band holds the global sum

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        # every band used the sum, and every band's part fed each of those uses
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def global_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over the bands of ``group`` (identity for the serial model)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GlobalSum.apply(x, group)


def sum_gradients(model: torch.nn.Module, group: Any, data_group: Any = None) -> None:
    """Hook every parameter so its gradient is summed over the bands of ``group`` as it is
    computed (each band's loss part depends on every replicated parameter), then averaged
    over ``data_group`` (the copies of this band in the other data-parallel groups)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: _synced(g, group, data_group))


def _synced(grad: torch.Tensor, group: Any, data_group: Any) -> torch.Tensor:
    grad = grad.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(grad, group=group)  # now replicated: every band holds the sum
    if data_group is not None and dist.get_world_size(data_group) > 1:
        dist.all_reduce(grad, group=data_group)  # the data groups' mean, as DDP takes it
        grad /= dist.get_world_size(data_group)
    return grad
