"""Hints computed from the evidence: what a mismatch's numbers say about its cause.

Each function looks at one kind of evidence and returns a sentence, or ``""`` when the
evidence does not point anywhere in particular (a generic remedy is given anyway):

- ``boundary_hint``: the positions that differ sit on the edges between ranks' blocks,
  more than chance would put there, so a halo (or a neighbour table) is off;
- ``precision_hint``: a float64 run off by about float32 rounding *and* a float32 value
  seen on its path (``float32_evidence``: a collective's tensors, a module's output), so
  that is where the rounding came in;
- ``shard_shape_hint``: a shard's values are its block unflattened, so ``Shard.grid`` was
  wanted;
- ``scale_hint``: a gradient exactly S times or 1/S of the reference, or all zeros, so a
  reduction is counted twice, averaged where it should sum, or never done;
- ``culprit_hint``: for a hang, the ranks that returned while the others waited;
- ``likely_cause``: of all the mismatches of a report, the one line that most likely names
  the bug.

A hint is a claim about the cause: each is given only on evidence that a logic bug of the
same size would not also produce (``tests/distributed/test_hints.py`` holds both sides).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from harness._records.run import RunRecord
from harness.compare import REAL_OF, Mismatch, Quantity, Tolerance, as_float64
from harness.errors import RankFailure

#: float32's unit roundoff; a float64 run whose errors are a few of these came through
#: float32 somewhere (float64's is 1.1e-16: reordered sums stay far below 1e-12).
F32_EPS = float(torch.finfo(torch.float32).eps)
#: the dtypes whose values carry float32 rounding (a complex64 is two float32s)
F32_DTYPES = ("float32", "complex64")


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


#: The boundary hint is given only where errors at random positions would sit on the
#: borders as these do with at most this probability: one or two bad positions that happen
#: to border another rank say nothing about a halo.
BY_CHANCE = 1e-3


def by_chance(hits: int, n: int, share: float) -> float:
    """An upper bound on the probability that at least ``hits`` of ``n`` positions drawn at
    random fall where a ``share`` of all positions lie (Chernoff's bound; drawing without
    replacement only makes it smaller).

    >>> round(by_chance(1, 1, 0.375), 3)  # one position on a border: no evidence
    0.375
    >>> by_chance(12, 12, 0.375) < 1e-3  # twelve: a pattern
    True
    """
    if n == 0 or share <= 0:
        return 1.0 if hits == 0 else 0.0
    q = hits / n
    if q <= share:
        return 1.0
    if share >= 1:
        return 1.0
    if q >= 1:
        return share**n
    kl = q * math.log(q / share) + (1 - q) * math.log((1 - q) / (1 - share))
    return math.exp(-n * kl)


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
    rank's block, such border positions are at most half of all positions, and errors at
    random positions would cluster so with a probability under ``BY_CHANCE``.

    >>> owners = torch.tensor([0] * 16 + [1] * 16 + [2] * 16 + [3] * 16)
    >>> error = torch.zeros(64)
    >>> error[[15, 16, 31, 32, 47, 48]] = 1.0
    >>> boundary_hint(error, owners, 1e-6, None, "cell")
    'the 6 cells that differ all border another rank (6 of 64 cells do): a halo ...'
    >>> error = torch.zeros(64)
    >>> error[15] = 1.0  # one position: it may border by chance (6 of 64 do)
    >>> boundary_hint(error, owners, 1e-6, None, "cell")
    ''
    """
    bad = (error.detach().double() > allowed).numpy()  # NaN is never over: not this hint
    if not bad.any() or len(bad) < 4:
        return ""
    edge = boundary_positions(owners.numpy(), grid, unit)
    on_edge = int((bad & edge).sum())
    if edge.mean() > 0.5 or on_edge < 0.9 * bad.sum():
        return ""
    if by_chance(on_edge, int(bad.sum()), float(edge.mean())) > BY_CHANCE:
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


def float32_evidence(reference: RunRecord, records: Sequence[RunRecord]) -> str:
    """Where a float32 value was seen on the path of a run (``RunRecord.dtypes``): a rank's
    collective first, then a module's output; ``""`` if nowhere.

    >>> rank = RunRecord(dtypes={"float32": "an all_reduce at model.py:42 ran in float32"})
    >>> float32_evidence(RunRecord(), [RunRecord(), rank])
    'an all_reduce at model.py:42 ran in float32 on rank 1'
    """
    runs = [
        *((f"on rank {r}", rec) for r, rec in enumerate(records)),
        ("in the reference", reference),
    ]
    for dtype in F32_DTYPES:
        for who, rec in runs:
            if dtype in rec.dtypes:
                return f"{rec.dtypes[dtype]} {who}"
    return ""


def precision_hint(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, seen: str = ""
) -> str:
    """A float64 comparison whose errors look like float32 rounding, where a float32 value
    was seen on the path (``seen``, from ``float32_evidence``).

    Both are needed: relative errors of the entries over ``atol`` all between 1e-3 and
    1e+2 float32 epsilons (too large for reordered float64 sums, ~1e-16) are what a logic
    bug that moves values only a little also gives (a parameter after one small SGD step);
    a float32 value alone is harmless where it is exact.

    >>> e = torch.linspace(1, 2, 50, dtype=torch.float64)
    >>> precision_hint(e.float().double(), e, 1e-12)  # no float32 seen: no hint
    ''
    >>> precision_hint(e.float().double(), e, 1e-12, "an all_reduce at m.py:4 ran in float32")
    'relative errors of ... to ... (float32 rounding is 1e-07) in a float64 run, and an ...'
    """
    if not seen or expected.dtype != torch.float64 or actual.shape != expected.shape:
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
        f"float64 run, and {seen}: look there for a .float() cast, a tensor made before the "
        "dtype was set, or a float32 buffer"
    )


def shard_shape_hint(
    values_shape: Sequence[int],
    positions: int,
    ref_ndim: int,
    expected: Sequence[int] | None = None,
    grid: tuple[int, int] | None = None,
) -> str:
    """A shard whose values are its lat x lon block, unflattened: ``Shard.grid`` flattens.

    Said when the values have one dimension more than the reference and their last two
    multiply to the shard's positions; with ``expected`` (the shape the reference gives
    for these positions, positions last), only if the dimensions before the block are the
    reference's; with ``grid`` (the field's rows, cols), only if the block fits in it. A
    shape that only multiplies out by chance is no block.

    >>> shard_shape_hint((2, 3, 4, 5), 20, 3)
    "the values are the rank's (4, 5) block, not flattened: use Shard.grid(...)"
    >>> shard_shape_hint((8, 1, 3), 3, 2, expected=(4, 3))  # twice the samples: no block
    ''
    >>> shard_shape_hint((4, 1, 6), 6, 2, expected=(4, 6), grid=(3, 4))  # wider than the grid
    ''
    """
    if len(values_shape) != ref_ndim + 1 or values_shape[-1] * values_shape[-2] != positions:
        return ""
    if expected is not None and list(values_shape[:-2]) != list(expected[:-1]):
        return ""
    if grid is not None and (values_shape[-2] > grid[0] or values_shape[-1] > grid[1]):
        return ""
    return (
        f"the values are the rank's {tuple(values_shape[-2:])} block, not flattened: use "
        "Shard.grid(values, rows, cols, nlat, nlon)"
    )


def scale_hint(
    actual: torch.Tensor, expected: torch.Tensor, spatial_size: int, rtol: float | None = None
) -> str:
    """Name a telltale factor between two tensors: S times, 1/S times, or zero.

    Wrong reductions scale gradients by exactly the group size; saying so points straight at
    the bug (double-counted reduce, mean instead of sum). Only an *exact* factor is named:
    the actual values must be S (or 1/S) times the reference's to within ``rtol`` (default:
    the gradient tolerance of their dtype), relative, in the factor and in the norm of what
    is left, since a doubled sum differs from twice the reference only by its summation
    order, which the tolerance bounds. A logic bug that happens to come out near S is not
    a factor: left out.
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
    if rtol is None:
        rtol = Tolerance.for_dtype(expected.dtype).grad.rtol
    # a few ulps of the dtype always: the factor itself is computed in floating point
    eps = (
        torch.finfo(REAL_OF.get(expected.dtype, expected.dtype)).eps
        if e.is_floating_point()
        else 0.0
    )
    limit = max(rtol, 16 * float(eps))
    ratio = float((a * e).sum()) / ee
    left = math.sqrt(max(0.0, float(((a - ratio * e) ** 2).sum()) / ee))
    if left > limit or spatial_size <= 1:
        return ""
    if abs(ratio - spatial_size) <= limit * spatial_size:
        return f"exactly {spatial_size}x the reference: a reduction counted {spatial_size} times"
    if abs(ratio - 1 / spatial_size) <= limit / spatial_size:
        return f"exactly 1/{spatial_size} of the reference: averaged where it should sum"
    return ""


def culprit_hint(failure: RankFailure) -> str:
    """For a proven deadlock: the rank that returned while the others wait for its part, in
    the words of the proof (which operation kind it skipped, or that it entered one as
    another). A rank that merely finished first while the others hang for a reason nothing
    proved (a timeout), or ranks that wait for each other, name no culprit."""
    proven = any(p.kind == "deadlock" for p in failure.problems)
    returned = [p for p in failure.problems if p.kind == "returned"]
    if not proven or not returned:
        return ""
    return "; ".join(f"rank {p.rank} {p.summary}" for p in returned)


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
    for words in (
        "border another rank",
        "float32 rounding",
        "Shard.grid",
        "exactly",
        "global index",
    ):
        for m in mismatches:
            if words in m.hint:
                return m.hint
    return ""
