"""Rollout goldens: the bound each stored step and field of a rollout is judged by
(``StepBound``, from today's rollout: ``rollout_bounds``). The policy that uses it is
``harness.goldens``; the names of a rollout's tensors are ``harness._records.samples``'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness._records.samples import rollout_name
from harness.compare import Bound

if TYPE_CHECKING:
    from harness._records.rollout import RolloutRecord


@dataclass(frozen=True)
class StepBound:
    """How far a rollout golden's field at one step may be from today's reference: max abs
    at most ``limit = max(factor x spread, floor)``, the envelope the rollout check itself
    uses (``harness.rollout``). ``spread`` is what rounding alone reached there today (the
    furthest of ``members`` nudged reruns), ``floor`` the golden's fixed field tolerance at
    the field's scale (``atol + rtol x max |reference|``), which holds where rounding moves
    nothing. A golden recorded on another machine or torch build differs from today's
    reference by rounding that the rollout then grows, as a nudged rerun does: a fixed
    tolerance would fail a correct chaotic rollout after a few dozen steps."""

    step: int
    field: str
    steps: int
    spread: float
    factor: float
    members: int
    floor: float

    @property
    def limit(self) -> float:
        return max(self.factor * self.spread, self.floor)

    @property
    def bound(self) -> Bound:
        """As an elementwise bound: every value within ``limit`` (max abs <= limit)."""
        return Bound(0.0, self.limit)

    def where(self) -> str:
        return f"rollout step {self.step} of {self.steps}, field '{self.field}'"

    def text(self) -> str:
        return (
            f"{self.factor:g}x the rounding spread {self.spread:.3g} of {self.members} nudged "
            f"reruns at this step, at least the field tolerance {self.floor:.3g}"
        )


def rollout_bounds(record: RolloutRecord, field_bound: Bound) -> dict[str, StepBound]:
    """The bound of each stored tensor of ``record``'s rollout golden, from today's rollout:
    its step's measured spread (``record.curve``). A stored step and field the rollout did
    not judge (its spread unknown: a nudged rerun went non-finite) has no entry and is
    held to ``field_bound`` elementwise, as the training golden is."""
    out = {}
    for p in record.curve:
        name = rollout_name(p.step, p.name)
        if record.samples is not None and name in record.samples.tensors:
            out[name] = StepBound(
                p.step,
                p.name,
                record.steps,
                p.spread,
                record.factor,
                record.members,
                field_bound.atol + field_bound.rtol * p.scale,
            )
    return out
