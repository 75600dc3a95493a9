"""A check judged by the model's own rounding: the reference rerun ``MEMBERS`` times, nudged
by a few units of rounding, while the ranks run; each entry of every loss, gradient, field
and parameter then judged within ``FACTOR`` times the spread the reruns reach there
(``harness._judges.spread``, the rule; docs/precision.md, the measurements behind it).

On by default where a check runs below float64 and no tolerance was given (``tolerance=`` or
``SpatialCase.tolerance`` stay the user's explicit override); ``check_equivalence(...,
calibrate=False)`` turns it off. Under autocast the ratio rule judges the values
(``harness._judges.autocast``): the serial run under autocast is already a draw of the model's
own
rounding there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from harness._base.cpus import torch_threads
from harness._judges.spread import Spreads, spreads_of
from harness._rank.deadline import Deadline, RanOut
from harness._rank.nudge import Nudge
from harness._rank.run import run_case
from harness._records.run import RunRecord
from harness.compare import Quantity
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.case import SpatialCase
    from harness.case.declared import CheckSpec

#: Nudged reruns of the reference that measure each entry's rounding spread; each costs one
#: serial training run, run while the ranks run.
MEMBERS = 4
#: An entry fails when the partitioned run is further from the reference than FACTOR times
#: its spread (gradients and parameters, which carry their gradient's rounding after a
#: step: GRAD_FACTOR). Measured on correct float32 runs (docs/precision.md): every built-in
#: stepper's layouts, a halo model, 40 drawn SFNO grids and process grids, and fme's SFNO on
#: 2x2, 4x1 and 1x4: losses at most 2.1x, fields 5.6x (fme), parameters 6.8x (fme),
#: gradients 9.0x (their sums cancel most); a halo one row short whose dropped weights are
#: 1e-6 of the centre's: fields at 29x-33x. Each factor is 2.5x or more the worst correct
#: run of its quantities.
FACTOR = 14.0
GRAD_FACTOR = 24.0
#: Each rerun's nudge, in units of rounding (each value times 1 +- ULPS * eps). One, not the
#: rollout's four: a correct partitioned training step stays within a few units of rounding
#: of each entry, and a wider nudge widens every entry's spread, and the bound, with it.
#: Measured (docs/precision.md): the halo bug at 6-12x the spread with 4, at 19-47x with 1,
#: while the correct runs' worst rose from 3x to 5x.
ULPS = 1.0
#: torch threads for the reruns in the calling process, as every rank runs (the rollout's
#: SERIAL_THREADS: many small operations, where intra-op threads cost more than they give)
SERIAL_THREADS = 1


def calibrates(
    dtype: torch.dtype,
    *,
    asked: bool | None,
    tolerance_given: bool,
    autocast: torch.dtype | None,
) -> bool:
    """Whether a check is judged by its rounding spread: as ``asked``, else by default
    where it runs below float64 without a tolerance of the user's or autocast."""
    if asked is not None:
        return asked and autocast is None
    if tolerance_given or autocast is not None:
        return False
    real = {torch.complex128: torch.float64, torch.complex64: torch.float32}.get(dtype, dtype)
    return real.is_floating_point and real != torch.float64


@dataclass
class Calibration:
    """What the reruns measured: the spreads, how long they took, what went wrong."""

    spreads: Spreads | None = None
    seconds: float = 0.0
    problem: str = ""
    notes: list[str] = field(default_factory=list)


def spread_runs(
    spec: CheckSpec,
    case: SpatialCase,
    *,
    members: int = MEMBERS,
    deadline: Deadline | None = None,
    done: list[RunRecord] | None = None,
) -> list[RunRecord]:
    """The reference's training (``spec``'s steps, learning rate and seed) rerun
    ``members`` times, each nudged by ``ULPS`` units of rounding
    with a generator of its own, in this process with ``SERIAL_THREADS`` torch threads;
    each stopped by ``deadline`` (``RanOut``) at the check's timeout. ``done`` (if given)
    collects the reruns as they finish, so a caller sees how far they got."""
    out = [] if done is None else done
    tick = None if deadline is None else deadline.progress
    with torch_threads(SERIAL_THREADS):
        for j in range(members):
            nudge = Nudge(j, ULPS)
            out.append(
                run_case(
                    case,
                    Topology.single(),
                    spec.steps,
                    spec.lr,
                    spec.seed,
                    progress=tick,
                    nudge=nudge,
                )
            )
        return out


def calibrate(
    spec: CheckSpec,
    case: SpatialCase,
    reference: RunRecord,
    *,
    members: int = MEMBERS,
    factor: float = FACTOR,
    deadline: Deadline | None = None,
) -> Calibration:
    """Each entry's spread over ``members`` nudged reruns of ``reference``; a rerun that
    raises, or that ``deadline`` stops (the check's timeout; the ranks' run failed), leaves
    the check on its fixed tolerance, said in ``problem``. The same reference
    record judged again with the same training (every layout of a sweep: ``check_layouts``
    runs the reference once) reuses the spreads measured for it."""
    from harness.errors import exception_summary

    # the training only: a sweep's layouts differ in the rest of their specs
    key = (case, spec.steps, spec.lr, spec.seed, members, factor)
    if _LAST is not None and _LAST[0] is reference and _LAST[1] == key:
        return _LAST[2]
    t0 = time.perf_counter()
    out = Calibration()
    done: list[RunRecord] = []  # how far the reruns got, should the clock stop them
    try:
        runs = spread_runs(spec, case, members=members, deadline=deadline, done=done)
    except RanOut as stop:
        out.problem = f"the nudged reruns of the reference {stop} ({len(done)} of {members} done)"
    except Exception as exc:  # noqa: BLE001 - the check falls back to its tolerance, saying why
        out.problem = f"a nudged rerun of the reference raised ({exception_summary(exc)})"
    else:
        wider = max(factor, GRAD_FACTOR)
        try:
            out.spreads = spreads_of(reference, runs, factor, {"grad": wider, "param": wider})
        except Exception as exc:  # noqa: BLE001 - a value the spread cannot read: said, not raised
            out.problem = f"the spreads could not be measured ({exception_summary(exc)})"
    out.seconds = time.perf_counter() - t0
    _remember(reference, key, out)
    return out


#: the last reference calibrated, its arguments and what was measured (held, so its id
#: cannot be reused by another record while it is remembered)
_LAST: tuple[RunRecord, tuple[object, ...], Calibration] | None = None


def _remember(reference: RunRecord, key: tuple[object, ...], out: Calibration) -> None:
    global _LAST
    _LAST = (reference, key, out) if out.spreads is not None else None


def note(spreads: Spreads, dtype: str) -> str:
    """The report's line on how its values were judged, and what it cannot see."""
    grad = spreads.factor_of(Quantity.GRAD)
    wider = f" (gradients and parameters {grad:g}x)" if grad != spreads.factor else ""
    within = f"{spreads.factor:g}x{wider}"
    return (
        f"judged by rounding: each entry of every loss, gradient, field and parameter within "
        f"{within} its rounding spread ({spreads.members} reruns of the reference nudged by "
        f"{ULPS:g} {dtype} ulp); an error below that multiple of an entry's rounding is not "
        "visible to this check (tolerance= judges by a fixed bound instead)"
    )
