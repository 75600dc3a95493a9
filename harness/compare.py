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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from harness._base.deprecation import forward
from harness._base.values import plain


class Quantity(str, Enum):
    """What a ``Mismatch`` is about. A ``str`` enum: ``Quantity.GRAD == "grad"``, and both
    find the same entry of a table keyed on either; ``str(Quantity.GRAD)`` is ``"grad"``.
    What travels to xdist's controller (a report's summary row) holds the plain text: it
    carries built-in types only."""

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
    ROLLOUT = "rollout"

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

REAL_OF = {
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
        """The default tolerance of a run in ``dtype`` (a complex one: of its real dtype's):
        float64, float32, float16 and bfloat16 have their own; any other is exact."""
        # A complex value carries two numbers of its real dtype: the same rounding applies.
        dtype = REAL_OF.get(dtype, dtype)
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
        """Bitwise equality for every quantity (``rtol = atol = 0``)."""
        b = Bound(rtol=0.0, atol=0.0)
        return cls(loss=b, grad=b, field=b, param=b)

    @classmethod
    def uniform(cls, rtol: float, atol: float) -> Tolerance:
        """The same ``Bound(rtol, atol)`` for every quantity."""
        b = Bound(rtol=rtol, atol=atol)
        return cls(loss=b, grad=b, field=b, param=b)

    def with_(self, **bounds: tuple[float, float] | Bound) -> Tolerance:
        """A copy with some quantities changed: ``tol.with_(grad=(1e-4, 1e-7))``."""
        fixed = {k: v if isinstance(v, Bound) else Bound(*v) for k, v in bounds.items()}
        return dataclasses.replace(self, **fixed)

    def bound(self, quantity: Quantity | str) -> Bound:
        """The bound of ``quantity`` (``"loss"``, ``"grad"``, ``"field"`` or ``"param"``)."""
        return getattr(self, str(quantity))  # type: ignore[no-any-return]


@dataclass
class Mismatch:
    """One thing the partitioned run got wrong.

    ``quantity`` is a ``Quantity`` (``loss, grad, field, coverage, batch, param, sync,
    buffer, nonfinite, crash, error, timeout, deadlock, pending, vacuous, rollout``), given
    as one or as its text (a ``str`` enum: it equals its text); ``step`` is ``None`` for the
    parameters right after ``build``; ``rank`` is ``None`` when the mismatch belongs to no
    single rank.
    ``run`` says whose values are at fault when that is not the partitioned run's
    (``"reference"`` or ``"golden"``); ``of`` is the quantity a ``nonfinite`` value was found
    in; ``phase`` is where a rank was when it failed (``"step 0 forward"``).
    """

    quantity: Quantity
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
    #: a calibrated check's judgement: the largest error as a multiple of its entry's
    #: rounding spread, and the multiple allowed (NaN: judged by a fixed tolerance)
    spread_multiple: float = math.nan
    spread_factor: float = math.nan

    def __post_init__(self) -> None:
        # its text given: the member (text that names no quantity raises ValueError)
        self.quantity = Quantity(self.quantity)

    @property
    def who(self) -> str:
        """Whose values are at fault, as a report says it: ``rank 2``, ``all ranks``, ``the
        reference``."""
        if self.run:
            return f"the {self.run}"
        return f"rank {self.rank}" if self.rank is not None else "all ranks"

    @property
    def calibrated(self) -> bool:
        """Judged by its rounding spread (``harness._judges.spread``), not a tolerance."""
        return not math.isnan(self.spread_factor)

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
                "not finite"
                if self.quantity is Quantity.NONFINITE
                else ("over the rounding bound" if self.calibrated else "over tolerance")
            )
        if self.calibrated:
            times = "inf" if math.isinf(self.spread_multiple) else f"{self.spread_multiple:.3g}"
            text += f", {times}x its rounding spread (bound {self.spread_factor:g}x)"
        if self.where:
            first = self.quantity is Quantity.NONFINITE
            text += f", {'first' if first else 'worst'} at {self.where}"
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
    #: with a per-entry ``allowed``: the largest error as a fraction of it (1.0 at the bound)
    of_allowed: float = math.nan


def compare_tensors(
    actual: torch.Tensor,
    expected: torch.Tensor,
    bound: Bound,
    *,
    allow_nonfinite: bool = False,
    allowed: torch.Tensor | None = None,
) -> Difference:
    """Compare elementwise under ``bound``; dtype and shape must match exactly.

    Floating and complex tensors use the bound; integer and bool tensors must be equal. A
    NaN or inf on either side fails the position unless ``allow_nonfinite`` (then both sides
    must hold the same non-finite value there). A DTensor or other subclass is compared by
    the values it holds (``harness._base.values.plain``).

    ``allowed``: the largest difference allowed at each entry (a tensor of ``expected``'s
    shape, e.g. a multiple of each entry's rounding spread, ``harness.equivalence._calibrate``), in
    place of the bound's ``atol + rtol * |expected|``; the bound's ``atol`` still decides
    which entries count for ``max_rel``.
    """
    # long: one rule from dtype and shape to the verdict; the docstring is the contract
    actual, expected = plain(actual), plain(expected)
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
    diff = (a - e).abs()  # finite exactly where both sides are (inf - inf and NaN are not)
    top = float(diff.max())  # NaN if any entry is: max propagates it
    if math.isfinite(top):
        return _compare_finite(diff, top, e, bound, allowed)
    finite = torch.isfinite(a) & torch.isfinite(e)
    diff = torch.where(finite, diff, 0.0)
    mag = torch.where(finite, e.abs(), 0.0)
    given = allowed is not None
    allowed = _allowed(bound, mag, allowed)
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
        of_allowed=_share(diff, allowed, bad_nonfinite) if given else math.nan,
    )


def _compare_finite(
    diff: torch.Tensor, top: float, e: torch.Tensor, bound: Bound, given: torch.Tensor | None
) -> Difference:
    """``compare_tensors`` where every entry of both sides is finite (so is ``diff``, their
    absolute difference, whose largest entry is ``top``): the same verdict and figures in a
    third of the tensor operations (every check compares each gradient, field and parameter
    of every rank and step: on a small model the operations' own overhead is the judging)."""
    mag = e.abs()
    allowed = _allowed(bound, mag, given)
    over, rel, worst = _finite_rows(diff, mag, allowed, bound.atol)
    count = int(over)
    return Difference(
        ok=count == 0,
        max_abs=top,
        max_rel=float(rel),
        count=count,
        total=e.numel(),
        worst=int(worst),
        of_allowed=_share(diff, allowed, 0) if given is not None else math.nan,
    )


def _finite_rows(
    diff: torch.Tensor, mag: torch.Tensor, allowed: torch.Tensor, atol: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along the last dim of finite ``diff`` (one pair's entries, or a row per pair): how
    many entries exceed ``allowed``, the largest relative error among entries whose
    magnitude ``mag`` exceeds ``atol`` (as ``compare_tensors``: cancelled entries are left
    out of it), and the worst entry, by excess over ``allowed``. One arithmetic for a pair
    judged alone (``_compare_finite``) and pairs judged together (``_pass_stacked``)."""
    rel = torch.where(mag > atol, diff / mag, 0.0)  # x/0 only where not judged, and replaced
    return (
        (diff > allowed).sum(dim=-1),
        rel.amax(dim=-1),
        torch.argmax(diff - allowed, dim=-1),
    )


def pass_many(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor, Bound] | None],
) -> list[Difference | None]:
    """``compare_tensors(actual, expected, bound)`` of each ``(actual, expected, bound)`` that
    passes, judged together: for each pair of real floating tensors of one dtype and shape,
    at most ``SCAN_TOGETHER`` entries each, finite everywhere and within its bound, the very
    ``Difference`` ``compare_tensors`` gives it (figures, worst entry and all); ``None`` for
    every other pair (``None`` itself, another kind, a non-finite entry, a failure: compare
    it on its own, which says why).

    The pairs of one size are stacked and judged in one pass of the finite path's operations
    (``_compare_finite``, row by row): a small model's check compares a hundred tensors, and
    one comparison's own overhead (a dozen tensor operations) was most of its judging."""
    out: list[Difference | None] = [None] * len(pairs)
    groups: dict[int, list[int]] = {}
    for i, pair in enumerate(pairs):
        if pair is not None and _stackable(pair[0], pair[1]):
            groups.setdefault(pair[1].numel(), []).append(i)
    for size, members in groups.items():
        found = _pass_stacked([pairs[i] for i in members], size)  # type: ignore[misc]
        for i, d in zip(members, found, strict=True):
            out[i] = d
    return out


def _stackable(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    a, e = plain(actual), plain(expected)
    return (
        a.dtype == e.dtype
        and a.shape == e.shape
        and e.is_floating_point()
        and 0 < e.numel() <= SCAN_TOGETHER
    )


def _pass_stacked(
    pairs: list[tuple[torch.Tensor, torch.Tensor, Bound]], size: int
) -> list[Difference | None]:
    """``pass_many`` of pairs of ``size`` entries each: ``_compare_finite`` on each row of
    their stack, the same operations in the same precision (float64), so the same bits."""
    a = torch.stack([_flat(x) for x, _, _ in pairs])
    e = torch.stack([_flat(y) for _, y, _ in pairs])
    atol = torch.tensor([[b.atol] for _, _, b in pairs], dtype=torch.float64)
    rtol = torch.tensor([[b.rtol] for _, _, b in pairs], dtype=torch.float64)
    diff = (a - e).abs()
    top = diff.amax(dim=1)  # NaN where a row has one: max propagates it
    mag = e.abs()
    allowed = atol + rtol * mag  # as _allowed, a bound per row
    count, rel, worst = _finite_rows(diff, mag, allowed, atol)
    out: list[Difference | None] = []
    for t, r, n, w in zip(top.tolist(), rel.tolist(), count.tolist(), worst.tolist(), strict=True):
        out.append(Difference(True, t, r, 0, size, w) if n == 0 and math.isfinite(t) else None)
    return out


def _allowed(bound: Bound, mag: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """Each entry's allowed difference: ``given`` (flattened), else the bound's."""
    if given is None:
        return bound.atol + bound.rtol * mag
    return given.detach().reshape(-1).to(torch.float64)


def _share(diff: torch.Tensor, allowed: torch.Tensor, nonfinite: int) -> float:
    """The largest ``diff`` as a fraction of ``allowed`` (0/0, an exact match where nothing
    is allowed, is 0; x/0 is inf; so is any non-finite difference)."""
    if nonfinite:
        return math.inf
    return float(torch.where(diff > 0, diff / allowed, 0.0).max())


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
    t = plain(t).detach().reshape(-1)
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64) if t.is_floating_point() else t


#: ``t`` flattened, floating values in float64 (complex in complex128): what every
#: comparison computes in, and the hints too.
as_float64 = _flat


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
    if bool(torch.isfinite(flat).all()):
        return 0, 0, None
    nan = torch.isnan(flat)
    inf = torch.isinf(flat)
    bad = nan | inf
    if not bool(bad.any()):
        return 0, 0, None
    return int(nan.sum()), int(inf.sum()), int(torch.argmax(bad.to(torch.uint8)))


#: tensors up to this many entries are scanned together (one ``cat``: its copy stays small);
#: larger ones each on their own, where one operation's overhead is nothing beside the pass
SCAN_TOGETHER = 1 << 16


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether every entry of every tensor given is finite (``None``, integers and bools
    are): the small ones in one pass, where ``nonfinite_counts`` would take one each (the
    judges scan every value of every run; a non-finite one is rare, and then each tensor is
    scanned on its own to say where)."""
    held = (plain(t) for t in tensors if t is not None)
    small = []
    for v in held:
        if not (v.is_floating_point() or v.is_complex()):
            continue
        if v.numel() > SCAN_TOGETHER:
            if not bool(torch.isfinite(v.detach()).all()):
                return False
        else:
            small.append(v.detach().reshape(-1))
    # cat promotes to the widest dtype given: nothing narrows (a float64 1e300 stays finite)
    return not small or bool(torch.isfinite(torch.cat(small)).all())


def nonfinite_text(nan: int, inf: int) -> str:
    """``"2 NaN, 1 inf"`` (only the parts that are there)."""
    return ", ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if p)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits: NaN equals the same NaN, ``-0.0`` differs from ``0.0``."""
    a, b = plain(a), plain(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(_bits(a), _bits(b)))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors differ in their bits."""
    a, b = plain(a), plain(b)
    x = _bits(a).reshape(a.numel(), a.element_size())  # a row of bytes per element
    y = _bits(b).reshape(b.numel(), b.element_size())
    return int((x != y).any(dim=1).sum())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return plain(t).detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class QuantityStats:
    """Worst relative and absolute error seen for one quantity, passing or not."""

    compared: int = 0
    max_rel: float = 0.0
    max_abs: float = 0.0
    #: the largest error as a multiple of its rounding spread (calibrated checks; NaN: none)
    spread_multiple: float = math.nan

    def add(self, d: Difference, spread_multiple: float = math.nan) -> None:
        self.compared += 1
        if not math.isnan(d.max_rel):
            self.max_rel = max(self.max_rel, d.max_rel)
        if not math.isnan(d.max_abs):
            self.max_abs = max(self.max_abs, d.max_abs)
        if not math.isnan(spread_multiple):
            seen = 0.0 if math.isnan(self.spread_multiple) else self.spread_multiple
            self.spread_multiple = max(seen, spread_multiple)


# Moved, and still importable from here for older code (with a DeprecationWarning): the
# report and its tables are in harness.report, the scale hint in harness.report.hints.
# Forwarded on first use, so this module (the diff engine, which those import) imports
# neither of them.
__getattr__ = forward(
    __name__,
    {
        "REMEDIES": "harness.report",
        "FieldError": "harness.report",
        "EquivalenceReport": "harness.report",
        "format_table": "harness.report",
        "mismatch_table": "harness.report",
        "equivalence_table": "harness.report",
        "scale_hint": "harness.report.hints",
    },
)
