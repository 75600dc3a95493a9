"""A nudged rerun's inputs: the parameters as built and every floating tensor of the batch,
each value moved by a few units of rounding of its own dtype, with random signs from a
generator of the rerun's own. Reruns nudged this way measure what
rounding alone does to a quantity (its rounding spread): a rollout's envelope
(``harness.rollout``) and a check's calibrated judgement (``harness.equivalence._calibrate``).

Rank-side code: imports no pytest, nothing of the pool.
"""

from __future__ import annotations

from typing import Any

import torch

from harness._records.run import map_tensors

#: a rollout member's nudge: each value times (1 +- NUDGE_ULPS * eps), ``eps`` the machine
#: epsilon of the tensor's own dtype; a calibrated check nudges by
#: ``harness.equivalence._calibrate.ULPS``
NUDGE_ULPS = 4.0

_REAL = {torch.complex128: torch.float64, torch.complex64: torch.float32}


def nudged(t: torch.Tensor, generator: torch.Generator, ulps: float = NUDGE_ULPS) -> torch.Tensor:
    """``t`` times ``(1 +- ulps * eps)``, a sign per value, ``eps`` that of ``t``'s (real)
    dtype; integers, bools and empty tensors as they are."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return t
    real = _REAL.get(t.dtype, t.dtype)
    sign = torch.randint(0, 2, t.shape, generator=generator).to(real) * 2 - 1
    return t * (1 + ulps * float(torch.finfo(real).eps) * sign)


class Nudge:
    """One nudged rerun: its parameters nudged once after build, its batches as they come.

    Only the inputs: nudging every module's input at every call too (as locating does for
    one step) made the spread of the Lorenz-96 ring 2-3x wider still, while the partitioned
    run's own rounding is already 5-100x inside the input-only spread there; the looser
    envelope would only hide bugs."""

    def __init__(self, member: int, ulps: float = NUDGE_ULPS) -> None:
        self.generator = torch.Generator().manual_seed(20_261_204 + 7919 * member)
        self.ulps = ulps

    def attach(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() or p.is_complex():
                    p.copy_(nudged(p, self.generator, self.ulps))

    def batch(self, batch: Any) -> Any:
        return map_tensors(batch, lambda t: nudged(t, self.generator, self.ulps))

    def detach(self) -> None:
        """Nothing to undo (kept for the rollout's callers: the nudge holds no hooks)."""
