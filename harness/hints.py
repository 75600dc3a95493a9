"""Hints computed from the evidence: what a mismatch's numbers say about its cause.

Each function looks at one kind of evidence and returns a sentence, or ``""`` when the
evidence does not point anywhere in particular (a generic remedy is given anyway):

- ``boundary_hint``: the positions that differ sit on the edges between ranks' blocks, so
  a halo (or a neighbour table) is off;
- ``precision_hint``: a float64 run off by about float32 rounding, so something in it is
  float32 (a cast, a tensor made before the dtype was set, a collective);
- ``shard_shape_hint``: a shard's values are its block unflattened, so ``Shard.grid`` was
  wanted;
- ``scale_hint``: a gradient exactly S times or 1/S of the reference, or all zeros, so a
  reduction is counted twice, averaged where it should sum, or never done;
- ``culprit_hint``: for a hang, the ranks that returned while the others waited;
- ``likely_cause``: of all the mismatches of a report, the one line that most likely names
  the bug.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from harness.compare import Mismatch, Quantity, as_float64
from harness.errors import RankFailure

#: float32's unit roundoff; a float64 run whose errors are a few of these came through
#: float32 somewhere (float64's is 1.1e-16: reordered sums stay far below 1e-12).
F32_EPS = float(torch.finfo(torch.float32).eps)


def boundary_positions(owners: np.ndarray, grid: tuple[int, int] | None, unit: str) -> np.ndarray:
    """Which positions have a neighbour owned by another rank.

    ``owners[p]`` is the rank owning position ``p``: flattened lat x lon with ``grid``
    (neighbours: the 8 around, longitudes wrapping), HEALPix cells in nested order with
    ``unit == "cell"`` (healpy's 8 neighbours), otherwise a 1-D line (p - 1, p + 1).
    """
    owners = np.asarray(owners)
    if grid is not None:
        rows, cols = grid
        o = owners.reshape(rows, cols)
        edge = np.zeros_like(o, dtype=bool)
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                if dr == dc == 0:
                    continue
                shifted = np.roll(o, shift=(dr, dc), axis=(0, 1))
                differs = shifted != o
                if dr == 1:  # no wrap across a pole
                    differs[0, :] = False
                if dr == -1:
                    differs[-1, :] = False
                edge |= differs
        return edge.reshape(-1)
    if unit == "cell":
        from harness.partition import CellPartition

        nside = round((len(owners) / 12) ** 0.5)
        if 12 * nside * nside == len(owners):
            near = CellPartition(nside, (0, len(owners))).neighbours()
            return np.asarray((owners[near] != owners[:, None]).any(axis=1))
    edge = np.zeros(len(owners), dtype=bool)
    edge[1:] |= owners[1:] != owners[:-1]
    edge[:-1] |= owners[:-1] != owners[1:]
    return edge


def boundary_hint(
    error: torch.Tensor,
    owners: torch.Tensor,
    allowed: float | torch.Tensor,
    grid: tuple[int, int] | None,
    unit: str,
) -> str:
    """Errors clustered at partition boundaries point at a halo exchange.

    ``error`` is the largest error at each global position, ``allowed`` what the tolerance
    lets through there. Said when at least 90% of the positions over it border another
    rank's block while such border positions are at most half of all positions.

    >>> owners = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    >>> error = torch.tensor([0, 0, 0, 1.0, 1.0, 0, 0, 0])
    >>> boundary_hint(error, owners, 1e-6, None, "position")
    'the 2 positions that differ all border another rank (2 of 8 positions do): a halo ...'
    >>> boundary_hint(torch.tensor([0, 0, 0, 1.0, 0, 0, 0, 0]), owners, 1e-6, None, "cell")
    'the one cell that differs borders another rank (2 of 8 cells do): a halo ...'
    """
    bad = (error.detach().double() > allowed).numpy()  # NaN is never over: not this hint
    if not bad.any() or len(bad) < 4:
        return ""
    edge = boundary_positions(owners.numpy(), grid, unit)
    on_edge = int((bad & edge).sum())
    if edge.mean() > 0.5 or on_edge < 0.9 * bad.sum():
        return ""
    if bad.sum() == 1:
        what = f"the one {unit} that differs borders another rank"
    else:
        share = "all" if on_edge == bad.sum() else f"{on_edge} of them"
        what = f"the {int(bad.sum())} {unit}s that differ {share} border another rank"
    return (
        f"{what} "
        f"({int(edge.sum())} of {len(edge)} {unit}s do): a halo exchange is off (width, "
        "order or which neighbour), or a neighbour table uses local indices"
    )


def precision_hint(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> str:
    """A float64 comparison whose errors look like float32 rounding.

    Said when the relative errors of the entries over ``atol`` are all between 1e-3 and
    1e+2 float32 epsilons: too large for reordered float64 sums (~1e-16), too small and too
    uniform for a logic bug.

    >>> e = torch.linspace(1, 2, 50, dtype=torch.float64)
    >>> precision_hint(e.float().double(), e, 1e-12)
    'relative errors of ... to ... (float32 rounding is 1e-07) in a float64 run: ...'
    """
    if expected.dtype != torch.float64 or actual.shape != expected.shape:
        return ""
    a, e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    if not bool(torch.isfinite(a).all() and torch.isfinite(e).all()):
        return ""
    mag = e.abs()
    judged = mag > max(atol, 1e-300)
    diff = (a - e).abs()
    rel = diff[judged & (diff > 0)] / mag[judged & (diff > 0)]
    if rel.numel() == 0:
        return ""
    lo, hi = float(rel.min()), float(rel.max())
    if lo < 1e-3 * F32_EPS or hi > 1e2 * F32_EPS:
        return ""
    return (
        f"relative errors of {lo:.0e} to {hi:.0e} (float32 rounding is {F32_EPS:.0e}) in a "
        "float64 run: something here runs in float32 (a .float() cast, a tensor made before "
        "the dtype was set, a collective on float32 buffers)"
    )


def shard_shape_hint(values_shape: Sequence[int], positions: int, ref_ndim: int) -> str:
    """A shard whose values are its lat x lon block, unflattened: ``Shard.grid`` flattens.

    >>> shard_shape_hint((2, 3, 4, 5), 20, 3)
    "the values are the rank's (4, 5) block, not flattened: use Shard.grid(...)"
    """
    if len(values_shape) == ref_ndim + 1 and values_shape[-1] * values_shape[-2] == positions:
        return (
            f"the values are the rank's {tuple(values_shape[-2:])} block, not flattened: use "
            "Shard.grid(values, rows, cols, nlat, nlon)"
        )
    return ""


def scale_hint(actual: torch.Tensor, expected: torch.Tensor, spatial_size: int) -> str:
    """Name a telltale factor between two tensors: S times, 1/S times, or zero.

    Wrong reductions scale gradients by exactly the group size; saying so points straight at
    the bug (double-counted reduce, mean instead of sum).
    """
    a = as_float64(actual)
    e = as_float64(expected)
    if a.is_complex():
        a, e = torch.view_as_real(a).reshape(-1), torch.view_as_real(e).reshape(-1)
    if a.shape != e.shape or not bool(torch.isfinite(a).all() and torch.isfinite(e).all()):
        return ""
    ee = float((e * e).sum())
    if ee == 0:
        return ""
    if float((a * a).sum()) == 0:
        return (
            "all zeros on this rank: is the parameter out of the graph, "
            "or its gradient never synchronised?"
        )
    ratio = float((a * e).sum()) / ee
    resid = float(((a - ratio * e) ** 2).sum()) / ee
    if resid > 1e-6 or spatial_size <= 1:
        return ""
    if abs(ratio - spatial_size) < 1e-3 * spatial_size:
        return f"exactly {spatial_size}x the reference: a reduction counted {spatial_size} times"
    if abs(ratio - 1 / spatial_size) < 1e-3 / spatial_size:
        return f"exactly 1/{spatial_size} of the reference: averaged where it should sum"
    return ""


def culprit_hint(failure: RankFailure) -> str:
    """For a hang: the ranks that returned while the others waited are the likely cause."""
    if failure.returned:
        ranks = ", ".join(map(str, failure.returned))
        return (
            f"rank {ranks} returned while the others waited in a collective: it skipped "
            "one they entered (an empty domain that skips a reduction or a gather?)"
        )
    return ""


#: Which evidence names a bug most surely, first: a failure of the run, a non-finite value,
#: the batch trap, then the numeric patterns.
_PRIORITY = (
    Quantity.CRASH,
    Quantity.ERROR,
    Quantity.DEADLOCK,
    Quantity.TIMEOUT,
    Quantity.PENDING,
    Quantity.NONFINITE,
    Quantity.BATCH,
)


def likely_cause(mismatches: Sequence[Mismatch]) -> str:
    """The one line most likely to name the bug, from all of a report's mismatches."""
    for quantity in _PRIORITY:
        for m in mismatches:
            if m.quantity == quantity and m.hint:
                return m.hint
    for words in ("border another rank", "float32 rounding", "Shard.grid", "exactly"):
        for m in mismatches:
            if words in m.hint:
                return m.hint
    return ""
