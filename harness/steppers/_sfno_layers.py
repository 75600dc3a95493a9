"""The SFNO stepper's layers that never communicate: a pointwise (1x1) convolution and the
spectral filter, whose weight is full size on every rank or only the rank's l modes.

``harness.steppers.sfno`` builds its network of them and re-exports both.
"""

from __future__ import annotations

import torch
from torch import nn


class Pointwise(nn.Module):
    """A 1x1 convolution over the channel dimension (-3) of (..., C, lat, lon) fields."""

    def __init__(self, cin: int, cout: int, gain: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(gain * torch.randn(cout, cin) / cin**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("oi,...ihw->...ohw", self.weight, x) + self.bias[:, None, None]


class SpectralFilter(nn.Module):
    """Multiplies each channel's (l, m) coefficient by a learned complex weight.

    By default the weight is full size ``(channels, lmax, mmax, 2)`` on every rank, so names
    and shapes match the reference's; forward uses the rank's modes ``[l_slice, m_slice]``.
    ``sharded``: the weight is only the rank's l modes ``(channels, l_local, mmax, 2)``, as
    makani holds it (all m: the azimuth ranks sharing these l modes hold copies), taken
    from the full-size draw at ``held`` (the rank's ``l_slice`` unless a fault moves it),
    or drawn alone from ``generator`` (a rank initialising its shard on its own).
    """

    def __init__(
        self,
        channels: int,
        lmax: int,
        mmax: int,
        l_slice: slice,
        m_slice: slice,
        *,
        sharded: bool = False,
        held: slice | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        held = l_slice if held is None else held
        if generator is not None:  # only this rank's modes: nothing like the reference's
            n = held.stop - held.start if sharded else lmax
            draw = torch.randn(channels, n, mmax, 2, generator=generator)
        else:
            draw = torch.randn(channels, lmax, mmax, 2)
            draw = draw[:, held] if sharded else draw
        weight = torch.zeros(draw.shape)
        weight[..., 0] = 1.0
        self.weight = nn.Parameter((weight + 0.1 * draw).contiguous())
        self.l_slice, self.m_slice, self.sharded = l_slice, m_slice, sharded

    def forward(self, coeffs: torch.Tensor) -> torch.Tensor:
        modes = (slice(None), self.m_slice) if self.sharded else (self.l_slice, self.m_slice)
        local = self.weight[:, modes[0], modes[1]].contiguous()
        return coeffs * torch.view_as_complex(local).to(coeffs.dtype)
