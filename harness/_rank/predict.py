"""``SpatialCase.predict`` run as a rollout check runs it: on the reference, on an ensemble
member nudged by a few units of rounding, and on every rank (``_rollout_entry``, what the
pool pickles). The judging is ``harness.rollout``'s.

Rank-side code: imports no pytest, nothing of the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from harness._records import FieldRecord, map_tensors
from harness.errors import ConfigError
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.case import SpatialCase

#: each member's nudge: every floating value times (1 +- NUDGE_ULPS * eps), as ``harness._locate``
NUDGE_ULPS = 4.0


def autocast_context(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` on the CPU at ``dtype``, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def _nudged(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return t
    real = {torch.complex128: torch.float64, torch.complex64: torch.float32}.get(t.dtype, t.dtype)
    sign = torch.randint(0, 2, t.shape, generator=generator).to(real) * 2 - 1
    return t * (1 + NUDGE_ULPS * torch.finfo(real).eps * sign)


class _Watch(Protocol):
    """What ``run_prediction`` tells an observer (``harness._locate_rollout``'s recorder)."""

    def attach(self, model: torch.nn.Module) -> None: ...

    def detach(self) -> None: ...


class _Nudge:
    """One ensemble member: its inputs (the parameters as built, the batch) nudged once.

    Only the inputs: nudging every module's input at every call too (as locating does for
    one step) made the spread of the Lorenz-96 ring 2-3x wider still, while the partitioned
    run's own rounding is already 5-100x inside the input-only spread there; the looser
    envelope would only hide bugs."""

    def __init__(self, member: int) -> None:
        self.generator = torch.Generator().manual_seed(20_261_204 + 7919 * member)
        self.handles: list[Any] = []

    def attach(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.copy_(_nudged(p, self.generator))

    def batch(self, batch: Any) -> Any:
        return map_tensors(batch, lambda t: _nudged(t, self.generator))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


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
) -> list[dict[str, FieldRecord]]:
    """Build the case (seeded as a check's build), take step 0's batch, and roll out
    ``steps`` steps with ``case.predict`` in eval mode under ``torch.no_grad()`` (and
    ``autocast``); each step's fields as records. ``member``: an ensemble member's nudge;
    ``watch``: hooks on the model around ``predict`` (locating a rollout). Leaves the
    caller's RNG states, default dtype and grad mode as it found them."""
    from harness._declared import _check_batch, _check_model
    from harness._rank.run import _mark_phase, _seed, _step_seed
    from harness._rank.state import CallerState

    saved = CallerState.save()
    if case.dtype is not None:
        torch.set_default_dtype(case.dtype)
    model: torch.nn.Module | None = None
    nudge = None if member is None else _Nudge(member)
    phase = "rollout build"
    try:
        if progress is not None:
            progress(phase, None)
        _seed(seed)
        model = _check_model(case, case.build(topo))
        model.eval()
        _seed(_step_seed(seed, 0))
        batch = _check_batch(case, case.batch(topo, 0), 0)
        if nudge is not None:
            nudge.attach(model)
            batch = nudge.batch(batch)
        if watch is not None:
            watch.attach(model)
        phase = "rollout predict"
        if progress is not None:
            progress(phase, None)
        with torch.no_grad(), autocast_context(autocast):
            out = case.predict(model, batch, topo, steps)
        if watch is not None:
            watch.detach()  # what teardown runs is no step of the rollout
        records = _step_records(case, out, steps)
        phase = "teardown"
        case.teardown(model, topo)
        return records
    except BaseException as exc:
        _mark_phase(exc, phase)
        if phase != "teardown":
            with contextlib.suppress(Exception):
                case.teardown(model, topo)
        raise
    finally:
        for hooks in [h for h in (nudge, watch) if h is not None]:
            hooks.detach()
        saved.restore()


def _step_records(case: SpatialCase, out: Any, steps: int) -> list[dict[str, FieldRecord]]:
    from harness._declared import _field_record

    where = f"{case.label}.predict"
    if not isinstance(out, (list, tuple)):
        raise ConfigError(
            f"{where} returned a {type(out).__name__}; return a list with one "
            "{name: Shard | tensor} dict per step of the rollout"
        )
    if len(out) != steps:
        raise ConfigError(
            f"{where} returned {len(out)} step(s) for a rollout of {steps}; return one "
            "{name: Shard | tensor} dict per step (steps numbered from 0)"
        )
    records = []
    for k, fields in enumerate(out):
        if not isinstance(fields, dict) or not fields:
            got = "an empty dict" if isinstance(fields, dict) else f"a {type(fields).__name__}"
            raise ConfigError(
                f"{where}: step {k} of the rollout is {got}; give each step a non-empty "
                "{name: Shard | tensor} dict of its fields"
            )
        records.append({str(n): _field_record(case, str(n), v) for n, v in fields.items()})
    return records


def _rollout_entry(
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
