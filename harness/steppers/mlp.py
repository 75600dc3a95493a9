"""The smallest interesting case: a per-position MLP coupled through a global mean.

Positions ``0..npos`` are split over the spatial group in contiguous ranges. Each rank
encodes its positions, the encodings' global mean (a ``spatial_sum``) is added back to every
position, and a decoder predicts a target per position. The coupling is what makes gradient
flow between ranks, so it is enough to show the three classic mistakes:

- ``no-grad-sync``: parameter gradients are not summed over the spatial group;
- ``wrong-shard-index``: a rank reports its output at positions shifted by one;
- ``non-differentiable-reduce``: the global mean uses in-place ``dist.all_reduce``, which
  autograd sees as the identity, so each rank misses the other ranks' share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.collectives import reduce_loss, spatial_sum, sync_gradients
from harness.divergence import Positions
from harness.steppers.faults import check_faults
from harness.topology import Topology

FAULTS = ("no-grad-sync", "wrong-shard-index", "non-differentiable-reduce")


def position_range(npos: int, topo: Topology) -> range:
    """This rank's contiguous positions (``torch.tensor_split``'s rule: sizes differ by <= 1)."""
    bounds = [len(p) for p in torch.arange(npos).tensor_split(topo.spatial_size)]
    start = sum(bounds[: topo.spatial_rank])
    return range(start, start + bounds[topo.spatial_rank])


class CoupledMLP(nn.Module):
    def __init__(self, channels: int, hidden: int, faults: frozenset[str]) -> None:
        super().__init__()
        self.encoder = nn.Linear(channels, hidden)
        self.decoder = nn.Linear(hidden, channels)
        self.faults = faults

    def forward(self, x: torch.Tensor, npos: int, topo: Topology) -> torch.Tensor:
        # x: (batch, local positions, channels)
        h = torch.tanh(self.encoder(x))
        local = h.sum(dim=1)
        if "non-differentiable-reduce" in self.faults and topo.spatial_group is not None:
            total = local.clone()
            dist.all_reduce(total, group=topo.spatial_group)  # invisible to autograd
        else:
            total = spatial_sum(local, topo)  # replicated global sum, summed backward
        mean = total / npos
        out: torch.Tensor = x + self.decoder(h + mean[:, None, :])
        return out


class CoupledMLPCase(SpatialCase):
    """A per-position MLP with a global-mean coupling, split over positions.

    Parameters
    ----------
    npos, channels, hidden, batch_size:
        Sizes; ``npos`` need not divide the number of ranks (uneven ranges, empty ones too).
    faults:
        Names from ``FAULTS`` to inject.
    """

    name = "coupled-mlp"

    def __init__(
        self,
        npos: int = 37,
        channels: int = 3,
        hidden: int = 8,
        batch_size: int = 2,
        *,
        dtype: torch.dtype = torch.float64,
        faults: tuple[str, ...] | frozenset[str] = (),
    ) -> None:
        self.faults = check_faults(faults, FAULTS, "coupled-mlp")
        self.npos, self.channels, self.hidden, self.batch_size = npos, channels, hidden, batch_size
        self.dtype = dtype

    def build(self, topo: Topology) -> nn.Module:
        model = CoupledMLP(self.channels, self.hidden, self.faults)
        if "no-grad-sync" not in self.faults:
            sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        # Drawn for the whole globe on every rank (identically seeded), then sliced: the
        # partitioned and the reference run see the same numbers.
        x = torch.randn(self.batch_size, self.npos, self.channels)
        target = torch.randn(self.batch_size, self.npos, self.channels)
        rows = data_share(self.batch_size, topo)
        pos = position_range(self.npos, topo)
        cols = slice(pos.start, pos.stop)
        return {"x": x[rows, cols], "target": target[rows, cols]}

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], topo: Topology) -> Outputs:
        out = model(batch["x"], self.npos, topo)
        n = self.batch_size // topo.data_size * self.npos * self.channels
        loss = reduce_loss(((out - batch["target"]) ** 2).sum(), topo) / n
        if topo.spatial_group is None:
            return Outputs(loss, {"out": out})
        pos = position_range(self.npos, topo)
        index = torch.arange(pos.start, pos.stop)
        if "wrong-shard-index" in self.faults:
            index = (index + 1) % self.npos
        return Outputs(loss, {"out": Shard(out, index, dim=1)})

    def partition(self, topo: Topology) -> Positions:
        return Positions(self.npos, position_range(self.npos, topo))

    def describe(self, topo: Topology | None = None) -> str:
        return f"{self.npos} positions"
