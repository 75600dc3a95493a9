"""What a HEALPix batch is made of: observation points drawn inside given cells, their
features (values and position), explicit observations (``PointSet``) and the
``(sample, cell, token)`` keys of a keyed forecast's tokens.

Communicates nothing; ``harness.steppers.healpix`` draws its batches with it and re-exports
``PointSet`` and ``token_keys``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

# Observation points are sub-cell centres this many levels below nside: strictly inside
# their cell, so cell_of gives back the cell they were drawn for.
_DEPTH = 4


def _points_in(
    nside: int, cells: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(lat, lon) in degrees of one random sub-cell centre inside each of ``cells``."""
    import healpy as hp

    child = rng.integers(0, 4**_DEPTH, size=len(cells))
    fine = (cells.astype(np.int64) << (2 * _DEPTH)) + child
    lon, lat = hp.pix2ang(nside << _DEPTH, fine, nest=True, lonlat=True)
    return np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64)


def _features(lat: np.ndarray, lon: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per observation: its values and its position as a unit vector."""
    la, lo = np.radians(lat), np.radians(lon)
    xyz = np.stack([np.cos(la) * np.cos(lo), np.cos(la) * np.sin(lo), np.sin(la)], axis=-1)
    return np.concatenate([values, xyz], axis=-1)


class PointSet(Protocol):
    """Explicit observations (``HealpixCase(observations=...)``), e.g. a
    ``harness.strategies.ObservationSet``: degrees and values, one row per point."""

    @property
    def lat(self) -> np.ndarray: ...
    @property
    def lon(self) -> np.ndarray: ...
    @property
    def values(self) -> np.ndarray: ...


def token_keys(counts: torch.Tensor, lo: int, first_sample: int) -> torch.Tensor:
    """(sample, cell, token) keys of ``counts[b, c]`` tokens per (sample, cell), packed
    sample-major, then cell, then token; cells count from ``lo``, samples from
    ``first_sample``.

    >>> token_keys(torch.tensor([[2, 0], [0, 1]]), lo=4, first_sample=2).tolist()
    [[2, 4, 0], [2, 4, 1], [3, 5, 0]]
    """
    b, n = counts.shape
    flat = counts.reshape(-1).long()
    slot = torch.repeat_interleave(torch.arange(b * n), flat)
    starts = torch.cumsum(flat, 0) - flat  # each slot's first item
    token = torch.arange(len(slot)) - torch.repeat_interleave(starts, flat)
    return torch.stack([slot // max(n, 1) + first_sample, slot % max(n, 1) + lo, token], dim=1)
