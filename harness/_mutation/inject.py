"""Rank side of mutation: recording call sites, and injecting one mutant.

One ``Injector`` per rank process (``INJECTOR``), holding all of a run's mutation state: the
run's mode (``MutantMode``, from its ``RunCall``), the sites recorded, the post-wait effects
pending, a stale receive's last data. ``harness._rank.intercept``'s watchers of ``ProcessGroup``
only call it: ``record`` after noting an operation of a recording run, ``perform`` instead of
the operation at the mutant's call site (it does the wrong thing on purpose, see
``harness._mutation.catalogue.KINDS``, and returns the work), ``run_after`` once a work is
waited on: the post-wait effects (the AVG division, a rotation, a zeroed or stale receive,
the extra all-reduce) run then, as the data would arrive. ``run_case`` asks it for the
case-level mutants (``case_kinds``).

Imports nothing of the watchers (the call site comes in as a value or a callable); torch is
imported here at first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from harness._mutation.catalogue import REDUCING, Mutant, MutantKind, SiteStats
from harness._mutation.mode import OFF, MutantMode

#: the mutant kinds that act on a case (in ``run_case``), not on an operation
CASE_KINDS = (MutantKind.RNG_PER_RANK, MutantKind.BUFFERS_BROADCAST)


class DoneWork:
    """The work of an operation that was not performed: complete, successful, waited at
    once. Quacks like ``torch.distributed.Work`` for every caller that only waits."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[object]:
        return []

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future[list[object]]:
        import torch

        future: torch.futures.Future[list[object]] = torch.futures.Future()
        future.set_result([])
        return future


@dataclass
class Injector:
    """One rank's mutation state for the current run (see the module docstring)."""

    mode: MutantMode = OFF  # OFF between runs: nothing recorded, nothing injected
    sites: dict[str, SiteStats] = field(default_factory=dict)  # a recording run's sites
    after: dict[int, tuple[object, Callable[[], None]]] = field(default_factory=dict)  # id(work)
    stale: dict[str, list[Any]] = field(default_factory=dict)  # site -> the last received data

    def begin(self, mode: MutantMode) -> None:
        self.sites.clear()
        self.after.clear()
        self.stale.clear()
        self.mode = mode

    def end(self) -> None:
        """The run returned (its pending post-wait effects still run when waited on)."""
        self.mode = OFF

    # ------------------------------------------------------------------ operations

    def perform(
        self,
        mutant: Mutant,
        method: str,
        original: Callable[..., Any],
        pg: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any]:
        """Issue the operation as ``mutant`` says: (its work, the group it ran on; ``None``:
        not run)."""
        import torch.distributed as dist

        kind = mutant.kind
        if kind == MutantKind.SKIP:
            return DoneWork(), None
        if kind == MutantKind.WORLD:
            return original(dist.group.WORLD, *args, **kwargs), dist.group.WORLD
        if kind == MutantKind.MAX:
            args[1].reduceOp = dist.ReduceOp.MAX
        if kind == MutantKind.WRONG_SOURCE:
            args[1].rootRank = (args[1].rootRank + 1) % pg.size()
        if kind == MutantKind.SWAP_SPLITS and method in _TRANSPOSES and len(args) > 3:
            args = (*args[:2], args[3], args[2], *args[4:])
        work = original(pg, *args, **kwargs)
        after = _AFTER.get(kind)
        if after is not None:
            effect = after(_Call(self, mutant, method, original, pg, args, kwargs))
            if work is None:
                effect()
            else:
                self.after[id(work)] = (work, effect)
        return work, pg

    def run_after(self, work: object) -> None:
        """The mutant's effect on an operation whose work has now been waited on."""
        entry = self.after.pop(id(work), None)
        if entry is not None:
            entry[1]()

    def record(
        self, site: str, method: str, name: str, members: tuple[int, ...], args: tuple[Any, ...]
    ) -> None:
        """Note one call at ``site`` (during a recording run)."""
        import torch
        import torch.distributed as dist

        stats = self.sites.get(site)
        if stats is None:
            stats = SiteStats(
                name,
                method,
                group_size=len(members),
                whole_world=len(members) == dist.get_world_size(),
                reduce=_reduction(method, args),
            )
            self.sites[site] = stats
        stats.calls += 1
        stats.backward |= torch._C._current_graph_task_id() != -1
        if method in _TRANSPOSES and len(args) > 3:
            stats.uneven |= list(args[2] or ()) != list(args[3] or ())
        at = _INPUT_AT.get(method, 0)
        if len(args) > at and method not in ("recv", "recv_anysource"):
            sent = [t.detach() for t in _tensors(args[at])]
            if len(stats.data) < 64:
                stats.data.append(sum(float(t.double().sum()) for t in sent))
            stats.nonzero |= any(bool(t.any()) for t in sent if t.numel())

    # ------------------------------------------------------------------ DDP

    def install_ddp(self, site_of: Callable[[], str]) -> None:
        """Watch DDP's construction: its line (``site_of()``, the watchers' call site) is
        the site of its gradient all-reduce (which runs in C++, out of the harness's sight),
        and the mutant there drops it."""
        from torch.nn.parallel import DistributedDataParallel

        original = DistributedDataParallel.__init__
        injector = self

        def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            mode = injector.mode
            if not mode.record and mode.mutant is None:
                return
            site = site_of()
            if mode.record:
                injector.sites.setdefault(site, SiteStats("DistributedDataParallel", "ddp"))
                injector.sites[site].calls += 1
            m = mode.mutant
            if m is not None and m.kind == MutantKind.NO_GRAD_ALLREDUCE and m.site == site:
                self.register_comm_hook(None, _keep_local)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]

    # ------------------------------------------------------------------ case mutants

    def case_kinds(self, case: object) -> dict[str, MutantKind]:
        """The case-level mutant kind to apply at ``case.build`` or ``case.batch`` this run
        (``{}`` outside a mutant's run); records their sites during a recording run."""
        kinds = {m: self._case_kind(case, m) for m in ("build", "batch")}
        return {m: k for m, k in kinds.items() if k is not None}

    def _case_kind(self, case: object, method: str) -> MutantKind | None:
        mode = self.mode
        if not mode.record and mode.mutant is None:
            return None
        site = case_site(case, method)
        if mode.record:
            stats = self.sites.setdefault(
                site, SiteStats(f"{type(case).__name__}.{method}", f"case-{method}")
            )
            stats.calls += 1
        m = mode.mutant
        return m.kind if m is not None and m.site == site and m.kind in CASE_KINDS else None

    def note_buffers(self, case: object, has_buffers: Callable[[], bool]) -> None:
        """A recording run: whether the model ``case.build`` built has buffers (only then
        has it a ``buffers-broadcast`` mutant)."""
        if self.mode.record:
            stats = self.sites.get(case_site(case, "build"))
            if stats is not None:
                stats.buffers |= has_buffers()


#: this rank process's injector (``harness._rank.intercept`` calls it; rank side only)
INJECTOR = Injector()


def case_site(case: object, method: str) -> str:
    """The site of a case's ``build`` or ``batch``: its ``def`` line."""
    fn = getattr(type(case), method)
    code = fn.__code__
    return f"{code.co_filename}:{code.co_firstlineno} in {fn.__name__}"


def _reduction(method: str, args: tuple[Any, ...]) -> str:
    """``"sum"``, ``"max"``... of a reducing operation (``""`` for any other)."""
    if method not in REDUCING:
        return ""
    import torch.distributed as dist

    opts = next((a for a in args if hasattr(a, "reduceOp")), None)
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    names = ("SUM", "MAX", "MIN", "PRODUCT", "AVG")
    return next((n.lower() for n in names if op == getattr(dist.ReduceOp, n)), "other")


def _keep_local(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: each rank keeps its own gradients."""
    import torch

    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# ---------------------------------------------------------------------- post-wait effects


@dataclass(frozen=True)
class _Call:
    """One mutated operation, as its post-wait effect needs it."""

    injector: Injector
    mutant: Mutant
    method: str
    original: Callable[..., Any]
    pg: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _avg(c: _Call) -> Callable[[], None]:
    size = c.pg.size()

    def divide() -> None:  # gloo has no AVG: SUM, then the division it would have done
        for t in _tensors(c.args[0]):
            t.div_(size) if t.is_floating_point() else t.floor_divide_(size)

    return divide


def _double(c: _Call) -> Callable[[], None]:
    def again() -> None:
        work = c.original(c.pg, *c.args, **c.kwargs)
        if work is not None:
            work.wait()

    return again


def _rotate(c: _Call) -> Callable[[], None]:
    def rotate() -> None:
        import torch

        out, method, args = c.args[0], c.method, c.args
        if method in ("allgather", "alltoall"):
            pieces = out[0] if method == "allgather" else out
            saved = [p.clone() for p in pieces]
            for i, p in enumerate(pieces):
                p.copy_(saved[(i + 1) % len(saved)])
            return
        # one tensor of every rank's pieces along dim 0 (all_gather_into_tensor, all_to_all
        # with split sizes): the pieces in rotated order
        if method in _TRANSPOSES and len(args) > 2 and args[2]:
            sizes = list(args[2])
        else:
            n = c.pg.size()
            sizes = [out.shape[0] // n] * n
        chunks = list(torch.split(out.clone(), sizes))
        out.copy_(torch.cat(chunks[1:] + chunks[:1]))

    return rotate


def _zero(c: _Call) -> Callable[[], None]:
    def zero() -> None:
        for t in _tensors(c.args[0]):
            t.zero_()

    return zero


def _stale(c: _Call) -> Callable[[], None]:
    before = [t.clone() for t in _tensors(c.args[0])]  # what it held: never received

    def stale() -> None:
        previous = c.injector.stale.get(c.mutant.site)
        now = [t.clone() for t in _tensors(c.args[0])]
        for t, old in zip(_tensors(c.args[0]), previous or before):
            if old.shape == t.shape:
                t.copy_(old)
        c.injector.stale[c.mutant.site] = now

    return stale


#: the ProcessGroup methods of ``all_to_all_single``: (output, input, output split sizes,
#: input split sizes, options), torch 2.4-2.12 and 2.13+
_TRANSPOSES = ("alltoall_base", "all_to_all_single")

#: ProcessGroup methods whose data sent is not their first argument (an output comes first)
_INPUT_AT = {
    "allgather": 1,
    "_allgather_base": 1,
    "all_gather_single": 1,
    "allgather_coalesced": 1,
    "allgather_into_tensor_coalesced": 1,
    "all_gather_single_coalesced": 1,
    "alltoall": 1,
    "alltoall_base": 1,
    "all_to_all_single": 1,
    "reduce_scatter": 1,
    "_reduce_scatter_base": 1,
    "reduce_scatter_single": 1,
    "reduce_scatter_tensor_coalesced": 1,
    "reduce_scatter_single_coalesced": 1,
    "gather": 1,
    "gather_single": 1,
    "scatter": 1,
}

_AFTER: dict[MutantKind, Callable[[_Call], Callable[[], None]]] = {
    MutantKind.AVG: _avg,
    MutantKind.DOUBLE: _double,
    MutantKind.ROTATE: _rotate,
    MutantKind.ZERO: _zero,
    MutantKind.STALE: _stale,
}


def _tensors(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return [x] if hasattr(x, "copy_") else []
