"""A global sum over 1,001 positions split unevenly over the ranks, fed back into every
position, with a ``predict``: the subject of the bf16 rollout's tests. Under bf16 autocast
each rank's partial sum is rounded to bf16 before the spatial sum, so a correct
partitioned rollout differs from the serial one by bf16 rounding (~4e-4 here), far more
than reruns nudged by float32 units spread (~2e-6). ``double`` is a bug: spatial rank 1
counts its share of the sum ``double`` times."""

from __future__ import annotations

import torch

from harness import Outputs, Shard, SpatialCase, Topology, data_share
from harness.collectives import reduce_loss, spatial_sum, sync_gradients

NPOS, BATCH = 1001, 2


def positions(topo: Topology) -> slice:
    sizes = [len(p) for p in torch.arange(NPOS).tensor_split(topo.spatial_size)]
    start = sum(sizes[: topo.spatial_rank])
    return slice(start, start + sizes[topo.spatial_rank])


class UnevenSum(torch.nn.Module):
    def __init__(self, double: float) -> None:
        super().__init__()
        self.encode, self.decode = torch.nn.Linear(3, 8), torch.nn.Linear(8, 3)
        self.double = double

    def forward(self, x: torch.Tensor, topo: Topology) -> torch.Tensor:
        h = torch.tanh(self.encode(x))
        mine = h.sum(dim=1)
        if self.double != 1.0 and topo.spatial_rank == 1:  # the bug
            mine = mine * self.double
        total = spatial_sum(mine, topo)
        return x + 0.1 * self.decode(h + total[:, None, :] / NPOS)


class UnevenSumCase(SpatialCase):
    dtype = torch.float32

    def __init__(self, double: float = 1.0) -> None:
        self.double = double
        self.name = "uneven-sum" if double == 1.0 else f"uneven-sum-x{double:g}"

    def build(self, topo: Topology) -> torch.nn.Module:
        model = UnevenSum(self.double)
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = torch.randn(BATCH, NPOS, 3), torch.randn(BATCH, NPOS, 3)
        mine = (data_share(BATCH, topo), positions(topo))
        return x[mine], target[mine]

    def forward(self, model, batch, topo):  # type: ignore[no-untyped-def]
        x, target = batch
        out = model(x, topo)
        loss = reduce_loss(((out - target) ** 2).sum(), topo) / (x.shape[0] * NPOS * 3)
        p = positions(topo)
        return Outputs(loss, {"out": Shard(out, torch.arange(p.start, p.stop), dim=1)})

    def predict(self, model, batch, topo, steps):  # type: ignore[no-untyped-def]
        x, _ = batch
        p = positions(topo)
        out = []
        for _ in range(steps):
            x = model(x, topo)
            out.append({"state": Shard(x, torch.arange(p.start, p.stop), dim=1)})
        return out
