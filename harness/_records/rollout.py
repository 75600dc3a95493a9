"""What a rollout check found (``RolloutRecord``, one ``RolloutPoint`` per step and field):
kept apart from the check (``harness.rollout``, where users import them) so that the report,
which holds one, sits below the checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.compare import Mismatch

if TYPE_CHECKING:
    from harness._records.samples import RolloutSamples


@dataclass
class RolloutPoint:
    """One step and field of a rollout: how far the partitioned run is from the reference
    (``error``, max abs), how far rounding alone took the ensemble (``spread``), the bound
    (``envelope``) and ``ratio = error / spread``."""

    step: int
    name: str
    error: float
    spread: float
    envelope: float
    scale: float  # the reference's max abs at this step (for a relative reading)
    #: under autocast: the reference's distance from its rollout without autocast (max abs),
    #: a multiple of which the bound also allows (``judge_rollout``); 0 without autocast
    precision: float = 0.0

    @property
    def ratio(self) -> float:
        if self.spread > 0:
            return self.error / self.spread
        return 0.0 if self.error == 0 else math.inf

    @property
    def divergent(self) -> bool:
        return not (self.error <= self.envelope)  # NaN is divergent


@dataclass
class RolloutRecord:
    """What a rollout check found: every step's error curve, the first divergent step."""

    steps: int
    members: int
    factor: float
    autocast: str = ""
    curve: list[RolloutPoint] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)
    #: why the rounding spread was measured by fewer members than asked (the clock)
    not_calibrated: list[str] = field(default_factory=list)
    seconds: float = 0.0
    serial_seconds: float = 0.0  # of ``seconds``: the reference and its nudged reruns
    #: the reference's rollout as a golden stores it (``harness._records.samples.RolloutSamples``)
    samples: RolloutSamples | None = None

    @property
    def first(self) -> RolloutPoint | None:
        """The first divergent step (the earliest field of it, in the reference's order)."""
        return next((p for p in self.curve if p.divergent), None)

    def _floor(self, point: RolloutPoint) -> str:
        """What else the bound of ``point`` is at least."""
        if not point.precision:
            return "the check's field tolerance"
        return (
            f"the check's field tolerance and 4x the serial {self.autocast or 'autocast'} "
            f"run's distance from the high-precision one ({point.precision:.3g}):"
        )

    def field_curve(self, name: str) -> list[RolloutPoint]:
        return [p for p in self.curve if p.name == name]

    def lines(self) -> list[str]:
        first = self.first
        out = []
        if first is not None:
            ratio = "inf" if math.isinf(first.ratio) else f"{first.ratio:.3g}"
            out.append(
                f"First divergent step: step {first.step} of {self.steps}, field "
                f"'{first.name}': max abs {first.error:.3g}, {ratio}x the rounding spread "
                f"({first.spread:.3g} over {self.members} nudged reruns; bound "
                f"{self.factor:g}x, at least {self._floor(first)} {first.envelope:.3g})"
            )
        elif self.curve and any(p.precision for p in self.curve):
            # under autocast the bound is mostly the reduced precision's: say how near it
            worst = max(self.curve, key=lambda p: p.error / p.envelope if p.envelope else 0.0)
            share = worst.error / worst.envelope if worst.envelope else 0.0
            out.append(
                f"Rollout: {self.steps} steps within their bound ({self.factor:g}x the rounding "
                f"spread of {self.members} nudged reruns, or 4x the serial {self.autocast} "
                f"run's distance from the high-precision one; worst {share:.2g} of it at step "
                f"{worst.step}, field '{worst.name}')"
            )
        elif self.curve:
            worst = max(self.curve, key=lambda p: p.ratio if p.spread > 0 else 0.0)
            out.append(
                f"Rollout: {self.steps} steps within {self.factor:g}x the rounding spread of "
                f"{self.members} nudged reruns (worst {worst.ratio:.2g}x at step {worst.step}, "
                f"field '{worst.name}')"
            )
        out += [f"Not compared: {n}" for n in self.not_compared]
        out += [f"Not calibrated: {n}" for n in self.not_calibrated]
        return out
