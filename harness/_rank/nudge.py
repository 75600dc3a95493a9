"""A nudged rerun's inputs: the parameters as built and every floating tensor of the batch,
each value moved by a few units of rounding of the precision the computation runs in, with
random signs from a generator of the rerun's own. Reruns nudged this way measure what
rounding alone does to a quantity (its rounding spread): a rollout's envelope
(``harness.rollout``) and a check's calibrated judgement (``harness._calibrate``).

Rank-side code: imports no pytest, nothing of the pool.
"""

from __future__ import annotations

from typing import Any

import torch

from harness._records import map_tensors

#: a rollout member's nudge: each value times (1 +- NUDGE_ULPS * unit), ``unit`` the machine
#: epsilon of the precision the computation runs in (the tensor's own dtype, or the autocast
#: dtype; ``nudge_unit``); a calibrated check nudges by its own ``harness._calibrate.ULPS``
NUDGE_ULPS = 4.0

_REAL = {torch.complex128: torch.float64, torch.complex64: torch.float32}


def nudge_unit(autocast: torch.dtype | None) -> float | None:
    """The unit a rerun is nudged by: under autocast the autocast dtype's epsilon (a float32
    nudge of 4 ulps is mostly erased when the value is cast to bf16, so the reruns would
    spread like float32 while the ranks round like bf16); otherwise ``None``, each tensor's
    own dtype's epsilon.

    >>> nudge_unit(torch.bfloat16), nudge_unit(None)
    (0.0078125, None)
    """
    return None if autocast is None else float(torch.finfo(autocast).eps)


def nudged(
    t: torch.Tensor,
    generator: torch.Generator,
    unit: float | None = None,
    ulps: float = NUDGE_ULPS,
) -> torch.Tensor:
    """``t`` times ``(1 +- ulps * unit)``, a sign per value; integers, bools and empty
    tensors as they are. ``unit`` defaults to the epsilon of ``t``'s (real) dtype, and is
    never below it (a nudge smaller than the tensor's own rounding would be rounded away)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return t
    real = _REAL.get(t.dtype, t.dtype)
    eps = float(torch.finfo(real).eps)
    step = ulps * max(eps, unit or 0.0)
    sign = torch.randint(0, 2, t.shape, generator=generator).to(real) * 2 - 1
    return t * (1 + step * sign)


class Nudge:
    """One nudged rerun: its parameters nudged once after build, its batches as they come.

    Only the inputs: nudging every module's input at every call too (as locating does for
    one step) made the spread of the Lorenz-96 ring 2-3x wider still, while the partitioned
    run's own rounding is already 5-100x inside the input-only spread there; the looser
    envelope would only hide bugs."""

    def __init__(self, member: int, unit: float | None = None, ulps: float = NUDGE_ULPS) -> None:
        self.generator = torch.Generator().manual_seed(20_261_204 + 7919 * member)
        self.unit, self.ulps = unit, ulps

    def attach(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() or p.is_complex():
                    p.copy_(nudged(p, self.generator, self.unit, self.ulps))

    def batch(self, batch: Any) -> Any:
        return map_tensors(batch, lambda t: nudged(t, self.generator, self.unit, self.ulps))

    def detach(self) -> None:
        """Nothing to undo (kept for the rollout's callers: the nudge holds no hooks)."""
