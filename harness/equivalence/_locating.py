"""Locating the first divergence: one step rerun with hooks on every module.

``locate`` reruns the failing step (the steps before it unhooked, so the parameters are the
ones that step saw) three ways: the reference as is, the reference nudged at its dtype's
rounding level (parameters and every module's inputs and input gradients moved by a few
ulps: what rounding alone does to each quantity, its noise floor), and every rank of the
pool. Each run hands back a ``divergence.Trace``: per module call, in execution order, its
inputs, its output, the gradient at its output and the gradient into its inputs; then the
parameter gradients, the loss and the fields. ``divergence.first_divergence`` judges them.

The hooks: a forward pre-hook records a call's inputs and routes each input that needs a
gradient through ``_Tap`` (an identity whose backward sees the gradient this call sends into
that input, exactly what a full backward hook's ``grad_input`` is, but tied to the call); a
forward hook records the output and puts a tensor hook on it (``grad_output``). ``_Tap``
returns a copy, not a view, so a module that writes into its input in place still works (it
writes into the copy; the caller's tensor is left as it was). Should a model still break
under the hooks, it is located again with forward hooks only.

Rank-side code: imports no pytest.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import FunctionCtx
from torch.utils.hooks import RemovableHandle

from harness._base.values import block, is_distributed, plain
from harness._records.run import FieldRecord, detached, map_tensors
from harness.collectives import apply
from harness.divergence import (
    Event,
    Location,
    Placement,
    Trace,
    axes_of,
    first_divergence,
    shard_placement,
)
from harness.equivalence._backward import first_hook, functions_to
from harness.errors import ConfigError, RankFailure
from harness.topology import Topology

if TYPE_CHECKING:
    from harness.case import SpatialCase
    from harness.pool import Runner

#: the nudge: each value times (1 +- NUDGE_ULPS * eps), signs drawn from a private generator
NUDGE_ULPS = 4.0


class _TapCtx(FunctionCtx):
    """Autograd's ``ctx`` with the sink ``_Tap`` keeps on it (torch leaves it untyped)."""

    sink: Callable[[torch.Tensor], torch.Tensor]


class _Tap(torch.autograd.Function):
    """Forward: a copy of ``x``. Backward: the gradient, handed to ``sink`` (which records
    it, and may nudge it)."""

    @staticmethod
    def forward(
        ctx: _TapCtx, x: torch.Tensor, sink: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx: _TapCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.sink(grad), None


def _tensors(obj: object, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in ``obj``'s tuples, lists and dicts, each with a slot name."""
    if isinstance(obj, torch.Tensor):
        return [(prefix or "0", obj)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            out += _tensors(v, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    return out


class Recorder:
    """Hooks on every module of one model that record step ``step`` into a ``Trace``.

    ``nudge``: the perturbed reference (parameters, inputs and input gradients moved by a
    few ulps). ``backward``: also record gradients (off: forward hooks only).
    """

    def __init__(
        self,
        case: SpatialCase,
        topo: Topology,
        step: int,
        *,
        nudge: bool = False,
        backward: bool = True,
    ) -> None:
        self.case, self.topo, self.step = case, topo, step
        self.nudge, self.backward = nudge, backward
        self.trace = Trace(step, forward_only=not backward)
        self.active = False
        self.model: torch.nn.Module | None = None
        self.root: torch.nn.Module | None = None
        self.handles: list[RemovableHandle] = []
        self.names: dict[int, str] = {}
        self.counts: dict[str, int] = {}
        self.stack: list[tuple[str, int]] = []
        self.outputs: dict[int, tuple[str, int, torch.Tensor]] = {}
        self.last_backward: dict[str, int] = {}
        #: parameter -> where in the events its gradient was accumulated (complete)
        self.accumulated: dict[str, int] = {}
        #: parameter -> its gradient before any synchronisation (``None``: none arrived)
        self.presync: dict[str, torch.Tensor | None] = {}
        self.taps: dict[tuple[str, int], list[object]] = {}  # a call's inputs' tap nodes
        self.generator = torch.Generator().manual_seed(20_251_204)

    # ------------------------------------------------------------ run_case's watch protocol

    def attach(self, model: torch.nn.Module) -> None:
        self.model = model
        # under DDP the model is the wrapper's: its modules named as the reference's
        self.root = model = _unwrapped(model)
        for name, module in model.named_modules():
            self.names[id(module)] = name
            source = forward_source(module)
            if source is not None:
                self.trace.sources[name] = source
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post))
        if self.backward:
            for pname, p in model.named_parameters():
                if p.requires_grad:
                    try:
                        hook = p.register_post_accumulate_grad_hook(self._accumulated(pname))
                    except (AttributeError, RuntimeError):  # an older torch, a subclass
                        continue
                    self.handles.append(hook)
            if not self.topo.is_reference:  # the reference has no synchronisation
                self._before_sync(model)
        if self.nudge:
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.copy_(self._nudged(p))

    def phase(self, name: str, step: int | None) -> None:
        self.active = step == self.step and name in (
            f"step {step} forward",
            f"step {step} backward",
        )
        if step == self.step and name == f"step {step} optimizer step":
            self._parameter_gradients()  # complete now: backward is over
        if name == "teardown" or (step is not None and step > self.step):
            self.detach()

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.active = False

    # ------------------------------------------------------------ hooks

    def _before_sync(self, model: torch.nn.Module) -> None:
        """A hook ahead of the case's on every parameter: its gradient before any sync."""
        for pname, p in model.named_parameters():
            name = pname[len("module.") :] if pname.startswith("module.") else pname
            if not p.requires_grad or is_distributed(p):
                continue

            def hook(grad: torch.Tensor, name: str = name) -> None:
                if self.active:
                    held = self.presync.get(name)
                    grad = detached(grad)
                    self.presync[name] = grad if held is None else held + grad

            handle = first_hook(p, hook)
            if handle is not None:
                self.handles.append(handle)
                self.presync[name] = None

    def _nudged(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            return t
        real = {torch.complex128: torch.float64, torch.complex64: torch.float32}.get(
            t.dtype, t.dtype
        )
        eps = torch.finfo(real).eps
        sign = torch.randint(0, 2, t.shape, generator=self.generator).to(real) * 2 - 1
        return t * (1 + NUDGE_ULPS * eps * sign)

    def _accumulated(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.active:
                self.accumulated[name] = len(self.trace.events)

        return hook

    def _event(
        self, module: torch.nn.Module, call: int, kind: str, slot: str, t: torch.Tensor | None
    ) -> Event:
        name = self.names.get(id(module), "?")
        placement: Placement | str | None = None
        tensor = None if t is None else detached(t)
        if tensor is not None and not self.topo.is_reference:
            placement, tensor = self._case_placement(name, tensor)
            if placement is None:
                placement, tensor = _as_placed(tensor)
            if placement is None and not (tensor.is_floating_point() or tensor.is_complex()):
                # indexes and counts are numbered per rank by design (local cells, a data
                # group's samples): they are judged by the values they pick, downstream
                placement = "skip"
        parent = self.stack[-2] if kind == "input" and len(self.stack) > 1 else None
        return Event(
            name, type(module).__name__, call, kind, slot, tensor, parent, False, placement
        )

    def _case_placement(
        self, name: str, tensor: torch.Tensor
    ) -> tuple[Placement | str | None, torch.Tensor]:
        said = self.case.activation_shard(name, tensor, self.topo)
        if said is None or isinstance(said, str):
            if said not in (None, "whole", "skip"):
                raise ConfigError(
                    f"{self.case.label}.activation_shard({name!r}, ...) returned {said!r}; "
                    'return a Shard, "whole", "skip" or None (infer it from partition)'
                )
            return said, tensor
        from harness.case.declared import shard_index

        values = detached(said.values)
        index = shard_index(self.case, f"activation of {name!r}", said)
        return shard_placement(index, said.dim, values.dim(), said.grid_shape), values

    def _pre(
        self, module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        if not self.active:
            return None
        name = self.names.get(id(module), "?")
        call = self.counts.get(name, 0)
        self.counts[name] = call + 1
        self.stack.append((name, call))
        for slot, t in _tensors((args, kwargs)):
            self.trace.events.append(self._event(module, call, "input", slot, t))
        if not (self.nudge or (self.backward and torch.is_grad_enabled())):
            return None
        slots = iter(_tensors((args, kwargs)))

        def wrap(t: torch.Tensor) -> torch.Tensor:
            slot = next(slots)[0]
            if self.nudge:
                t = self._nudged(t)
            if self.backward and t.requires_grad and torch.is_grad_enabled():
                t = apply(_Tap, t, self._sink(module, call, slot))
                self.taps.setdefault((name, call), []).append(t.grad_fn)
            return t

        return map_tensors((args, kwargs), wrap)

    def _sink(
        self, module: torch.nn.Module, call: int, slot: str
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def sink(grad: torch.Tensor) -> torch.Tensor:
            if self.active:
                self.trace.events.append(self._event(module, call, "grad_input", slot, grad))
                name = self.names.get(id(module), "?")
                self.last_backward[name] = len(self.trace.events)
            return self._nudged(grad) if self.nudge else grad

        return sink

    def _post(self, module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
        if not self.active or not self.stack:
            return
        name, call = self.stack.pop()
        parent = self.stack[-1] if self.stack else None
        for slot, t in _tensors(output):
            event = self._event(module, call, "output", slot, t)
            event.parent = parent
            self.trace.events.append(event)
            inner = self.outputs.get(id(t))
            if inner is not None and inner[2] is t:
                # a child's output handed on as this call's own: its gradient is this call's
                for e in self.trace.events:
                    if e.kind == "output" and (e.module, e.call) == inner[:2]:
                        e.through = True
            self.outputs[id(t)] = (name, call, t)
            if self.backward and t.requires_grad:
                t.register_hook(self._grad_output(module, call, slot))
        self._functions(module, name, call, output)

    def _functions(self, module: torch.nn.Module, name: str, call: int, output: object) -> None:
        """On a rank: the autograd Functions between this call's output and its own
        parameters (what its backward runs through), where it owns parameters."""
        taps = self.taps.pop((name, call), [])
        own = dict(module.named_parameters(recurse=False))
        if self.topo.is_reference or not self.backward or not own:
            return
        prefix = f"{name}." if name else ""
        if prefix.startswith("module."):
            prefix = prefix[len("module.") :]
        outputs = [t for _, t in _tensors(output) if t.requires_grad]
        ids = {id(p): prefix + n for n, p in own.items()}
        try:
            found = functions_to(outputs, ids, taps, (_Tap,))
        except Exception:  # noqa: BLE001 - a graph it cannot walk: its Functions unnamed
            return
        for pname, names in found.items():
            self.trace.functions.setdefault(pname, names)

    def _grad_output(
        self, module: torch.nn.Module, call: int, slot: str
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.active:
                self.trace.events.append(self._event(module, call, "grad_output", slot, grad))
                self.last_backward[self.names.get(id(module), "?")] = len(self.trace.events)

        return hook

    def _parameter_gradients(self) -> None:
        """Each parameter's gradient, after the last backward event of the module owning
        it (where its gradient is complete), or at the end."""
        assert self.root is not None
        owner: dict[str, tuple[str, str]] = {}
        for mname, module in self.root.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{mname}.{pname}" if mname else pname
                owner.setdefault(full, (mname, type(module).__name__))
        events = self.trace.events
        inserts: dict[int, list[Event]] = {}
        sharded = self._parameter_shards()
        for full, p in self.root.named_parameters():
            if not p.requires_grad:
                continue
            mname, mtype = owner.get(full, ("", type(self.root).__name__))
            name = full[len("module.") :] if full.startswith("module.") else full
            # complete once accumulated and once its module's backward is over: a gradient
            # judged earlier would be judged before the code that makes it (a parameter of
            # the model itself, used in its first line, is accumulated at the very end)
            at = max(self.last_backward.get(mname, -1), self.accumulated.get(full, -1))
            at = len(events) if at < 0 else at
            grad = None if p.grad is None else detached(p.grad)
            if grad is None and not self.topo.is_reference:
                grad = torch.zeros_like(plain(p.detach())).cpu()  # None is compared as zeros
            placement: Placement | str | None = None
            if grad is not None and not self.topo.is_reference:
                placement, grad = _as_placed(grad)
            event = Event(mname, mtype, 0, "param_grad", name, grad, placement=placement)
            if grad is not None and name in sharded:  # a part of the reference's parameter
                index, dim = sharded[name]
                event.placement = shard_placement(index, dim, grad.dim(), None)
            inserts.setdefault(at, []).append(event)
            if name in self.presync and grad is not None:  # None: no gradient arrived
                before = self.presync[name]
                before = torch.zeros_like(grad) if before is None else before
                self.trace.presync[name] = replace(event, tensor=before)
        merged: list[Event] = []
        for i in range(len(events) + 1):
            merged += inserts.get(i, [])
            if i < len(events):
                merged.append(events[i])
        self.trace.events = merged

    def _parameter_shards(self) -> dict[str, tuple[torch.Tensor, int]]:
        """This rank's sharded parameters (``SpatialCase.parameter_shards``): name -> (its
        positions in the reference's parameter, the dim they run along)."""
        if self.topo.is_reference:
            return {}
        from harness.case import parameter_shards

        assert self.model is not None
        return {
            name: (shard.index, shard.dim)
            for name, shard in parameter_shards(self.case, self.model, self.topo).items()
        }


def forward_source(module: torch.nn.Module) -> tuple[str, int] | None:
    """Where ``module``'s class defines its ``forward``: (file, first line); ``None`` where
    that is not Python code (a scripted module, a builtin)."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return None if code is None else (code.co_filename, code.co_firstlineno)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model a ``DistributedDataParallel`` wraps (its reference runs it unwrapped)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _as_placed(t: torch.Tensor) -> tuple[Placement | None, torch.Tensor]:
    """A distributed tensor as its local shard, placed where its own placements put it in
    the global tensor (``harness._base.values.block``: no collective, its spec says where); a
    plain tensor unplaced.

    Where the placements do not say (``Partial``, two sharded dims) or the block they give
    does not match the local shard (uneven shards the spec cannot say), the shard is placed
    from the case's partition like any tensor. A value that cannot be read at all is handed
    on as it is: judged as unreadable, listed, never raised.
    """
    if not is_distributed(t):
        return None, t
    try:
        local, at = detached(plain(t)), block(t)
    except Exception:  # noqa: BLE001 - locating cannot read it: listed, never raised
        return None, t
    if at is None:
        return None, local
    dim, start, size = at
    if dim is None:  # replicated: the whole tensor on every rank
        return Placement((None,) * local.dim(), ("",) * local.dim()), local
    if local.shape[dim] != size:
        return None, local
    index = tuple(
        torch.arange(start, start + size) if d == dim else None for d in range(local.dim())
    )
    units = tuple("position" if d == dim else "" for d in range(local.dim()))
    return Placement(index, units), local


# ---------------------------------------------------------------------- running it


def _traced(
    case: SpatialCase,
    topo: Topology,
    step: int,
    lr: float,
    seed: int,
    nudge: bool,
    backward: bool,
    reference_init: dict[str, torch.Tensor] | None = None,
) -> Trace:
    from harness._rank.run import run_case

    recorder = Recorder(case, topo, step, nudge=nudge, backward=backward)
    record = run_case(case, topo, step + 1, lr, seed, watch=recorder, reference_init=reference_init)
    trace = recorder.trace
    st = record.steps[step]
    # the loss is computed after the forward, before the backward
    after = (i for i, e in enumerate(trace.events) if e.kind in _BACKWARD)
    trace.events.insert(next(after, len(trace.events)), Event("", "", 0, "loss", "loss", st.loss))
    return finish_trace(trace, case, topo, st.fields)


def finish_trace(
    trace: Trace, case: SpatialCase, topo: Topology, fields: dict[str, FieldRecord]
) -> Trace:
    """``trace`` with the step's ``fields`` as its last events (placed as their shards say)
    and where its rank sits; a training step's and a rollout step's alike."""
    from harness.case import strip_module_prefix

    for name, f in fields.items():
        placement: Placement | str | None = None
        if f.keyed:  # items named by key, in any order: the check itself names them by key
            placement = "skip"
        elif f.sharded:
            assert f.dim is not None
            index = f.positions(0) if not isinstance(f.index, slice) else _slice_positions(f)
            placement = shard_placement(index, f.dim, f.values.dim(), f.grid)
        trace.events.append(
            Event("", "", 0, "field", strip_module_prefix(name), f.values, None, False, placement)
        )
    trace.spatial_rank, trace.data_rank, trace.data_size = (
        topo.spatial_rank,
        topo.data_rank,
        topo.data_size,
    )
    if not topo.is_reference:
        trace.axes = axes_of(case.partition(topo), topo.spatial_rank)
    return trace


_BACKWARD = ("grad_output", "grad_input", "param_grad")


def _slice_positions(f: FieldRecord) -> torch.Tensor:
    assert isinstance(f.index, slice) and f.dim is not None
    s = f.index
    start, step = s.start or 0, s.step or 1
    n = f.values.shape[f.dim]
    return torch.arange(start, start + n * step, step)


def _locate_entry(
    case: SpatialCase,
    spatial_size: int | None,
    step: int,
    lr: float,
    seed: int,
    backward: bool,
    reference_init: dict[str, torch.Tensor] | None = None,
    mesh: tuple[int, ...] | None = None,
) -> Trace:
    """What every rank of the pool runs to be located (module level: the pool pickles it)."""
    topo = Topology.create(spatial_size, mesh)
    return _traced(case, topo, step, lr, seed, False, backward, reference_init)


def locate(
    case: SpatialCase,
    pool: Runner,
    *,
    spatial_size: int | None,
    step: int,
    lr: float,
    seed: int,
    timeout: float | None = None,
    reference_init: dict[str, torch.Tensor] | None = None,
    mesh: tuple[int, ...] | None = None,
) -> Location:
    """Rerun step ``step`` hooked (reference, nudged reference, every rank) and judge it.
    ``reference_init``: for a case that loads the reference's values into its shards;
    ``mesh``: the process grid of the run being located (``Topology.mesh``)."""
    t0 = time.perf_counter()
    problem = ""
    for backward in (True, False):
        try:
            reference = _traced(case, Topology.single(), step, lr, seed, False, backward)
            nudged = _traced(case, Topology.single(), step, lr, seed, True, backward)
            ranks = pool.run(
                _locate_entry,
                case,
                spatial_size,
                step,
                lr,
                seed,
                backward,
                reference_init,
                timeout=timeout,
                **({"mesh": mesh} if mesh else {}),
            )
        except RankFailure as failure:
            problem = rerun_failed(failure)
            continue
        except Exception as exc:  # noqa: BLE001 - a model that breaks under the hooks
            problem = f"the hooked rerun of the reference raised {exc!r}"
            continue
        try:
            location = first_divergence(reference, nudged, ranks)
        except Exception as exc:  # noqa: BLE001 - a diagnosis never takes a verdict down
            problem = f"judging the hooked rerun raised {type(exc).__name__}: {exc}"
            return Location(step=step, problem=problem, seconds=time.perf_counter() - t0)
        location.seconds = time.perf_counter() - t0
        return location
    return Location(step=step, problem=problem, seconds=time.perf_counter() - t0)


def rerun_failed(failure: RankFailure) -> str:
    """Why a hooked rerun on the ranks gave nothing to judge: the first rank that failed."""
    first = next((p for p in failure.problems if p.kind != "stopped"), None)
    return (
        f"the hooked rerun failed on rank {first.rank}: {first.summary}" if first else str(failure)
    )
