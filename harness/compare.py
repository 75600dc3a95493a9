"""Tolerances, tensor comparison and the mismatch table.

A comparison is elementwise ``|actual - expected| <= atol + rtol * |expected|`` (numpy's
``allclose`` rule, the reference being ``expected``; for complex values ``|.|`` is the
modulus). Both terms matter: partitioned runs reorder sums, so errors scale with magnitude
(``rtol``), and many gradient entries sit near zero, where only an absolute term can hold
(``atol``).

Non-finite values are findings, never matches: where either side holds a NaN or an inf, the
bound says nothing (``NaN > x`` is false, ``inf - inf`` is NaN), so such a position fails
unless the caller declares non-finite values expected (``allow_nonfinite``); then it passes
only where both sides hold the same non-finite value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class Quantity(str, Enum):
    """What a ``Mismatch`` is about. A ``str`` enum: ``Quantity.GRAD == "grad"``, and both
    find the same entry of a table keyed on either. ``Mismatch.quantity`` holds the plain
    text (``str(Quantity.GRAD)`` is ``"grad"``): a report's rows travel to xdist's
    controller, which carries built-in types only."""

    LOSS = "loss"
    GRAD = "grad"
    FIELD = "field"
    PARAM = "param"
    COVERAGE = "coverage"
    BATCH = "batch"
    SYNC = "sync"
    BUFFER = "buffer"
    NONFINITE = "nonfinite"
    CRASH = "crash"
    ERROR = "error"
    TIMEOUT = "timeout"
    DEADLOCK = "deadlock"
    PENDING = "pending"
    VACUOUS = "vacuous"

    def __str__(self) -> str:
        return self.value


#: Quantities compared value by value, each with its own ``Bound`` in a ``Tolerance``.
NUMERIC = (Quantity.LOSS, Quantity.GRAD, Quantity.FIELD, Quantity.PARAM)
#: Quantities that say a run failed (a rank raised, died, hung or left work in flight),
#: where ``Mismatch.where`` is the rank's own summary rather than a position.
FAILURES = (
    Quantity.CRASH,
    Quantity.ERROR,
    Quantity.TIMEOUT,
    Quantity.DEADLOCK,
    Quantity.PENDING,
    Quantity.VACUOUS,
)

_REAL_OF = {
    torch.complex128: torch.float64,
    torch.complex64: torch.float32,
    torch.complex32: torch.float16,
}


@dataclass(frozen=True)
class Bound:
    """``|actual - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        if not (self.rtol >= 0 and self.atol >= 0):  # also refuses NaN
            raise ValueError(f"tolerances must be >= 0, got rtol={self.rtol}, atol={self.atol}")


@dataclass(frozen=True)
class Tolerance:
    """How close the partitioned run must be to the reference, per quantity.

    ``Tolerance.for_dtype(torch.float32)`` gives the defaults; ``tol.with_(grad=(rtol, atol))``
    changes one quantity. Parameters after a step are also required to be *bitwise* equal
    across the ranks of a spatial group: that check has no tolerance.
    """

    loss: Bound
    grad: Bound
    field: Bound
    param: Bound

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Tolerance:
        # A complex value carries two numbers of its real dtype: the same rounding applies.
        dtype = _REAL_OF.get(dtype, dtype)
        if dtype == torch.float64:
            # A partitioned run computes the same sums in another order (per-rank partial sums,
            # then the all-reduce): rounding differs by about sqrt(n)*eps relative, with
            # eps = 1.1e-16 and n up to ~1e6 terms -> ~1e-13. rtol 1e-10 leaves a margin of
            # ~1000 and still catches any logic bug, which moves values by far more.
            # atol 1e-12 covers entries that cancel to ~0 (their error is relative to the
            # terms summed, not to the result).
            b = Bound(rtol=1e-10, atol=1e-12)
            return cls(loss=b, grad=b, field=b, param=b)
        if dtype == torch.float32:
            # Measured on a real SFNO (float32, 4 ranks): fields differ from the serial run by
            # up to ~3e-7 absolute, gradients by ~3e-8 where many entries are ~0. eps is
            # 1.2e-7, so rtol 1e-5 allows ~100 eps of reordering; the atol values sit ~10x
            # above the measured absolute differences of values near zero.
            return cls(
                loss=Bound(rtol=1e-5, atol=1e-7),
                grad=Bound(rtol=1e-4, atol=1e-6),
                field=Bound(rtol=1e-5, atol=3e-6),
                param=Bound(rtol=1e-5, atol=1e-6),
            )
        if dtype in (torch.float16, torch.bfloat16):
            # ~3 significant digits: only gross errors are detectable in half precision.
            b = Bound(rtol=2e-2, atol=1e-3)
            return cls(loss=b, grad=b, field=b, param=b)
        return cls.exact()

    @classmethod
    def exact(cls) -> Tolerance:
        b = Bound(rtol=0.0, atol=0.0)
        return cls(loss=b, grad=b, field=b, param=b)

    @classmethod
    def uniform(cls, rtol: float, atol: float) -> Tolerance:
        b = Bound(rtol=rtol, atol=atol)
        return cls(loss=b, grad=b, field=b, param=b)

    def with_(self, **bounds: tuple[float, float] | Bound) -> Tolerance:
        """A copy with some quantities changed: ``tol.with_(grad=(1e-4, 1e-7))``."""
        fixed = {k: v if isinstance(v, Bound) else Bound(*v) for k, v in bounds.items()}
        return dataclasses.replace(self, **fixed)

    def bound(self, quantity: Quantity | str) -> Bound:
        return getattr(self, str(quantity))  # type: ignore[no-any-return]


@dataclass
class Mismatch:
    """One thing the partitioned run got wrong.

    ``quantity`` is a ``Quantity``'s text (``loss, grad, field, coverage, batch, param,
    sync, buffer, nonfinite, crash, error, timeout, deadlock, pending, vacuous``), plain
    ``str`` however it was given; ``step`` is ``None`` for the parameters right after
    ``build``; ``rank`` is ``None`` when the mismatch belongs to no single rank.
    ``run`` says whose values are at fault when that is not the partitioned run's
    (``"reference"`` or ``"golden"``); ``of`` is the quantity a ``nonfinite`` value was found
    in; ``phase`` is where a rank was when it failed (``"step 0 forward"``).
    """

    quantity: str
    name: str
    step: int | None
    rank: int | None
    max_abs: float = math.nan
    max_rel: float = math.nan
    where: str = ""
    count: int = 0
    total: int = 0
    detail: str = ""
    hint: str = ""
    run: str = ""
    of: str = ""
    phase: str = ""

    def __post_init__(self) -> None:
        self.quantity = str(self.quantity)  # a Quantity given: its plain text (it travels)

    @property
    def who(self) -> str:
        if self.run:
            return f"the {self.run}"
        return f"rank {self.rank}" if self.rank is not None else "all ranks"

    @property
    def label(self) -> str:
        """The name with the quantity it belongs to, for ``nonfinite``: ``grad w``."""
        return f"{self.of} {self.name}" if self.of else self.name

    def headline(self) -> str:
        """One line: ``rank 2: grad 'encoder.weight' at step 1: max abs ...``."""
        if self.phase:
            when = f"in {self.phase}"
        else:
            when = "after build" if self.step is None else f"at step {self.step}"
        what = (
            f"{self.quantity} {self.of} '{self.name}'"
            if self.of
            else (f"{self.quantity} '{self.name}'")
        )
        text = f"{self.who}: {what} {when}"
        if self.quantity in FAILURES:
            return f"{text}: {self.where}" if self.where else text
        if not math.isnan(self.max_abs):
            text += f": max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"
        if self.total:
            text += f", {self.count}/{self.total} " + (
                "not finite" if self.quantity == "nonfinite" else "over tolerance"
            )
        if self.where:
            text += f", {'first' if self.quantity == 'nonfinite' else 'worst'} at {self.where}"
        return text


@dataclass
class Difference:
    """How two tensors differ under a bound (``ok`` if every element is within it).

    ``max_abs`` and ``max_rel`` are over the positions where both sides are finite (``inf``
    when a non-finite value differs, with ``allow_nonfinite``); ``max_rel`` leaves out entries
    whose reference is within ``atol`` of zero. ``count`` is the positions over tolerance,
    non-finite ones included; ``nonfinite`` the positions where a NaN or inf was found and not
    accepted, ``nonfinite_at`` the flat index of the first.
    """

    ok: bool
    max_abs: float
    max_rel: float
    count: int
    total: int
    worst: int | None  # flat index of the worst element (by excess over the bound)
    problem: str = ""  # dtype/shape problem, if any
    nonfinite: int = 0
    nonfinite_at: int | None = None


def compare_tensors(
    actual: torch.Tensor, expected: torch.Tensor, bound: Bound, *, allow_nonfinite: bool = False
) -> Difference:
    """Compare elementwise under ``bound``; dtype and shape must match exactly.

    Floating and complex tensors use the bound; integer and bool tensors must be equal. A
    NaN or inf on either side fails the position unless ``allow_nonfinite`` (then both sides
    must hold the same non-finite value there).
    """
    if actual.dtype != expected.dtype:
        return _unlike(expected, f"dtype {actual.dtype} where the reference has {expected.dtype}")
    if actual.shape != expected.shape:
        return _unlike(
            expected,
            f"shape {tuple(actual.shape)} where the reference has {tuple(expected.shape)}",
        )
    total = expected.numel()
    if total == 0:
        return Difference(True, 0.0, 0.0, 0, 0, None)
    a = _flat(actual)
    e = _flat(expected)
    if not (a.is_floating_point() or a.is_complex()):
        return _compare_exact(a, e)
    finite = torch.isfinite(a) & torch.isfinite(e)
    diff = torch.where(finite, (a - e).abs(), 0.0)
    mag = torch.where(finite, e.abs(), 0.0)
    allowed = bound.atol + bound.rtol * mag
    nonfinite = ~finite
    if allow_nonfinite:
        nonfinite = nonfinite & ~_same_value(a, e)
    over = (finite & (diff > allowed)) | nonfinite
    # Relative error is meaningless for entries that cancel to ~0 (their rounding is relative
    # to the terms summed, not to the result): those are judged by atol alone and left out.
    # (``mag > atol >= 0`` rather than a clamp: a clamp at the smallest normal number would
    # shrink the relative error of subnormal references. The 1.0 only keeps the positions
    # left out from dividing by zero; any positive number would do.)
    judged = mag > bound.atol
    rel = torch.where(judged, diff / torch.where(judged, mag, 1.0), 0.0)
    excess = torch.where(nonfinite, torch.full_like(diff, math.inf), diff - allowed)
    bad_nonfinite = int(nonfinite.sum())
    return Difference(
        ok=not bool(over.any()),
        max_abs=math.inf if bad_nonfinite else float(diff.max()),
        max_rel=math.inf if bad_nonfinite else float(rel.max()),
        count=int(over.sum()),
        total=total,
        worst=int(torch.argmax(excess)),
        nonfinite=bad_nonfinite,
        nonfinite_at=int(torch.argmax(nonfinite.to(torch.uint8))) if bad_nonfinite else None,
    )


def _compare_exact(a: torch.Tensor, e: torch.Tensor) -> Difference:
    """Integers and bools must be equal (a bound on an index or a mask means nothing);
    compared in their own dtype, since float64 cannot tell 2**53 from 2**53 + 1."""
    over = a != e
    diff = (a.to(torch.float64) - e.to(torch.float64)).abs()
    diff = torch.where(over & (diff == 0), torch.ones_like(diff), diff)  # beyond float64
    mag = e.to(torch.float64).abs()
    rel = torch.where(over, diff / mag.clamp_min(1.0), torch.zeros_like(diff))
    return Difference(
        ok=not bool(over.any()),
        max_abs=float(diff.max()),
        max_rel=float(rel.max()),
        count=int(over.sum()),
        total=a.numel(),
        worst=int(torch.argmax(diff)),
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64) if t.is_floating_point() else t


def _same_value(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Where ``a`` and ``e`` hold the same value, NaN counting as equal to NaN."""
    if a.is_complex():
        ar, er = torch.view_as_real(a), torch.view_as_real(e)
        return ((ar == er) | (torch.isnan(ar) & torch.isnan(er))).all(dim=-1)
    return (a == e) | (torch.isnan(a) & torch.isnan(e))


def _unlike(expected: torch.Tensor, problem: str) -> Difference:
    """Tensors that cannot be compared elementwise: every element counts as different."""
    return Difference(False, math.nan, math.nan, 0, expected.numel(), None, problem)


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int, int | None]:
    """(NaN count, inf count, flat index of the first non-finite element or None)."""
    flat = _flat(t)  # integers and bools: isnan and isinf are all False
    nan = torch.isnan(flat)
    inf = torch.isinf(flat)
    bad = nan | inf
    if not bool(bad.any()):
        return 0, 0, None
    return int(nan.sum()), int(inf.sum()), int(torch.argmax(bad.to(torch.uint8)))


def nonfinite_text(nan: int, inf: int) -> str:
    """``"2 NaN, 1 inf"`` (only the parts that are there)."""
    return ", ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if p)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits: NaN equals the same NaN, ``-0.0`` differs from ``0.0``."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(_bits(a), _bits(b)))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors differ in their bits."""
    x = _bits(a).reshape(a.numel(), a.element_size())  # a row of bytes per element
    y = _bits(b).reshape(b.numel(), b.element_size())
    return int((x != y).any(dim=1).sum())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def scale_hint(actual: torch.Tensor, expected: torch.Tensor, spatial_size: int) -> str:
    """Name a telltale factor between two tensors: S times, 1/S times, or zero.

    Wrong reductions scale gradients by exactly the group size; saying so points straight at
    the bug (double-counted reduce, mean instead of sum).
    """
    a = _flat(actual)
    e = _flat(expected)
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


#: What to do about each quantity; keyed on ``Quantity`` (so plain text finds it too).
REMEDIES: dict[str, str] = {
    Quantity.LOSS: (
        "The loss differs: reduce per-rank loss parts with reduce_loss over the spatial "
        "group (weighted sums and weight sums separately, not a mean of means), average over data "
        "groups only, and slice area weights or masks to the rank's rows."
    ),
    Quantity.GRAD: (
        "Gradients differ: sum parameter gradients over the spatial group "
        "(sync_gradients), use spatial_sum for global values inside the model and reduce_loss "
        "only for the loss, and gather with an autograd-aware gather."
    ),
    Quantity.FIELD: (
        "Outputs differ: check the split rule used to scatter data (the SHT's ceil "
        "split), the order shards are gathered in (sample-major, spatial group only), "
        "neighbour tables in global indices, and noise drawn for the global field."
    ),
    Quantity.COVERAGE: (
        "Some positions are owned by no rank or by several: each global position must "
        "appear in exactly one rank's Shard index."
    ),
    Quantity.PARAM: (
        "Parameters after an optimizer step differ from the reference: follow the first "
        "gradient mismatch, or check initialisation is seeded identically on every rank."
    ),
    Quantity.SYNC: (
        "Ranks of one spatial group hold different parameters after a step: their "
        "gradients were not synchronised (sum over the spatial group before stepping)."
    ),
    Quantity.BUFFER: (
        "A buffer was modified in place during a step while the reference's was not: "
        "DDP-style broadcast_buffers copies into buffers between forwards."
    ),
    Quantity.NONFINITE: (
        "A NaN or inf: no comparison can vouch for a value that is not finite. If "
        "the reference is not finite, make the case finite (inputs, initialisation, lr); if only "
        "ranks are, look for a division by a per-rank count that is zero on an empty rank, or an "
        "uninitialised halo or padding. If the model is meant to produce them, set "
        "expect_nonfinite = True on the case: then they must match position for position."
    ),
    Quantity.CRASH: ("A rank process died: its exit code or signal and last output are above."),
    Quantity.ERROR: (
        "A rank raised: its traceback is above (listed first: the rank that failed "
        "first; ranks that lost a peer in a collective follow)."
    ),
    Quantity.TIMEOUT: (
        "A rank did not finish in time, and nothing proved a deadlock: it computes or "
        "waits on something the harness cannot see (a spin loop, a lock, a file), or the work is "
        "slower than the timeout. Every rank's stack is above."
    ),
    Quantity.DEADLOCK: (
        "The run can never finish: each waiting rank says what it waits in (operation, "
        "group, number, size, line) and which rank never did its part, by skipping a collective, "
        "a send or a receive, or by calling a different one (an empty domain that skips a "
        "reduction or a gather?). Every waiting rank's stack is above."
    ),
    Quantity.BATCH: (
        "The reference's batch is not the data groups' batches together: size the "
        "global batch without topo.data_size (the reference always has data_size 1) and give "
        "each data group its share with data_share(n, topo)."
    ),
    Quantity.PENDING: (
        "A rank returned with an operation that can never complete: a collective "
        "some member never entered, or an isend nobody receives. Match every collective on every "
        "member and every send with a receive before returning."
    ),
    Quantity.VACUOUS: (
        "The check proves nothing about the parallel code: give each rank only its part "
        "of the domain, return its part of each field as a Shard, and communicate what the model "
        "needs from the others; if the case is meant to be replicated, say why with vacuous_ok = "
        '"reason" on the case.'
    ),
}


@dataclass
class QuantityStats:
    """Worst relative and absolute error seen for one quantity, passing or not."""

    compared: int = 0
    max_rel: float = 0.0
    max_abs: float = 0.0

    def add(self, d: Difference) -> None:
        self.compared += 1
        if not math.isnan(d.max_rel):
            self.max_rel = max(self.max_rel, d.max_rel)
        if not math.isnan(d.max_abs):
            self.max_abs = max(self.max_abs, d.max_abs)


@dataclass
class FieldError:
    """Where a reassembled field differs: the largest error at each global position.

    ``error`` and ``owners`` (the rank that owns each position) run along the sharded
    dimension; with ``grid`` (rows, cols) they are flattened lat x lon, and with
    ``unit == "cell"`` they are HEALPix cells in nested order. What error maps are drawn from.
    """

    name: str
    step: int
    data_group: int
    error: torch.Tensor
    owners: torch.Tensor
    grid: tuple[int, int] | None
    unit: str


@dataclass(repr=False)
class EquivalenceReport:
    """What ``check_equivalence`` found. ``ok`` is true when nothing mismatched.

    ``str(report)`` is a table: problem, evidence, remedy.
    """

    case: str
    ranks: int
    spatial_size: int
    partition: str
    steps: int
    dtype: str
    tolerance: Tolerance | None
    mismatches: list[Mismatch] = field(default_factory=list)
    stats: dict[str, QuantityStats] = field(default_factory=dict)
    reference: dict[str, torch.Tensor] = field(default_factory=dict)
    field_errors: list[FieldError] = field(default_factory=list)
    seconds: float = 0.0
    likely: str = ""  # the one line most likely to name the bug, if the evidence says
    latitudes: list[float] | None = None  # the case's, for error maps (SpatialCase.latitudes)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def quantities(self) -> set[str]:
        """The quantities that mismatched."""
        return {m.quantity for m in self.mismatches}

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        # ``assert report.ok, report`` shows the repr: make it the table, not the fields
        return str(self)

    def worst(self, quantity: str) -> float | None:
        s = self.stats.get(quantity)
        return s.max_rel if s and s.compared else None

    def summary_row(self) -> dict[str, Any]:
        """A picklable summary for terminal tables (one row per check)."""
        return {
            "case": self.case,
            "ranks": self.ranks,
            "spatial": self.spatial_size,
            "partition": self.partition,
            "dtype": self.dtype,
            "worst": {str(q): self.worst(q) for q in NUMERIC},  # plain text keys: rows travel
            "ok": self.ok,
            "problems": sorted(self.quantities),
            "seconds": round(self.seconds, 2),
        }

    def __str__(self) -> str:
        layout = f"spatial {self.spatial_size}"
        if self.partition and self.partition != layout:
            layout += f", {self.partition}"
        steps = f"{self.steps} step" + ("" if self.steps == 1 else "s")
        head = f"{self.case} on {self.ranks} ranks ({layout}), {steps}, {self.dtype}: "
        if self.ok:
            worst = ", ".join(
                f"{q} {self.worst(q):.1e}" for q in NUMERIC if self.worst(q) is not None
            )
            return head + f"equivalent to the reference (worst relative error: {worst})"
        lines = [
            head + f"{len(self.mismatches)} mismatch(es) with the reference",
            f"First: {self.mismatches[0].headline()}",
            *([f"Likely cause: {self.likely}"] if self.likely else []),
            "",
        ]
        table = mismatch_table(self.mismatches)
        lines += table[:42]
        if len(table) > 42:
            lines.append(f"... and {len(table) - 42} more rows")
        details = [m for m in self.mismatches if m.detail or m.hint][:6]
        for m in details:
            lines += ["", m.headline()]
            if m.hint:
                lines.append(f"  -> {m.hint}")
            if m.detail:
                lines += ["  " + line for line in m.detail.rstrip().splitlines()[-40:]]
        lines.append("")
        if self.tolerance is not None:
            lines.append(f"Tolerance: {_tol_text(self.tolerance)}")
        lines.append("What to do:")
        seen: list[str] = []
        for m in self.mismatches:
            if m.quantity not in seen:
                seen.append(m.quantity)
                lines.append(f"  {m.quantity}: {REMEDIES[m.quantity]}")
        return "\n".join(lines)


def _tol_text(t: Tolerance) -> str:
    return "; ".join(f"{q} rtol {t.bound(q).rtol:g} atol {t.bound(q).atol:g}" for q in NUMERIC)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def _rank_text(ranks: list[int | None]) -> str:
    if any(r is None for r in ranks):
        return "all"
    rs = sorted(set(r for r in ranks if r is not None))
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def _collapse(mismatches: Sequence[Mismatch]) -> list[tuple[Mismatch, list[int | None]]]:
    """One row per (quantity, run, name, step): the worst rank's numbers, every rank listed."""
    rows: dict[tuple[Any, ...], tuple[Mismatch, list[int | None]]] = {}
    for m in mismatches:
        key = (m.quantity, m.run, m.of, m.name, m.step)
        if key not in rows:
            rows[key] = (m, [m.rank])
            continue
        worst, ranks = rows[key]
        ranks.append(m.rank)
        if not math.isnan(m.max_abs) and not (m.max_abs <= worst.max_abs):
            rows[key] = (m, ranks)
    return list(rows.values())


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, free_last: bool = False
) -> list[str]:
    """Left-aligned columns two spaces apart, a dashed rule under the header.

    ``free_last``: the last column is free-form text, so it sets no width.

    >>> format_table(("a", "bb"), [("xyz", "1")])
    ['a    bb', '---  --', 'xyz  1']
    """
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    if free_last:
        widths[-1] = len(header[-1])

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def mismatch_table(mismatches: Sequence[Mismatch]) -> list[str]:
    """The report's table: one row per quantity, name and step; ranks collapsed."""
    header = ("quantity", "name", "step", "rank", "max abs", "max rel", "over tol", "worst at")
    rows = []
    for m, ranks in _collapse(mismatches):
        owner = (
            f" (rank {m.rank})"
            if len(set(ranks)) > 1 and m.rank is not None and "rank" not in m.where
            else ""
        )
        rows.append(
            (
                m.quantity,
                m.label,
                "build" if m.step is None else str(m.step),
                m.run or _rank_text(ranks),
                _fmt(m.max_abs),
                _fmt(m.max_rel),
                f"{m.count}/{m.total}" if m.total else "-",
                (m.where or "-") + owner,
            )
        )
    return format_table(header, rows, free_last=True)


def equivalence_table(
    rows: list[dict[str, Any]], width: int | None = None, *, show_ranks: bool = True
) -> list[str]:
    """The terminal table of every equivalence checked: one line per check.

    With ``width``, the partition column is shortened (ending in "...") until each line
    fits, down to 12 characters. ``show_ranks=False`` leaves out the ranks column (when
    every row has the same).
    """
    header: tuple[str, ...] = ("case", "ranks", "partition", "dtype", *NUMERIC, "golden", "verdict")
    body: list[tuple[str, ...]] = []
    for r in rows:
        w = r["worst"]
        body.append(
            (
                r["case"],
                f"{r['ranks']}",
                r["partition"],
                r["dtype"],
                *("-" if w.get(q) is None else f"{w[q]:.1e}" for q in NUMERIC),
                r.get("golden", "-"),
                "equivalent" if r["ok"] else "MISMATCH: " + ",".join(r["problems"]),
            )
        )
    if not show_ranks:
        header = (header[0], *header[2:])
        body = [(b[0], *b[2:]) for b in body]
    p = header.index("partition")
    if width is not None and body:
        longest = max(len(line) for line in format_table(header, body))
        room = max(12, max(len(b[p]) for b in body) - max(0, longest - width))
        body = [(*b[:p], _shorten(b[p], room), *b[p + 1 :]) for b in body]
    return [
        "worst relative error per quantity, partitioned vs reference:",
        *format_table(header, body),
    ]


def _shorten(text: str, room: int) -> str:
    return text if len(text) <= room else text[: room - 3] + "..."
