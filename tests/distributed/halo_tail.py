"""A latitude-band stencil whose halo is two rows deep and whose far row carries small
weights, as a DISCO convolution's psi does at the edge of its support: the subject of the
calibrated judgement's tests (``harness.equivalence._calibrate``).

A 24 x 16 grid split into ``h x 1`` latitude bands. Each rank pads its band with two halo
rows from its polar neighbours (an all_gather of every band's edge rows, zeros beyond the
poles), then a 3 x 3 convolution of the near rows (trainable) plus a fixed ``tail``-sized
mix of the rows two away (a buffer, as psi is), a tanh, and the global mean fed back.
float32 by default: the precision such operators run in.

``HaloTailCase("halo-short")`` drops the far halo row (one row short, as a polar halo that
is cut a row early): the fields move by ``tail`` times a few inputs at the band edges only,
a few units of float32 rounding for ``tail = 3e-7`` — inside the fixed float32 tolerance
(``rtol 1e-5``), outside ten times the entries' rounding spread.
"""

from __future__ import annotations

import torch
from torch import nn

from harness import Outputs, Shard, SpatialCase, Topology, data_share
from harness.collectives import reduce_loss, spatial_sum, sync_gradients
from harness.partition import LatLonPartition
from tests.distributed.stencil import GatherOver  # the same all-gather with summed backward

NLAT, NLON, CHANNELS, BATCH = 24, 16, 3, 2
FAULTS = ("halo-short",)


def band(topo: Topology) -> slice:
    """This rank's latitude rows (the reference's: all of them)."""
    p = LatLonPartition(NLAT, NLON, topo.spatial_size, 1, rule="balanced")
    return p.slices(topo.spatial_rank if topo.spatial_group is not None else 0)[0]


class HaloTailModel(nn.Module):
    def __init__(self, topo: Topology, fault: str | None, tail: float) -> None:
        super().__init__()
        self.fault, self.topo = fault, topo
        self.near = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=(0, 1), padding_mode="circular")
        self.register_buffer("far", torch.randn(CHANNELS, CHANNELS) * tail)  # fixed, as psi
        self.h = topo.spatial_size
        self.p = topo.spatial_rank if topo.spatial_group is not None else 0

    def halo(self, x: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros_like(x[..., :2, :])
        if self.h == 1:
            return torch.cat([zero, x, zero], dim=-2)
        edges = torch.cat([x[..., :2, :], x[..., -2:, :]], dim=-2)
        every = GatherOver.apply(edges, self.topo.spatial_group, self.p, self.h)
        north = every[self.p - 1][..., 2:4, :] if self.p > 0 else zero
        south = every[self.p + 1][..., 0:2, :] if self.p < self.h - 1 else zero
        if self.fault == "halo-short":  # the bug: the row two beyond the edge is dropped
            north = torch.cat([torch.zeros_like(north[..., :1, :]), north[..., 1:, :]], dim=-2)
            south = torch.cat([south[..., :1, :], torch.zeros_like(south[..., 1:, :])], dim=-2)
        return torch.cat([north, x, south], dim=-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded, n = self.halo(x), x.shape[-2]  # rows: 2 + n + 2
        near = self.near(padded[..., 1 : n + 3, :])
        rows2 = padded[..., :n, :] + padded[..., 4 : n + 4, :]
        y = torch.tanh(near + torch.einsum("oc,bchw->bohw", self.far, rows2))
        mean = spatial_sum(y.sum(dim=(-2, -1)), self.topo) / (NLAT * NLON)
        return x + y + 0.5 * mean[..., None, None]


class HaloTailCase(SpatialCase):
    """The halo-tail stencil as a ``SpatialCase``; ``fault`` one of ``FAULTS`` or ``None``."""

    mesh_dims = 1

    def __init__(
        self, fault: str | None = None, tail: float = 3e-7, dtype: torch.dtype = torch.float32
    ) -> None:
        assert fault is None or fault in FAULTS, fault
        self.fault, self.tail, self.dtype = fault, tail, dtype
        self.name = f"halo-tail-{fault}" if fault else "halo-tail"

    def build(self, topo: Topology) -> nn.Module:
        model = HaloTailModel(topo, self.fault, self.tail)
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = torch.randn(2, BATCH, CHANNELS, NLAT, NLON)
        mine = (data_share(BATCH, topo), slice(None), band(topo))
        return x[mine], target[mine]

    def forward(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], topo: Topology
    ) -> Outputs:
        x, target = batch
        out = model(x)
        total = reduce_loss(((out - target) ** 2).sum(), topo)
        loss = total / (x.shape[0] * CHANNELS * NLAT * NLON)
        return Outputs(loss, {"out": Shard.grid(out, band(topo), slice(0, NLON), NLAT, NLON)})

    def partition(self, topo: Topology) -> LatLonPartition:
        return LatLonPartition(NLAT, NLON, topo.spatial_size, 1, rule="balanced")
