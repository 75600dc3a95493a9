"""``SpatialCase.predict`` run as a rollout check runs it: on the reference, on an ensemble
member nudged by a few units of rounding, and on every rank (``rollout_entry``, what the
pool pickles). The judging is ``harness.rollout``'s.

Rank-side code: imports no pytest, nothing of the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from harness._rank.nudge import NUDGE_ULPS, Nudge
from harness._records.run import FieldRecord
from harness.errors import ConfigError
from harness.topology import Topology

if TYPE_CHECKING:
    from harness._rank.deadline import Deadline
    from harness.case import SpatialCase

__all__ = ["NUDGE_ULPS", "autocast_context", "run_prediction"]


def autocast_context(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` on the CPU at ``dtype``, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


#: an ensemble member (its older, private name; ``harness._rank.nudge.Nudge``)
_Nudge = Nudge


class _Watch(Protocol):
    """What ``run_prediction`` tells an observer (``harness.equivalence._locating_rollout``'s
    recorder)."""

    def attach(self, model: torch.nn.Module) -> None: ...

    def detach(self) -> None: ...


class _Where:
    """Where a rollout is, as a failure names it and the board shows it (a hang's report).

    ``predict`` returns its steps at the end, so the step a failure inside it was in is
    known only where predict says it: a predict that ``yield``s each step's fields is in
    ``rollout step k predict`` while it computes step k. One that returns a list is in
    ``rollout predict``, with what can be seen honestly: the calls of the model itself
    (``3 model calls so far``), which are not steps (a step may call it twice, or not at all)."""

    def __init__(self, steps: int, progress: Callable[[str, int | None], None] | None) -> None:
        self.steps, self.progress = steps, progress
        self.phase = "rollout build"
        self.calls = 0

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self.progress is not None:
            self.progress(phase, None)  # no step: a training step's number would mislead

    def predicting(self) -> None:
        self.enter(self._predict())

    def called(self, *_: Any) -> None:
        """A forward pre-hook of the model: one more call of it."""
        self.calls += 1
        if self.phase.startswith("rollout predict"):
            self.enter(self._predict())

    def _predict(self) -> str:
        # calls begun, not steps: a failure between calls is after the last one counted
        n = self.calls
        calls = f"{n} model call{'s' if n != 1 else ''} so far, " if n else ""
        return f"rollout predict ({calls}rollout of {self.steps} steps)"


def run_prediction(
    case: SpatialCase,
    topo: Topology,
    steps: int,
    seed: int,
    *,
    member: int | None = None,
    autocast: torch.dtype | None = None,
    progress: Callable[[str, int | None], None] | None = None,
    watch: _Watch | None = None,
    deadline: Deadline | None = None,
) -> list[dict[str, FieldRecord]]:
    """Build the case (seeded as a check's build), take step 0's batch, and roll out
    ``steps`` steps with ``case.predict`` in eval mode under ``torch.no_grad()`` (and
    ``autocast``); each step's fields as records. ``member``: an ensemble member's nudge;
    ``watch``: hooks on the model around ``predict`` (locating a rollout); ``deadline``:
    checked at every phase, step and call of the model (a check's serial rollout). Leaves RNG
    states, dtype and grad mode as it found them; a failure's phase: ``exc.harness_phase``."""
    from harness._rank.run import _mark_phase, _seed, _step_seed
    from harness._rank.state import CallerState
    from harness.case.declared import check_batch, check_model

    saved = CallerState.save()
    if case.dtype is not None:
        torch.set_default_dtype(case.dtype)
    model: torch.nn.Module | None = None
    where = _Where(steps, progress if deadline is None else _checked(progress, deadline))
    hooks: list[Any] = []
    try:
        where.enter("rollout build")
        _seed(seed)
        model = check_model(case, case.build(topo))
        model.eval()
        where.enter("rollout batch")
        _seed(_step_seed(seed, 0))
        batch = _nudged(member, model, check_batch(case, case.batch(topo, 0), 0))
        hooks = _hooks(model, where, deadline)
        if watch is not None:
            watch.attach(model)
        where.predicting()
        with torch.no_grad(), autocast_context(autocast):
            out = case.predict(model, batch, topo, steps)
            records = _step_records(case, out, steps, where)  # a generator runs in here
        if watch is not None:
            watch.detach()  # what teardown runs is no step of the rollout
        where.enter("teardown")
        case.teardown(model, topo)
        return records
    except BaseException as exc:
        _mark_phase(exc, where.phase)
        if where.phase != "teardown":
            with contextlib.suppress(Exception):
                case.teardown(model, topo)
        raise
    finally:
        for h in hooks:
            h.remove()
        if watch is not None:
            watch.detach()
        saved.restore()


def _hooks(model: torch.nn.Module, where: _Where, deadline: Deadline | None) -> list[Any]:
    """The rollout's hooks on ``model``: its calls counted (``_Where``), and every module's
    calls clocked by ``deadline``."""
    out = [] if deadline is None else deadline.watch_modules(model)
    with contextlib.suppress(RuntimeError):  # a module that takes no hooks: no counts
        out.append(model.register_forward_pre_hook(where.called))
    return out


def _checked(
    progress: Callable[[str, int | None], None] | None, deadline: Deadline
) -> Callable[[str, int | None], None]:
    """``progress`` (if any), after ``deadline`` is checked."""

    def tell(phase: str, step: int | None) -> None:
        deadline.progress(phase, step)
        if progress is not None:
            progress(phase, step)

    return tell


def _nudged(member: int | None, model: torch.nn.Module, batch: Any) -> Any:
    """An ensemble member's model (nudged in place) and batch; the reference's as they are.

    Nudged in each tensor's own precision, under autocast too: nudges of bf16 units moved
    the members so far that a rank doubling its share of a global sum passed a bf16
    rollout (docs/precision.md); bf16's own rounding is measured by the reference's
    rollout without autocast (``harness.rollout.judge_rollout``'s ``high``)."""
    if member is None:
        return batch
    nudge = Nudge(member)
    nudge.attach(model)
    return nudge.batch(batch)


def _step_records(
    case: SpatialCase, out: Any, steps: int, where: _Where | None = None
) -> list[dict[str, FieldRecord]]:
    """``predict``'s steps as records: a list or tuple of one dict per step, or an
    iterator (a generator that ``yield``s them), of which the first ``steps`` are taken,
    each step's phase entered before it is computed."""
    from harness.case.declared import field_record

    where = where or _Where(steps, None)
    label = f"{case.label}.predict"
    if isinstance(out, (list, tuple)):
        if len(out) != steps:
            raise ConfigError(
                f"{label} returned {len(out)} step(s) for a rollout of {steps}; return one "
                "{name: Shard | tensor} dict per step (steps numbered from 0)"
            )
        given: Any = iter(out)
    elif isinstance(out, Iterator):
        given = out
    else:
        raise ConfigError(
            f"{label} returned a {type(out).__name__}; return a list with one "
            "{name: Shard | tensor} dict per step of the rollout (or yield each step's)"
        )
    records = []
    listed, end = isinstance(out, (list, tuple)), object()
    for k in range(steps):
        where.enter(f"rollout step {k} {'fields' if listed else 'predict'}")
        fields = next(given, end)
        if fields is end:
            raise ConfigError(
                f"{label} yielded {k} step(s) for a rollout of {steps}; yield one "
                "{name: Shard | tensor} dict per step (steps numbered from 0)"
            )
        if not isinstance(fields, dict) or not fields:
            got = "an empty dict" if isinstance(fields, dict) else f"a {type(fields).__name__}"
            raise ConfigError(
                f"{label}: step {k} of the rollout is {got}; give each step a non-empty "
                "{name: Shard | tensor} dict of its fields"
            )
        origin = f"{label} step {k}"
        records.append({str(n): field_record(case, str(n), v, origin) for n, v in fields.items()})
    if isinstance(out, Generator):
        out.close()  # a predict that yields on: the rollout asked for is taken, no more
    return records


def rollout_entry(
    case: SpatialCase,
    spatial_size: int | None,
    steps: int,
    seed: int,
    autocast: torch.dtype | None,
) -> list[dict[str, FieldRecord]]:
    """What every rank of the pool runs for a rollout (module level: the pool pickles it)."""
    from harness._rank.loop import report_progress

    topo = Topology.create(spatial_size)
    return run_prediction(case, topo, steps, seed, autocast=autocast, progress=report_progress)
