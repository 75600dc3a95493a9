"""The emulator: encoder, diffusion with a one-row halo, global-mean conditioning, decoder."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tinyclimate.parallel import global_sum, latitude_band, pad_rows, resolve_bug


def area_weights(nlat: int, nlon: int) -> torch.Tensor:
    """(nlat,) weight of one grid point per row: cos(latitude), summing to 1 over the globe."""
    lat = torch.tensor([math.pi / 2 - (i + 0.5) * math.pi / nlat for i in range(nlat)])
    w = torch.cos(lat)
    return w / (w.sum() * nlon)


class TinyClimate(nn.Module):
    """One step of a lat x lon emulator; with ``group``, this rank's latitude band of it.

    Input and output are (batch, channels, rows, nlon) with ``rows`` this band's latitudes
    (``latitude_band(nlat, rank, size)``; all ``nlat`` for the serial model, ``group=None``).
    ``bug`` (or env ``TINYCLIMATE_BUG``) switches on one of ``tinyclimate.BUGS``.
    """

    def __init__(
        self,
        nlat: int,
        nlon: int,
        channels: int = 2,
        hidden: int = 8,
        *,
        group: Any = None,
        bug: str | None = None,
    ) -> None:
        super().__init__()
        self.group, self.bug = group, resolve_bug(bug)
        rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
        self.rows = latitude_band(nlat, rank, size)
        self.encoder = nn.Linear(channels, hidden)
        self.diffusivity = nn.Parameter(torch.linspace(-1.0, 1.0, hidden))
        self.decoder = nn.Linear(2 * hidden, channels)
        self.register_buffer("area", area_weights(nlat, nlon)[self.rows], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x.movedim(1, -1))).movedim(-1, 1)
        padded = pad_rows(h, self.group, self.bug)  # rows + 2: a halo row each side
        laplacian = (
            padded[..., :-2, :] + padded[..., 2:, :] + h.roll(1, -1) + h.roll(-1, -1) - 4 * h
        )
        kappa = 0.25 * torch.sigmoid(self.diffusivity)[:, None, None]  # stable explicit step
        h = h + kappa * laplacian
        mean = global_sum((h * self.area[:, None]).sum((-2, -1)), self.group)  # (batch, hidden)
        z = torch.cat([h, mean[..., None, None].expand_as(h)], dim=1)
        return x + self.decoder(z.movedim(1, -1)).movedim(-1, 1)
