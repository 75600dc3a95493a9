"""One run of a case: build, then each step's batch, forward, backward and SGD step,
recorded (``run_case``); the same code for the reference (``Topology.single()``) and on
every rank, where ``rank_entry`` is what the pool runs.

The rank side of the contract in ``harness.case``: the contract says what a case is and
checks what it returns; this module runs it, with the watchers of the rank (the
interceptor's counts, the mutants' injector, the pool's progress reports), which the
contract never imports.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from harness._base.compat import manual_seed
from harness._base.values import is_distributed, placed, plain
from harness._mutation.catalogue import MutantKind
from harness._rank.dtypes import OutputDtypes, autocast_context, collective_dtypes
from harness._rank.nudge import Nudge
from harness._rank.state import CallerState
from harness._records.run import ParamShard, RunRecord, StepRecord, detached
from harness.case import (
    SpatialCase,
    load_init,
    load_shards,
    parameter_shards,
    strip_module_prefix,
)
from harness.case.declared import (
    ActivationCheck,
    check_batch,
    check_model,
    check_partition,
    check_returned_loss,
    field_record,
)
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.case.declared import CheckSpec

Progress = Callable[[str, "int | None"], None]


class Watch(Protocol):
    """What ``run_case`` tells an observer (``harness.equivalence._locating.Recorder``)."""

    def attach(self, model: torch.nn.Module) -> None: ...

    def phase(self, name: str, step: int | None) -> None: ...


def _seed(seed: int) -> None:
    manual_seed(seed)  # torch.manual_seed, without queueing seeds for absent accelerators
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + 7919 * (step + 1)) % 2**31


def run_case(
    case: SpatialCase,
    topo: Topology,
    steps: int,
    lr: float,
    seed: int,
    *,
    progress: Progress | None = None,
    reference_init: dict[str, torch.Tensor] | None = None,
    watch: Watch | None = None,
    nudge: Nudge | None = None,
) -> RunRecord:
    """Build, then ``steps`` times: batch, forward, backward, record, SGD step.

    Runs the same way for the reference (``Topology.single()``) and on each rank, and leaves
    the calling process's RNG states and default dtype as it found them. ``progress(phase,
    step)`` is told each phase as it starts ("build", "step 0 batch", "step 0 forward",
    "step 0 backward", "step 0 optimizer step"), so failures can say where they happened; an
    exception leaves with that phase in ``exc.harness_phase``. With ``reference_init`` (a
    rank of a case with ``load_reference_shards``), the reference's initial values are
    copied into the rank's parameter shards after build. ``watch`` (locating) is given
    the model after build and told each phase too. ``nudge`` (a nudged rerun of the
    reference, ``harness.equivalence._calibrate``) moves the parameters as built and every batch by
    a
    few units of rounding.
    """
    # long: the phases in order inside one try, so every failure carries its phase
    phase: list[Any] = ["build", None]

    def enter(name: str, step: int | None = None) -> None:
        phase[:] = [name, step]
        if watch is not None:
            watch.phase(name, step)
        if progress is not None:
            progress(name, step)

    saved = CallerState.save()
    if case.dtype is not None:
        torch.set_default_dtype(case.dtype)
    model: torch.nn.Module | None = None
    try:
        enter("build")
        mutation = _case_mutation(case)
        _seed(
            seed
            + (7919 * (topo.rank + 1) if mutation.get("build") == MutantKind.RNG_PER_RANK else 0)
        )
        model = check_model(case, case.build(topo))
        if watch is not None:
            watch.attach(model)
        _note_buffers(case, model)
        params = dict(model.named_parameters())
        shards = parameter_shards(case, model, topo)
        if not topo.is_reference:
            check_partition(case, topo)
        loaded = _load_reference(case, model, topo, shards, reference_init)
        if nudge is not None:
            nudge.attach(model)
        record = RunRecord(init=_param_values(params, shards))
        record.param_shards, record.loaded_shards = shards, loaded
        outputs = OutputDtypes(model)  # evidence for precision hints: what came out of modules
        answers = None if topo.is_reference else ActivationCheck(case, model, topo)
        training = _Training(case, model, topo, lr, seed, enter, mutation, shards, nudge)
        try:
            for step in range(steps):
                record.steps.append(_train_step(training, step))
                if answers is not None:  # the first step's answers are the evidence
                    answers.close()
        finally:
            outputs.close()
            if answers is not None:
                answers.close()
        # a collective's sighting names the line that issued it: it wins over a module's
        record.dtypes = {**outputs.seen(), **collective_dtypes(torch.get_default_dtype())}
        enter("teardown")
        case.teardown(model, topo)
        return record
    except BaseException as exc:
        _mark_phase(exc, str(phase[0]))
        if phase[0] != "teardown":
            try:
                case.teardown(model, topo)  # undo build's patches even when the run failed
            except Exception as teardown_exc:  # noqa: BLE001 - the run's own error comes first
                if sys.version_info >= (3, 11):
                    exc.add_note(f"(and teardown raised {teardown_exc!r})")
        raise
    finally:
        saved.restore()


@dataclass(frozen=True)
class _Training:
    """What every step of one training run takes: the case and its model built on
    ``topo``, the run's learning rate and seed, and what watches it (``enter``: the phase
    announcer; the mutants to inject; the parameter shards; a calibration rerun's nudge)."""

    case: SpatialCase
    model: torch.nn.Module
    topo: Topology
    lr: float
    seed: int
    enter: Callable[[str, int], None]
    mutation: dict[str, MutantKind]
    shards: dict[str, ParamShard]
    nudge: Nudge | None


def _train_step(run: _Training, step: int) -> StepRecord:
    """One step: batch, forward, backward, plain SGD; what it recorded."""
    case, model, topo, enter = run.case, run.model, run.topo, run.enter
    shards, mutation, nudge, lr = run.shards, run.mutation, run.nudge, run.lr
    params = dict(model.named_parameters())
    enter(f"step {step} batch", step)
    per_rank = topo.rank + 1 if mutation.get("batch") == MutantKind.RNG_PER_RANK else 0
    _seed(_step_seed(run.seed, step) + per_rank)
    batch = check_batch(case, case.batch(topo, step), step)
    if nudge is not None:
        batch = nudge.batch(batch)
    model.zero_grad(set_to_none=True)
    buffers = {n: (b, b._version, detached(plain(b))) for n, b in model.named_buffers()}
    enter(f"step {step} forward", step)
    if mutation.get("build") == MutantKind.BUFFERS_BROADCAST:
        _broadcast_buffers(model, topo)
    out = case.forward(model, batch, topo)
    loss = check_returned_loss(case, out, any(p.requires_grad for p in params.values()))
    fields = {k: field_record(case, k, v) for k, v in out.fields.items()}
    if loss.requires_grad:  # a model without parameters has nothing to differentiate
        enter(f"step {step} backward", step)
        loss.backward()
    grads = {
        strip_module_prefix(n): (
            None if p.grad is None else _value(p.grad, shards.get(strip_module_prefix(n)))
        )
        for n, p in params.items()
        if p.requires_grad
    }
    enter(f"step {step} optimizer step", step)
    with torch.no_grad():
        for p in params.values():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
    mutated = sorted(
        strip_module_prefix(n)
        for n, (b, version, before) in buffers.items()
        if b._version != version or not torch.equal(plain(b).detach().cpu(), before)
    )
    return StepRecord(
        loss=_value(loss),
        grads=grads,
        fields=fields,
        params=_param_values(params, shards),
        mutated_buffers=mutated,
    )


def _value(t: torch.Tensor, shard: ParamShard | None = None) -> torch.Tensor:
    """What a run records of ``t``: plain CPU values that share nothing with the model, a
    DTensor's as its placements place them (``harness._base.values``). A sharded parameter's
    value that comes whole (a gradient gathered from ``Partial`` sums, a replicated one) is
    cut to the shard's positions, as its parameter is recorded."""
    at = placed(t)
    values = at.values
    if shard is not None and at.dim is None and is_distributed(t) and values.dim() > shard.dim:
        values = values.index_select(shard.dim, shard.index.to(values.device))
    return detached(values)


def _param_values(
    params: dict[str, torch.nn.Parameter], shards: dict[str, ParamShard]
) -> dict[str, torch.Tensor]:
    return {
        strip_module_prefix(n): _value(p, shards.get(strip_module_prefix(n)))
        for n, p in params.items()
    }


def _load_reference(
    case: SpatialCase,
    model: torch.nn.Module,
    topo: Topology,
    shards: dict[str, ParamShard],
    reference_init: dict[str, torch.Tensor] | None,
) -> list[str]:
    """On a rank given the reference's initial values: load them (every parameter with
    ``load_reference_init``, the shards with ``load_reference_shards``); the names loaded."""
    if reference_init is None:
        return []
    if case.load_reference_init:
        return load_init(case, model, topo, shards, reference_init)
    return load_shards(case, model, topo, shards, reference_init)


def _case_mutation(case: SpatialCase) -> dict[str, MutantKind]:
    """On a rank of a ``--spatial-mutants`` run: the case-level mutant to inject at
    ``build`` or ``batch`` (``{}`` for the reference and every other run)."""
    from harness._mutation.inject import INJECTOR

    return INJECTOR.case_kinds(case)


def _note_buffers(case: SpatialCase, model: torch.nn.Module) -> None:
    from harness._mutation.inject import INJECTOR

    INJECTOR.note_buffers(case, lambda: any(True for _ in model.buffers()))


def _broadcast_buffers(model: torch.nn.Module, topo: Topology) -> None:
    """The ``buffers-broadcast`` mutant: DDP's broadcast_buffers, in place, from the spatial
    group's first rank."""
    import torch.distributed as dist

    if topo.spatial_group is None:
        return
    with torch.no_grad():
        for b in model.buffers():
            dist.broadcast(b, src=topo.spatial_ranks[0], group=topo.spatial_group)


def _mark_phase(exc: BaseException, phase: str) -> None:
    """Say on the exception where in the run it was raised (once: the innermost wins)."""
    if getattr(exc, "harness_phase", None) is None:
        try:
            exc.harness_phase = phase  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__
            return
        if sys.version_info >= (3, 11):
            exc.add_note(f"(harness: raised in {phase})")


def rank_entry(
    spec: CheckSpec,
    case: SpatialCase,
    reference_init: dict[str, torch.Tensor] | None = None,
) -> RunRecord:
    """What every rank of the pool runs (module level, so the pool can pickle it): the
    training ``spec`` asks for, on its layout (``spatial_size``, ``mesh``) and under its
    ``autocast``. ``reference_init``: the reference's parameters after build, for a case that
    loads them (``SpatialCase.load_reference_shards``, ``load_reference_init``)."""
    from harness._rank.loop import report_progress
    from harness.adopt import check_operations

    checks = check_operations()
    topo = Topology.create(spec.spatial_size, spec.mesh or None)
    with autocast_context(spec.autocast):
        record = run_case(
            case,
            topo,
            spec.steps,
            spec.lr,
            spec.seed,
            progress=report_progress,
            reference_init=reference_init,
        )
    record.spatial_rank, record.data_rank = topo.spatial_rank, topo.data_rank
    record.spatial_size, record.data_size = topo.spatial_size, topo.data_size
    record.describe = case.describe(topo)
    issued = _operations_issued()
    # harness.adopt.check_group's agreement is the harness's talk, not the model's
    record.communicated = None if issued is None else issued - (check_operations() - checks)
    return record


def _operations_issued() -> int | None:
    """How many torch.distributed operations this rank issued in the run (collectives from
    Python or C++, sends and receives), as the pool's watcher counted them."""
    from harness._rank.intercept import TRACKER

    if not TRACKER.active:  # outside a run of a pool's rank or a launched rank: not watched
        return None
    counts = TRACKER.counts()
    if counts is None:
        return None
    return (
        sum(counts.collectives.values()) + sum(counts.sends.values()) + sum(counts.recvs.values())
    )
