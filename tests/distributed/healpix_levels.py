"""A two-level HEALPix UNet in the DLWP style, as small as it gets: the subject of the
multi-level error maps and of the guide's multi-level partition.

Cells at nside 4 (192, NESTED) are encoded per cell, pooled to nside 2 (48: the four
children of coarse cell ``c`` are fine cells ``4c .. 4c+3``, so pooling is local when every
rank's fine range starts on a multiple of 4), mixed there with a global mean over every
coarse cell (a ``spatial_sum``, so the ranks communicate), upsampled back and decoded with a
skip connection. ``partition`` returns one ``CellPartition`` per level, fine first
(``both_levels=False``: the fine one only, so locating cannot place the coarse tensors).

Fields: ``forecast`` at nside 4 as a ``Shard`` of cells (``unit="cell"``) and ``latent``
at nside 2 as a plain ``Shard`` (``unit`` left out, as a newcomer writes it).

``fault="local-mean"``: the coarse level's global mean is each rank's own mean (a missing
reduction), so both fields depart, at both levels. float64: the check is about logic.
"""

from __future__ import annotations

import torch
from torch import nn

from harness import Outputs, Shard, SpatialCase, Topology, data_share
from harness.collectives import reduce_loss, spatial_sum, sync_gradients
from harness.partition import CellPartition

FINE, COARSE, CHANNELS, HIDDEN, BATCH = 4, 2, 2, 3, 2


def levels(topo: Topology) -> list[CellPartition]:
    """One partition per level, fine first; the coarse split is the fine one over 4."""
    s = topo.mesh_shape(1)[0]
    fine = CellPartition.even(FINE, s)
    if any(b % 4 for b in fine.bounds):
        raise ValueError(f"fine bounds {fine.bounds} must be multiples of 4 to pool locally")
    return [fine, CellPartition(COARSE, tuple(b // 4 for b in fine.bounds))]


class LevelsUNet(nn.Module):
    def __init__(self, topo: Topology, fault: str | None) -> None:
        super().__init__()
        self.topo, self.fault = topo, fault
        self.encode = nn.Linear(CHANNELS, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.decode = nn.Linear(2 * HIDDEN, CHANNELS)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fine = torch.tanh(self.encode(x))  # (B, fine cells, HIDDEN)
        coarse = fine.reshape(fine.shape[0], -1, 4, HIDDEN).mean(2)  # children -> parent
        local = coarse.sum(1, keepdim=True)
        if self.fault == "local-mean":  # the bug: this rank's cells stand for the globe
            mean = local / coarse.shape[1]
        else:
            mean = spatial_sum(local, self.topo) / (12 * COARSE**2)
        latent = torch.tanh(self.mix(coarse + mean))
        up = latent.repeat_interleave(4, dim=1)  # parent -> its four children
        return x + self.decode(torch.cat([fine, up], dim=-1)), latent


class LevelsCase(SpatialCase):
    dtype = torch.float64

    def __init__(self, fault: str | None = None, *, both_levels: bool = True) -> None:
        self.fault, self.both_levels = fault, both_levels
        self.name = f"healpix-levels-{fault}" if fault else "healpix-levels"

    def build(self, topo: Topology) -> nn.Module:
        model = LevelsUNet(topo, self.fault)
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, target = torch.randn(2, BATCH, 12 * FINE**2, CHANNELS)
        cells = levels(topo)[0].cells(topo.spatial_rank)
        mine = (data_share(BATCH, topo), slice(cells.start, cells.stop))
        return x[mine], target[mine]

    def forward(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], topo: Topology
    ) -> Outputs:
        x, target = batch
        out, latent = model(x)
        loss = reduce_loss(((out - target) ** 2).sum(), topo) / (BATCH * 12 * FINE**2)
        fine, coarse = levels(topo)
        r = topo.spatial_rank
        fine_cells, coarse_cells = fine.cells(r), coarse.cells(r)
        return Outputs(
            loss,
            {
                "forecast": Shard(
                    out, torch.arange(fine_cells.start, fine_cells.stop), 1, unit="cell"
                ),
                "latent": Shard(latent, torch.arange(coarse_cells.start, coarse_cells.stop), 1),
            },
        )

    def partition(self, topo: Topology) -> list[CellPartition] | CellPartition:
        # both_levels=False: the fine level alone, as "return the CellPartition" reads
        return levels(topo) if self.both_levels else levels(topo)[0]
