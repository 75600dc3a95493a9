"""Locating a failing rollout: its first divergent step rerun with hooks on every module.

A rollout check names the first step ``K`` where the partitioned rollout leaves its envelope
(``RolloutRecord.first``); that says when, not where. ``locate_rollout`` reruns ``predict``
up to step ``K`` three ways, as ``harness.equivalence._locating`` does for a training step: the
reference,
the reference nudged at its dtype's rounding level (its parameters once, then every module's
inputs at step ``K``: the noise floor of each quantity, with the rounding of the ``K`` steps
before in it, as the envelope has), and every rank of the pool. Forward only, in eval mode
under ``torch.no_grad()`` (and the rollout's autocast), as the rollout ran: ``Recorder``'s
forward hooks record every module call of step ``K``, then step ``K``'s fields;
``divergence.first_divergence`` judges them by the training rule.

Which calls are step ``K``'s: ``predict`` is the case's own loop, so nothing outside it sees
where a step begins. Each run counts the module calls that ``predict`` makes for ``K`` steps
(a rerun with ``steps=K``, its hooks only counting), then rolls out ``K + 1`` steps and
records from the call after those on. Each process counts its own calls, so a rank that
makes other calls than the reference is still cut at its own step boundary. This holds for
an autoregressive loop, whose first ``K`` steps of ``K + 1`` make the calls a rollout of ``K``
makes; module calls ``predict`` makes after its last step are recorded as step ``K``'s.

The cost: ``2K + 1`` steps of ``predict`` on the reference, ``K + 1`` on its nudged rerun
and ``2K + 1`` on every rank, hooked; ``K + 1`` for a bug at step 0 (no count is needed).

Like ``harness.equivalence._locating``, this module holds the ranks' side
(``_rollout_trace_entry``, what
the pool pickles: it imports no pytest, nothing of the pool but its type) and the caller's.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from harness._base.cpus import torch_threads
from harness._rank.predict import run_prediction
from harness.divergence import DEPART, Divergence, Location, Trace, first_divergence
from harness.equivalence._locating import Recorder, finish_trace, rerun_failed
from harness.errors import RankFailure
from harness.rollout import SERIAL_THREADS
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.case import SpatialCase
    from harness.case.declared import CheckSpec
    from harness.pool import Runner


class _StepRecorder(Recorder):
    """``Recorder``'s forward hooks, recording from module call ``skip + 1`` of the run on
    (the calls of rollout step ``step`` when ``skip`` calls made the steps before it);
    ``seen`` counts every call."""

    def __init__(
        self, case: SpatialCase, topo: Topology, step: int, skip: int, *, nudge: bool = False
    ) -> None:
        super().__init__(case, topo, step, nudge=nudge, backward=False)
        self.skip, self.seen = skip, 0

    def _pre(
        self, module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        self.seen += 1
        self.active = self.seen > self.skip
        return super()._pre(module, args, kwargs)


def traced_prediction(
    case: SpatialCase,
    topo: Topology,
    step: int,
    seed: int,
    *,
    nudge: bool = False,
    skip: int | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Trace, int]:
    """Rollout step ``step``'s module calls and fields on ``topo``, and the number of module
    calls of the steps before it (``skip``: known already, not counted again)."""
    if skip is None:
        skip = 0
        if step:
            counter = _StepRecorder(case, topo, step, sys.maxsize)
            run_prediction(case, topo, step, seed, autocast=autocast, watch=counter)
            skip = counter.seen
    recorder = _StepRecorder(case, topo, step, skip, nudge=nudge)
    records = run_prediction(case, topo, step + 1, seed, autocast=autocast, watch=recorder)
    trace = recorder.trace
    if recorder.seen <= skip:
        trace.problem = (
            f"predict made {recorder.seen} module call(s) for {step + 1} steps, no more than "
            f"the {skip} it made for {step}: no call belongs to step {step}"
        )
    return finish_trace(trace, case, topo, records[step]), skip


def _rollout_trace_entry(spec: CheckSpec, case: SpatialCase, step: int) -> Trace:
    """What every rank of the pool runs to locate rollout step ``step`` of ``spec``'s
    rollout, on the grid the rollout ran on (module level: pickled)."""
    topo = Topology.create(spec.spatial_size, spec.mesh or None)
    return traced_prediction(case, topo, step, spec.seed, autocast=spec.autocast)[0]


@dataclass(frozen=True)
class RolloutDivergence(Divergence):
    """A first divergence inside a rollout step: its line names the rollout step (``of``:
    the rollout's length), not a training step."""

    of: int = 0

    def line(self) -> str:
        training = f", step {self.step}"  # the training rule's words for its step
        return super().line().replace(training, f", rollout step {self.step} of {self.of}", 1)


#: what made a module's input that departs outside every module call, in a rollout: not the
#: batch (the training rule's words) but predict's own loop, or a model method it calls
#: (a forcing added, a state fed back or kept across steps, noise drawn)
PREDICT_CODE = "predict's code around the module calls"


def _in_rollout(first: Divergence, steps: int) -> RolloutDivergence:
    """``first`` as a divergence of a rollout step of ``steps``: the training rule's "the
    batch" (an input made outside every module call) is predict's code, or at step 0 the
    batch it starts from."""
    values = {f.name: getattr(first, f.name) for f in fields(first)}
    if first.module is None and first.name.startswith("the batch"):
        values["name"] = PREDICT_CODE + (" (or the batch it starts from)" if not first.step else "")
    return RolloutDivergence(**values, of=steps)


def locate_rollout(spec: CheckSpec, case: SpatialCase, pool: Runner, *, step: int) -> Location:
    """Rerun rollout step ``step`` of the rollout ``spec`` asks for hooked on the reference,
    its nudged rerun and every rank; judge it. What cannot be located is
    ``Location.problem``."""
    t0 = time.perf_counter()
    steps, seed, autocast = spec.rollout, spec.seed, spec.autocast
    where = f"rollout step {step} of {steps}"
    try:
        with torch_threads(SERIAL_THREADS):  # as the rollout's serial runs: many small steps
            reference, skip = traced_prediction(
                case, Topology.single(), step, seed, autocast=autocast
            )
            nudged, _ = traced_prediction(
                case, Topology.single(), step, seed, nudge=True, skip=skip, autocast=autocast
            )
        ranks = pool.run(_rollout_trace_entry, spec, case, step, timeout=spec.timeout)
    except RankFailure as failure:
        problem = rerun_failed(failure)
    except Exception as exc:  # noqa: BLE001 - a model that breaks under the hooks
        problem = f"the hooked rerun of the reference's predict raised {exc!r}"
    else:
        problem = next((t.problem for t in (reference, *ranks) if t.problem), "")
    if problem:
        return Location(step=step, problem=f"{where}: {problem}", seconds=_since(t0))
    try:
        location = first_divergence(reference, nudged, ranks)
    except Exception as exc:  # noqa: BLE001 - a diagnosis never takes a verdict down
        problem = f"judging the hooked rerun raised {type(exc).__name__}: {exc}"
        return Location(step=step, problem=f"{where}: {problem}", seconds=_since(t0))
    if location.first is not None:
        location.first = _in_rollout(location.first, steps)
    else:
        location.problem = (
            f"{where} rerun with hooks on every module: no module's input or output, nor a "
            f"field, departs beyond {DEPART:g}x its noise floor (the largest "
            f"{location.worst_multiple:.3g}x, of {location.compared} compared); what leaves "
            "the envelope is smaller than locating's floors"
        )
    location.seconds = _since(t0)
    return location


def _since(t0: float) -> float:
    return time.perf_counter() - t0
