"""Blame inside a module's own backward: a ring attention whose hand-written autograd
Function loses part of the key/value gradients is named, not the synchronisation.

Sequence-parallel attention over a line of positions split over the ranks: each rank holds
its block of queries, keys and values (projected by functional calls inside the module),
the keys and values travel the ring in the forward, and the backward sends each block's
dk/dv accumulator round the ring, each rank adding its part, until it arrives home. The
attention is the model's first layer, so no activation gradient below it exists to compare:
only the ranks' gradients before the synchronisation tell its backward from the sync.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import Outputs, Positions, Shard, SpatialCase, Topology, check_equivalence
from harness.collectives import reduce_loss, sync_gradients

RANKS = 4
NPOS, C, BATCH = 16, 3, 2


def _pass_on(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` sent to the next rank of the ring; what the previous one sent, returned."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    got = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, (me + 1) % size)),
        dist.P2POp(dist.irecv, got, dist.get_global_rank(group, (me - 1) % size)),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


class _RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(C)) v for this rank's queries against every rank's keys."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: Topology, bug: Any
    ) -> torch.Tensor:
        size = topo.spatial_size if topo.spatial_group is not None else 1
        me = topo.spatial_rank if topo.spatial_group is not None else 0
        ks, vs = [k], [v]  # after hop h, the block of rank me - h
        for _ in range(size - 1):
            ks.append(_pass_on(ks[-1], topo.spatial_group))
            vs.append(_pass_on(vs[-1], topo.spatial_group))
        order = [(me - h) % size for h in range(size)]  # the block each hop brought
        keys = torch.cat([ks[order.index(b)] for b in range(size)], dim=1)
        values = torch.cat([vs[order.index(b)] for b in range(size)], dim=1)
        p = torch.softmax(q @ keys.transpose(1, 2) / C**0.5, dim=-1)
        ctx.save_for_backward(q, keys, values, p)
        ctx.topo, ctx.size, ctx.me, ctx.bug = topo, size, me, bug
        return p @ values

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, keys, values, p = ctx.saved_tensors
        size, me, n = ctx.size, ctx.me, q.shape[1]
        dp = grad @ values.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / C**0.5
        dq = ds @ keys
        dk_all, dv_all = ds.transpose(1, 2) @ q, p.transpose(1, 2) @ grad  # every block's part

        def part(block: int) -> tuple[torch.Tensor, torch.Tensor]:
            at = slice(block * n, (block + 1) * n)
            return dk_all[:, at], dv_all[:, at]

        if ctx.bug == "never-home":  # each rank keeps its own part of its own block
            dk, dv = part(me)
            return dq, dk, dv, None, None
        # the accumulator this rank holds after hop h is block me - h - 1's: after size - 1
        # hops it is home, every rank's part added
        dk, dv = part((me - 1) % size)
        for hop in range(size - 1):
            dk, dv = _pass_on(dk, ctx.topo.spatial_group), _pass_on(dv, ctx.topo.spatial_group)
            if ctx.bug == "drop-hop" and hop == size - 2:
                continue  # the bug: the last hop's part (the rank's own) never added
            mine_k, mine_v = part((me - hop - 2) % size)
            dk, dv = dk + mine_k, dv + mine_v
        return dq, dk, dv, None, None


class RingAttention(torch.nn.Module):
    def __init__(self, topo: Topology, bug: str | None) -> None:
        super().__init__()
        self.topo, self.bug = topo, bug
        self.q_weights = torch.nn.Parameter(torch.randn(C, C) / C**0.5)
        self.k_weights = torch.nn.Parameter(torch.randn(C, C) / C**0.5)
        self.v_weights = torch.nn.Parameter(torch.randn(C, C) / C**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w.T for w in (self.q_weights, self.k_weights, self.v_weights))
        return _RingAttention.apply(q, k, v, self.topo, self.bug)


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(C, C) / C**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) @ self.weight.T


class AttentionModel(torch.nn.Module):
    """The attention first (``embed``: a projection before it, a layer with parameters
    whose input gradient shows the attention's)."""

    def __init__(self, topo: Topology, bug: str | None, embed: bool) -> None:
        super().__init__()
        self.embed = Head() if embed else None
        self.attn = RingAttention(topo, bug)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        return self.head(self.attn(x))


class AttentionCase(SpatialCase):
    name, dtype = "ring-attention", torch.float64

    def __init__(self, bug: str | None = None, *, embed: bool = False, ddp: bool = False) -> None:
        self.bug, self.embed, self.ddp = bug, embed, ddp

    def positions(self, topo: Topology) -> range:
        n = NPOS // topo.spatial_size
        return range(topo.spatial_rank * n, (topo.spatial_rank + 1) * n)

    def partition(self, topo: Topology) -> Positions:
        return Positions(NPOS, self.positions(topo))

    def build(self, topo: Topology) -> torch.nn.Module:
        model = AttentionModel(topo, self.bug, self.embed)
        if self.ddp and topo.spatial_group is not None:
            # wrong for a split domain: DDP averages over the group where the parts must sum
            return torch.nn.parallel.DistributedDataParallel(
                model, process_group=topo.spatial_group, broadcast_buffers=False
            )
        sync_gradients(model, topo)  # right: every parameter's gradient summed over the ranks
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = torch.randn(BATCH, NPOS, C), torch.randn(BATCH, NPOS, C)
        mine = slice(self.positions(topo).start, self.positions(topo).stop)
        return x[:, mine], target[:, mine]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        x, target = batch
        y = model(x)
        loss = reduce_loss(((y - target) ** 2).sum(), topo) / (BATCH * NPOS * C)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        return Outputs(loss, {"y": Shard(y, torch.tensor(list(self.positions(topo))), dim=1)})


def _first_line(report: Any) -> str:
    return next(x for x in str(report).splitlines() if x.startswith("First divergence:"))


def test_a_correct_ring_attention_passes_with_nothing_departing(spatial):
    report = check_equivalence(AttentionCase(), ranks=RANKS, pool=spatial.pool(RANKS), locate=True)
    assert report.ok, report
    assert report.first_divergence is None, report.first_divergence.line()
    assert report.location is not None and report.location.compared > 10


@pytest.mark.parametrize("bug", ["drop-hop", "never-home"])
def test_a_ring_attention_first_in_the_model_losing_key_gradients_is_its_backward(spatial, bug):
    report = check_equivalence(AttentionCase(bug), ranks=RANKS, pool=spatial.pool(RANKS))
    assert not report.ok
    found = report.first_divergence
    assert found is not None, report
    assert (found.cause, found.module, found.function) == ("backward", "attn", ("_RingAttention",))
    assert found.quantity == "grad 'attn.k_weights'"  # the keys' part is lost, the first seen
    line = _first_line(report)
    assert line.startswith(
        "First divergence: backward of 'attn' (RingAttention) through _RingAttention, step 0: "
        "the gradient of 'attn.k_weights' departs before any synchronisation"
    ), line
    assert "synchronisation of" not in line
    assert "  backward of 'attn' (RingAttention) through _RingAttention: the gradient of " in (
        str(report)
    )


def test_the_same_bug_under_a_layer_with_parameters_is_the_attentions_input_gradient(spatial):
    report = check_equivalence(
        AttentionCase("drop-hop", embed=True), ranks=RANKS, pool=spatial.pool(RANKS)
    )
    found = report.first_divergence
    assert found is not None, report
    assert (found.located, found.quantity) == ("backward of 'attn' (RingAttention)", "grad_input")


def test_gradients_averaged_by_ddp_over_the_spatial_group_are_the_synchronisation(spatial):
    # the hook that records a gradient before its synchronisation runs before DDP's reducer
    # (which fires after accumulation): the ranks' own gradients add up to the reference's;
    # the wrapped model's modules are named as the reference's ('head', not 'module.head')
    report = check_equivalence(AttentionCase(ddp=True), ranks=RANKS, pool=spatial.pool(RANKS))
    assert not report.ok
    found = report.first_divergence
    assert found is not None, report
    assert found.cause == "synchronisation", found.line()
    assert found.located == "gradient synchronisation of 'head.weight'", found.line()
