"""A lat x lon stencil model on any ``h x w`` process grid, with bugs that show only on
some layouts: the held-out-style subject of ``check_layouts``.

A 12 x 16 grid (float64: the check is about logic) split into ``h x w`` blocks by
``Topology.mesh`` (``mesh_dims = 2``). Each rank pads its block with a one-cell halo
(longitude periodic, latitude zero beyond the poles): the longitude halo comes from the
azimuth neighbours through an all_gather of every block's edge columns over the azimuth
group (a local wrap when ``w == 1``), then the latitude halo from the polar neighbours, rows
of the longitude-padded block (so the corners come along). A 3 x 3 convolution, then an
area-weighted global mean of its output fed back into every cell.

``StencilCase(fault)`` switches on one bug, each one that hides on some layouts:

- ``mean-of-means``: the global mean is the mean of the ranks' area-weighted means. Exact
  when every block has the same area weight (1x2, 2x1, 2x2, 1x4: hemispheres and meridian
  strips), wrong on 1x3 (16 longitudes do not split in 3), 3x1 and 4x1 (bands of unequal
  area).
- ``transposed``: the rank reports its output at the grid position of a column-major
  numbering (``r % h, r // h``) instead of the row-major one it computed: the same on
  ``h x 1`` and ``1 x w``, the transposed block on ``2 x 2``.
- ``halo-2``: the longitude halo is taken 2 columns from the edge, not 1: only where the
  halo is exchanged (``w >= 2``), never on ``h x 1`` (a local wrap).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness import Outputs, Shard, SpatialCase, Topology, data_share
from harness.collectives import reduce_loss, spatial_sum, sync_gradients
from harness.partition import LatLonPartition

NLAT, NLON, CHANNELS, BATCH = 12, 16, 2, 2
FAULTS = ("mean-of-means", "transposed", "halo-2")
#: the smallest layout (world size, grid) each fault shows on, by construction (see above)
SMALLEST = {"mean-of-means": (3, (3, 1)), "transposed": (4, (2, 2)), "halo-2": (2, (1, 2))}


def grid_of(topo: Topology) -> tuple[int, int]:
    h, w = topo.mesh_shape(2)
    return h, w


def partition_of(topo: Topology) -> LatLonPartition:
    h, w = grid_of(topo)
    return LatLonPartition(NLAT, NLON, h, w, rule="balanced")


def area_weights() -> torch.Tensor:
    """cos(latitude) of every row, cell-centred, north first."""
    lat = (torch.arange(NLAT, dtype=torch.float64) + 0.5) * math.pi / NLAT - math.pi / 2
    return torch.cos(lat)


class GatherOver(torch.autograd.Function):
    """All-gather equal-shape tensors over a group (stacked on a new dim 0); backward: each
    rank's gradient is the sum of every rank's gradient for its piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, index: int, size: int) -> torch.Tensor:
        ctx.group, ctx.index = group, index
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.index], None, None, None


class StencilModel(nn.Module):
    def __init__(self, topo: Topology, fault: str | None) -> None:
        super().__init__()
        self.fault = fault
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.0, CHANNELS))
        self.h, self.w = grid_of(topo)
        self.p, self.a = topo.grid_position(self.h, self.w)
        self.polar, self.azimuth = topo.grid(self.h, self.w)
        self.rows = partition_of(topo).slices(self.p * self.w + self.a)[0]
        self.topo = topo

    def lon_halo(self, x: torch.Tensor) -> torch.Tensor:
        if self.w == 1:  # the whole circle is here: wrap locally
            return torch.cat([x[..., -1:], x, x[..., :1]], dim=-1)
        edges = torch.cat([x[..., :2], x[..., -2:]], dim=-1)  # first, second, ..., last
        every = GatherOver.apply(edges, self.azimuth, self.a, self.w)
        left, right = every[(self.a - 1) % self.w], every[(self.a + 1) % self.w]
        if self.fault == "halo-2":  # the bug: the column 2 from the neighbour's edge
            return torch.cat([left[..., 2:3], x, right[..., 1:2]], dim=-1)
        return torch.cat([left[..., 3:4], x, right[..., 0:1]], dim=-1)

    def lat_halo(self, x: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros_like(x[..., :1, :])
        if self.h == 1:
            return torch.cat([zero, x, zero], dim=-2)
        edges = torch.cat([x[..., :1, :], x[..., -1:, :]], dim=-2)
        every = GatherOver.apply(edges, self.polar, self.p, self.h)
        north = every[self.p - 1][..., 1:2, :] if self.p > 0 else zero
        south = every[self.p + 1][..., 0:1, :] if self.p < self.h - 1 else zero
        return torch.cat([north, x, south], dim=-2)

    def global_mean(self, y: torch.Tensor) -> torch.Tensor:
        weights = area_weights()
        mine = weights[self.rows][:, None]
        local = (y * mine).sum(dim=(-2, -1))  # (batch, channels)
        if self.fault == "mean-of-means":  # the bug: every rank's mean weighs the same
            local_mean = local / (mine.sum() * y.shape[-1])
            return spatial_sum(local_mean, self.topo) / self.topo.spatial_size
        return spatial_sum(local, self.topo) / (weights.sum() * NLON)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.conv(self.lat_halo(self.lon_halo(x))))
        return x + y + self.gain[:, None, None] * self.global_mean(y)[..., None, None]


class StencilCase(SpatialCase):
    """The stencil model as a ``SpatialCase``; ``fault`` one of ``FAULTS`` or ``None``."""

    dtype = torch.float64
    mesh_dims = 2

    def __init__(self, fault: str | None = None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.fault = fault
        self.name = f"stencil-{fault}" if fault else "stencil"

    def block(self, topo: Topology) -> tuple[slice, slice]:
        h, w = grid_of(topo)
        p, a = topo.grid_position(h, w)
        return partition_of(topo).slices(p * w + a)

    def build(self, topo: Topology) -> nn.Module:
        model = StencilModel(topo, self.fault)
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = torch.randn(2, BATCH, CHANNELS, NLAT, NLON)
        lats, lons = self.block(topo)
        mine = (data_share(BATCH, topo), slice(None), lats, lons)
        return x[mine], target[mine]

    def forward(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], topo: Topology
    ) -> Outputs:
        x, target = batch
        out = model(x)
        lats, lons = self.block(topo)
        weights = area_weights()[lats][:, None]
        total = reduce_loss((weights * (out - target) ** 2).sum(), topo)
        loss = total / (x.shape[0] * CHANNELS * NLON * area_weights().sum())
        if self.fault == "transposed":  # the bug: a column-major rank numbering
            h, w = grid_of(topo)
            r = topo.spatial_rank if topo.spatial_group is not None else 0
            lats, lons = partition_of(topo).slices((r % h) * w + r // h)
        return Outputs(loss, {"out": Shard.grid(out, lats, lons, NLAT, NLON)})

    def partition(self, topo: Topology) -> LatLonPartition:
        return partition_of(topo)
