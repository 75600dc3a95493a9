"""Autograd-aware collectives over a Topology's spatial group.

Each operation is a private ``torch.autograd.Function`` with a public verb. The first line
of each docstring says what forward and backward do: picking the wrong backward is the most
common way a spatially parallel model silently computes wrong gradients (FAULTS.md).

With the reference's topology (``Topology.single()``, no groups) every operation is the
identity, so one model code path serves both the reference and the partitioned run.

Gloo notes (checked on torch 2.13): ``all_gather`` needs equal shapes, so uneven shards are
padded to the longest and stripped after; gloo has no ``reduce_scatter``, so backward of a
gather all-reduces the gradient and each rank keeps its own slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.topology import Topology

# ---------------------------------------------------------------------- sums


class _SpatialSum(torch.autograd.Function):
    """Forward: all-reduce SUM over the group. Backward: all-reduce SUM of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out  # replicated: every rank holds the same global sum

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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
    return _SpatialSum.apply(x, topo.spatial_group)


class _ReduceLoss(torch.autograd.Function):
    """Forward: all-reduce SUM over the group. Backward: identity (the value is counted once)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out  # replicated: the global loss on every rank

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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
    return _ReduceLoss.apply(x, topo.spatial_group)


# ---------------------------------------------------------------------- gathers


def _shard_sizes(n_local: int, group: Any, size: int) -> list[int]:
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([n_local], dtype=torch.long), group=group)
    return [int(c.item()) for c in counts]


class _AllGatherUneven(torch.autograd.Function):
    """Forward: pad, all-gather, strip, concatenate in rank order. Backward: all-reduce SUM of
    the gradient, then each rank keeps the slice of its own shard."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
        dim = dim % x.dim()
        sizes = _shard_sizes(x.shape[dim], group, size)
        longest = max(max(sizes), 1)  # gloo dislikes zero-element tensors
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).contiguous()
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        # replicated: every rank holds all shards, padding stripped, in rank order
        out = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        ctx.rank = dist.get_rank(group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
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
    return _AllGatherUneven.apply(x, dim, topo.spatial_group, topo.spatial_size)


# ---------------------------------------------------------------------- gradient sync


def sync_gradients(module: torch.nn.Module, topo: Topology) -> list[Any]:
    """Hook every parameter so its gradient is summed over the spatial group as it lands.

    With data groups (``topo.data_size > 1``) the summed gradient is then averaged over the
    data group, as DDP would. Every rank must produce a gradient for every parameter (an
    empty rank still runs every module, giving zeros, not ``None``), in the same order:
    hooks fire during backward, and a rank whose hook never fires leaves the others waiting.
    Returns the hook handles (``handle.remove()`` undoes it). No-op for the reference.
    """
    if topo.spatial_group is None and topo.data_group is None:
        return []
    handles = []
    for param in module.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(_hook(topo)))
    return handles


def _hook(topo: Topology) -> Any:
    def reduce(param: torch.Tensor) -> None:
        reduce_gradient(param.grad, topo)

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
