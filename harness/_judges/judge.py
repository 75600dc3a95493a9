"""The judge of every check: the run's layout, one comparison of a pair of tensors
under its quantity's bound (``Judge``), diagnoses that never take a finding down, and
how positions and values are written in reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np
import torch

from harness.compare import (
    Mismatch,
    Quantity,
    QuantityStats,
    Tolerance,
    compare_tensors,
    pass_many,
)
from harness.errors import exception_summary
from harness.report.hints import precision_hint, scale_hint

if TYPE_CHECKING:
    from harness._judges.spread import Spreads

T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    """``ranks`` ranks in spatial groups of ``spatial_size`` consecutive ranks."""

    ranks: int
    spatial_size: int

    @property
    def data_size(self) -> int:
        return self.ranks // self.spatial_size

    def lead(self, rank: int) -> int:
        """The first rank (spatial rank 0) of ``rank``'s spatial group."""
        return (rank // self.spatial_size) * self.spatial_size


class Numeric(NamedTuple):
    """One pair for ``Judge.numeric``, its arguments in order (``Judge.numeric_all``)."""

    quantity: Quantity
    name: str
    step: int | None
    rank: int | None
    actual: torch.Tensor
    expected: torch.Tensor
    where: Callable[[int], str] | None = None
    spread: torch.Tensor | None = None


class Judge:
    """Compares one pair of tensors under its quantity's bound and keeps the statistics.

    Non-finite values are reported once each, by ``check_nonfinite``; here they only count
    where the two runs disagree (a NaN against a number), so matching NaNs are not reported
    twice.
    """

    def __init__(
        self,
        tolerance: Tolerance,
        layout: Layout,
        stats: dict[str, QuantityStats],
        float32_seen: str = "",
        diagnoses: list[str] | None = None,
        spreads: Spreads | None = None,
    ):
        self.tolerance, self.layout, self.stats = tolerance, layout, stats
        #: each entry's rounding spread (a calibrated check, ``harness._judges.spread``):
        #: where given, a value is judged by it instead of by the tolerance's bound
        self.spreads = spreads
        self.diagnoses = diagnoses if diagnoses is not None else []
        #: where a float32 value was seen on the path (``hints.float32_evidence``): without
        #: it, errors of float32's size are no evidence of float32 rounding
        self.float32_seen = float32_seen

    def numeric(
        self,
        quantity: Quantity,
        name: str,
        step: int | None,
        rank: int | None,
        actual: torch.Tensor,
        expected: torch.Tensor,
        where: Callable[[int], str] | None = None,
        spread: torch.Tensor | None = None,
    ) -> Mismatch | None:
        """``actual`` against ``expected`` under the quantity's bound, or, given the
        entries' rounding ``spread`` (``expected``'s shape), within the spreads' factor of
        it (``harness._judges.spread``)."""
        allowed, factor = None, math.nan
        # by_spread, spelled out so that the type checker sees both are given
        if spread is not None and self.spreads is not None and self.by_spread(spread, expected):
            from harness._judges.spread import allowance

            factor = self.spreads.factor_of(quantity)
            allowed = allowance(spread, expected, factor)
        d = compare_tensors(
            actual,
            expected,
            self.tolerance.bound(quantity),
            allow_nonfinite=True,
            allowed=allowed,
        )
        multiple = factor * d.of_allowed
        if not d.problem:
            self.stats[quantity].add(d, multiple)
        if d.ok:
            return None
        if d.problem:
            loc = d.problem
        elif expected.dim() == 0:  # a scalar has no position: say what the two values are
            loc = two_values(actual, expected)
        elif where is not None and d.worst is not None:
            loc = where(d.worst)
        else:
            loc = index_text(expected.shape, d.worst)
        hint = self._hint(quantity, name, actual, expected, bool(d.problem))
        return Mismatch(
            quantity,
            name,
            step,
            rank,
            d.max_abs,
            d.max_rel,
            loc,
            d.count,
            d.total,
            hint=hint,
            spread_multiple=multiple,
            spread_factor=factor,
        )

    def numeric_all(self, calls: Sequence[Mismatch | Numeric]) -> list[Mismatch]:
        """The findings of ``calls`` in their order: each ``Numeric`` is ``numeric(*call)``,
        each ``Mismatch`` stays as it is. The calls judged by the tolerance's bound are first
        judged together (``pass_many``): one that passes there only adds to the statistics,
        every other one is judged on its own, which says where and why."""
        bounds = [
            (c.actual, c.expected, self.tolerance.bound(c.quantity))
            if isinstance(c, Numeric) and not self.by_spread(c.spread, c.expected)
            else None
            for c in calls
        ]
        found: list[Mismatch] = []
        for call, passed in zip(calls, pass_many(bounds), strict=True):
            if isinstance(call, Mismatch):
                found.append(call)
            elif passed is not None:
                self.stats[call.quantity].add(passed)
            elif (m := self.numeric(*call)) is not None:
                found.append(m)
        return found

    def by_spread(self, spread: torch.Tensor | None, expected: torch.Tensor) -> bool:
        """Whether ``numeric`` judges a pair by its entries' rounding ``spread`` (given, of
        ``expected``'s shape, in a calibrated check), not by the tolerance's bound."""
        return spread is not None and self.spreads is not None and spread.shape == expected.shape

    def _hint(
        self,
        quantity: Quantity,
        name: str,
        actual: torch.Tensor,
        expected: torch.Tensor,
        problem: bool,
    ) -> str:
        """The likely cause of one pair's difference, if the evidence says."""
        hint = ""
        bound = self.tolerance.bound(quantity)
        what = f"a hint for {quantity} '{name}'"
        if quantity in (Quantity.GRAD, Quantity.LOSS):
            hint = self.diagnose(
                what, "", scale_hint, actual, expected, self.layout.spatial_size, bound.rtol
            )
        # not a parameter after a step: its error is the gradient's scaled by lr and diluted
        # by the parameter's size, small for any bug; the gradient speaks for it
        if not hint and not problem and quantity != Quantity.PARAM:
            hint = self.diagnose(
                what, "", precision_hint, actual, expected, bound.atol, self.float32_seen
            )
        return hint

    def spread(
        self,
        quantity: Quantity,
        step: int,
        name: str,
        cut: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The rounding spread of ``name``'s ``quantity`` at ``step``, cut as its reference
        is (``cut``: a data group's part, a shard's positions); ``None`` where the check is
        not calibrated or the spread was not measured."""
        if self.spreads is None:
            return None
        s = self.spreads.of(quantity, step, name)
        return s if s is None or cut is None else cut(s)

    def diagnose(self, what: str, default: T, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, a diagnosis: should it raise, ``default``, and a ``Not located``
        line saying what could not be said: a hint never takes a finding down."""
        return diagnose(self.diagnoses, what, default, fn, *args)


def diagnose(lines: list[str], what: str, default: T, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, or ``default`` with a ``Not located: <what> (<ExcType>: msg)`` line in
    ``lines`` when it raises."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any failure of a diagnosis is said, not raised
        lines.append(f"Not located: {what} ({exception_summary(exc)})")
        return default


# ---------------------------------------------------------------------- text


def data_part(ref: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    """Data group ``group``'s contiguous share of the samples (dim 0) of ``ref``; a scalar
    has no samples to share: every group's is compared with the whole of it."""
    if groups == 1 or ref.dim() == 0:
        return ref
    k = ref.shape[0] // groups
    return ref[group * k : (group + 1) * k]


def group_part(group: int, groups: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``data_part`` of data group ``group`` as a function of the tensor: how a spread is
    cut as its reference is (``Judge.spread``)."""
    return lambda t: data_part(t, group, groups)


def position_text(pos: int, grid: tuple[int, int] | None, unit: str = "position") -> str:
    """``"(lat 3, lon 7)"`` on a grid (named by its own axes where ``unit`` holds two
    names), ``"cell 12"`` otherwise.

    >>> position_text(19, (4, 8)), position_text(19, (4, 8), "l,m"), position_text(5, None, "cell")
    ('(lat 2, lon 3)', '(l 2, m 3)', 'cell 5')
    """
    if grid is None:
        return f"{unit} {pos}"
    row, col = divmod(pos, grid[1])
    first, second = unit.split(",") if "," in unit else ("lat", "lon")
    return f"({first} {row}, {second} {col})"


def index_text(shape: torch.Size, flat: int | None) -> str:
    """The tensor index of a flat position, ``"(2, 1)"``; empty for a scalar."""
    if flat is None or not len(shape):
        return ""
    return str(tuple(int(i) for i in np.unravel_index(flat, tuple(shape))))


def two_values(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Two scalars with just enough digits to see where they differ.

    >>> f64 = torch.float64
    >>> two_values(torch.tensor(2.28740001, dtype=f64), torch.tensor(2.2874, dtype=f64))
    '2.28740001 vs reference 2.2874'
    """
    a, e = actual.item(), expected.item()
    for digits in range(6, 18):
        ta, te = f"{a:.{digits}g}", f"{e:.{digits}g}"
        if ta != te:
            return f"{ta} vs reference {te}"
    return f"{a!r} vs reference {e!r}"
