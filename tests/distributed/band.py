"""A latitude-band model written the way a team writes one, with realistic bugs as switches.

Each rank holds a band of latitudes of a lat x lon grid. Nothing in the model comes from the
harness: its own ``isend``/``irecv`` halo for a 3 x 3 stencil, its own autograd functions
for an area-weighted global mean fed back into the model and for a gathered zonal-mean
profile mixed across latitudes, its own gradient hooks that sum parameter gradients over
the ranks, and dropout drawn for the global field. float64: the check is about logic.

``BandCase(fault)`` switches on one bug:

- ``wrong-neighbour``: each halo row comes from the neighbour on the other side;
- ``stale-halo``: the halo is exchanged at the first step only and reused after;
- ``some-hooks``: gradient hooks on the stencil and the decoder only, not the mixers;
- ``rank-dropout``: the dropout mask is drawn at the rank's shape, not the global one;
- ``gather-order``: the all_gather's parts are concatenated one rank off;
- ``hooks-twice``: every gradient hook is registered twice (gradients S times too large);
- ``float32-mean``: the global mean's all_reduce runs in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import Outputs, Shard, SpatialCase, Topology
from harness.partition import LatLonPartition

NLAT, NLON, CHANNELS, HIDDEN, BATCH = 16, 12, 3, 6, 2
FAULTS = (
    "wrong-neighbour",
    "stale-halo",
    "some-hooks",
    "rank-dropout",
    "gather-order",
    "hooks-twice",
    "float32-mean",
)
HALO_FAULTS = ("wrong-neighbour", "stale-halo")


def rows_of(topo: Topology) -> slice:
    if topo.spatial_group is None:
        return slice(0, NLAT)
    return LatLonPartition(NLAT, NLON, topo.spatial_size, 1).slices(topo.spatial_rank)[0]


def area_weights(rows: slice) -> torch.Tensor:
    lat = (torch.arange(NLAT, dtype=torch.float64) + 0.5) * math.pi / NLAT - math.pi / 2
    return torch.cos(lat)[rows]


class SumOverRanks(torch.autograd.Function):
    """A sum over the ranks that everything after depends on: summed backward too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LossSum(torch.autograd.Function):
    """The loss's sum over the ranks: every rank holds the same loss, so backward is the
    identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherRows(torch.autograd.Function):
    """Every rank's rows of a (..., rows) tensor, gathered into (..., NLAT)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topo: Topology, rows: slice, fault: str) -> torch.Tensor:
        ctx.topo, ctx.rows = topo, rows
        if topo.spatial_group is None:
            return x.clone()
        parts = [torch.empty_like(x) for _ in range(topo.spatial_size)]
        dist.all_gather(parts, x.contiguous(), group=topo.spatial_group)
        if fault == "gather-order":
            parts = parts[1:] + parts[:1]  # the bug: the parts one rank off
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        if ctx.topo.spatial_group is not None:
            dist.all_reduce(grad, group=ctx.topo.spatial_group)
        return grad[..., ctx.rows], None, None, None


class BandModel(torch.nn.Module):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.stencil = torch.nn.Conv2d(CHANNELS, HIDDEN, 3)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.meridional = torch.nn.Linear(NLAT, NLAT)
        self.decode = torch.nn.Conv2d(HIDDEN, CHANNELS, 1)
        self.cached: tuple[torch.Tensor, torch.Tensor] | None = None

    def halo(self, x: torch.Tensor, topo: Topology) -> torch.Tensor:
        """The band with one row of each neighbour's above and below (zeros at the poles)."""
        north, south = torch.zeros_like(x[..., :1, :]), torch.zeros_like(x[..., :1, :])
        if topo.spatial_group is not None:
            if self.fault == "stale-halo" and self.cached is not None:
                north, south = self.cached  # the bug: the first step's halo, for ever
            else:
                self.exchange(x, north, south, topo)
                self.cached = (north, south)
        return torch.cat([north, x, south], dim=-2)

    def exchange(
        self, x: torch.Tensor, north: torch.Tensor, south: torch.Tensor, topo: Topology
    ) -> None:
        r, size, ranks, group = (
            topo.spatial_rank,
            topo.spatial_size,
            topo.spatial_ranks,
            topo.spatial_group,
        )
        # rows going north carry tag 1, rows going south tag 2
        requests = []
        if r > 0:
            requests.append(
                dist.isend(x[..., :1, :].contiguous(), ranks[r - 1], group=group, tag=1)
            )
        if r < size - 1:
            requests.append(
                dist.isend(x[..., -1:, :].contiguous(), ranks[r + 1], group=group, tag=2)
            )
        above, below = r - 1, r + 1
        if self.fault == "wrong-neighbour":
            above, below = below, above  # the bug: each halo from the other side
        for buffer, source in ((north, above), (south, below)):
            if 0 <= source < size:
                tag = 2 if source < r else 1
                requests.append(dist.irecv(buffer, ranks[source], group=group, tag=tag))
        for request in requests:
            request.wait()

    def forward(self, x: torch.Tensor, topo: Topology) -> torch.Tensor:
        rows, group = rows_of(topo), topo.spatial_group
        padded = F.pad(self.halo(x, topo), (1, 1, 0, 0), mode="circular")  # longitudes wrap
        h = torch.tanh(self.stencil(padded))  # (batch, hidden, rows, lon)
        w = area_weights(rows)[:, None]
        local = (h * w).sum(dim=(-2, -1))
        if self.fault == "float32-mean":
            total = SumOverRanks.apply(local.float(), group).to(local.dtype)  # the bug
        else:
            total = SumOverRanks.apply(local, group)
        mean = total / (area_weights(slice(None)).sum() * NLON)
        h = h + self.mix(mean)[..., None, None]
        profile = GatherRows.apply(h.mean(dim=-1), topo, rows, self.fault)  # (batch, hidden, lat)
        h = h + self.meridional(profile)[..., rows, None]
        if self.fault == "rank-dropout":
            keep = torch.rand(h.shape) > 0.1  # the bug: this rank's shape
        else:
            keep = (torch.rand(BATCH, HIDDEN, NLAT, NLON) > 0.1)[..., rows, :]
        h = h * keep / 0.9
        return self.decode(h)


def _sum_gradient(group: Any) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


class BandCase(SpatialCase):
    dtype = torch.float64

    def __init__(self, fault: str = "") -> None:
        assert fault in ("", *FAULTS), fault
        self.fault = fault
        self.name = f"band[{fault}]" if fault else "band"

    def build(self, topo: Topology) -> torch.nn.Module:
        model = BandModel(self.fault)
        if topo.spatial_group is not None:
            for name, p in model.named_parameters():
                if self.fault == "some-hooks" and name.startswith(("mix", "meridional")):
                    continue  # the bug: these parameters' gradients stay this rank's part
                p.register_hook(_sum_gradient(topo.spatial_group))
                if self.fault == "hooks-twice":
                    p.register_hook(_sum_gradient(topo.spatial_group))  # the bug
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = rows_of(topo)
        x = torch.randn(BATCH, CHANNELS, NLAT, NLON)
        target = torch.randn(BATCH, CHANNELS, NLAT, NLON)
        return x[..., rows, :], target[..., rows, :]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        x, target = batch
        rows = rows_of(topo)
        out = model(x, topo)
        local = ((out - target) ** 2 * area_weights(rows)[:, None]).sum()
        count = BATCH * CHANNELS * NLON * area_weights(slice(None)).sum()
        loss = LossSum.apply(local, topo.spatial_group) / count
        if topo.spatial_group is None:
            return Outputs(loss, {"out": out})
        return Outputs(loss, {"out": Shard.grid(out, rows, slice(None), NLAT, NLON)})
