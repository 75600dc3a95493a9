"""What the harness sees of a rank's torch.distributed operations, without changing any.

Installed once in every rank process of a pool. It wraps methods of torch's
``ProcessGroup`` and ``Work`` classes: every operation issued from Python passes through
them, whichever function issued it (``dist.all_reduce``, ``dist.isend`` inside
``batch_isend_irecv``, ``torch.distributed.nn``, a function bound at import as
``from torch.distributed import isend``). The public functions of ``torch.distributed`` are
never replaced, so identity checks on them (``P2POp`` takes only ``dist.isend`` and
``dist.irecv`` themselves; ``batch_isend_irecv`` and torch.compile look functions up by
identity) see torch's own. Each wrapper calls the original with the same arguments and
returns what it returned; what it notes never raises into the caller.

What it notes, during a run only:

- for each operation: what it is (collective, send, receive), its group, its number in the
  run's order on that group, its size, and the line of user code that issued it; the
  ``Work`` it returned, until someone waits on it;
- on the rank's slot of the pool's notice board (``harness._protocol.board``): which operation the
  main thread waits on, from when; so the pool can prove a deadlock without asking the rank;
- per group: collectives issued (torch's sequence number, which also counts what C++ issues,
  such as DDP's reducer, less the point-to-point operations seen here), sends and receives
  per (peer, tag).

Operations issued from C++ (DDP's reducer, functional collectives, DTensor) are not seen one
by one; they show in the sequence numbers. Written for torch 2.4-2.14 (the method names of
``ProcessGroup``; a name a release drops is skipped).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from harness._base.compat import group_name, group_sequence_numbers, sequence_number
from harness._base.frames import PACKAGE, plumbing, standard_library, user_site
from harness._mutation.catalogue import MutantKind
from harness._mutation.inject import INJECTOR
from harness._mutation.mode import OFF, MutantMode
from harness._protocol.board import State, Writer, members_bits
from harness._protocol.deadlock import ANY_SOURCE, Counts, Kind, Op
from harness._rank import groups as group_labels

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

#: ProcessGroup method -> (the torch.distributed name users know, kind, which argument holds
#: the tensors whose size must match across ranks: an index into the positional arguments).
#: Every method a public collective, point-to-point or object function of torch 2.4-2.14
#: reaches (``tests/unit/test_intercept_coverage.py`` enumerates them on the installed torch
#: and fails on one missing here); a name a release lacks is skipped at install. torch 2.13
#: routes ``all_to_all_single``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
#: through the ``*_single`` methods, earlier releases through ``alltoall_base``,
#: ``_allgather_base`` and ``_reduce_scatter_base``.
_METHODS: dict[str, tuple[str, Kind, int | None]] = {
    "allreduce": ("all_reduce", Kind.COLLECTIVE, 0),
    "allreduce_coalesced": ("all_reduce_coalesced", Kind.COLLECTIVE, 0),
    "broadcast": ("broadcast", Kind.COLLECTIVE, 0),
    "reduce": ("reduce", Kind.COLLECTIVE, 0),
    "allgather": ("all_gather", Kind.COLLECTIVE, 1),
    "_allgather_base": ("all_gather_into_tensor", Kind.COLLECTIVE, 1),
    "all_gather_single": ("all_gather_into_tensor", Kind.COLLECTIVE, 1),
    "allgather_coalesced": ("all_gather_coalesced", Kind.COLLECTIVE, None),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", Kind.COLLECTIVE, None),
    "all_gather_single_coalesced": ("all_gather_into_tensor_coalesced", Kind.COLLECTIVE, None),
    "gather": ("gather", Kind.COLLECTIVE, None),
    "gather_single": ("gather_single", Kind.COLLECTIVE, None),  # torch 2.14
    "scatter": ("scatter", Kind.COLLECTIVE, None),
    "reduce_scatter": ("reduce_scatter", Kind.COLLECTIVE, 0),
    "_reduce_scatter_base": ("reduce_scatter_tensor", Kind.COLLECTIVE, 0),
    "reduce_scatter_single": ("reduce_scatter_tensor", Kind.COLLECTIVE, 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", Kind.COLLECTIVE, None),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor_coalesced", Kind.COLLECTIVE, None),
    "alltoall_base": ("all_to_all_single", Kind.COLLECTIVE, 1),
    "all_to_all_single": ("all_to_all_single", Kind.COLLECTIVE, 1),
    "alltoall": ("all_to_all", Kind.COLLECTIVE, None),
    "barrier": ("barrier", Kind.COLLECTIVE, None),
    "monitored_barrier": ("monitored_barrier", Kind.COLLECTIVE, None),
    "send": ("send", Kind.SEND, 0),
    "recv": ("recv", Kind.RECV, 0),
    "recv_anysource": ("recv", Kind.RECV, 0),
}

#: methods that do their whole operation inside the call and return no work to wait on
#: (gloo's ``monitored_barrier``): the call itself is the wait the board shows
_BLOCKING = frozenset({"monitored_barrier"})

#: torch.distributed functions whose name says better than the method's what the user called
_PUBLIC = frozenset(
    {
        "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
        "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "gather",
        "gather_single", "gather_into_tensor",
        "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
        "all_to_all_single", "all_to_all", "barrier", "monitored_barrier", "send", "recv",
        "isend", "irecv", "broadcast_object_list", "all_gather_object", "gather_object",
        "scatter_object_list", "send_object_list", "recv_object_list",
    }
)  # fmt: skip

#: public functions that only forward to another public one (torch 2.13 deprecates the
#: ``*_into_tensor`` / ``*_tensor`` names for ``*_single``; a blocking ``send`` is an
#: ``isend`` waited on): the name the user wrote is the outer one
_FORWARDS: dict[str, tuple[str, ...]] = {
    "all_gather_single": ("all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter_single": ("reduce_scatter_tensor", "_reduce_scatter_base"),
    "gather_single": ("gather_into_tensor",),  # torch 2.14
    "isend": ("send",),
    "irecv": ("recv",),
}

#: Work methods through which a caller learns that the operation finished, or hands its
#: completion on (a future): after any of them the work is not "never waited on".
_CLAIMS = ("get_future", "result", "synchronize", "get_future_result", "block_current_stream")

#: distributed_c10d.py, whose functions call ProcessGroup's methods (set at install)
_C10D = "\0"
#: torch's package directory (set at install): its frames are never the user's call site
_TORCH = "\0"
#: the watchers' own files: never a call site, not even of the harness's own operations
_OWN = frozenset(
    os.path.join(PACKAGE, *name)
    for name in (("_rank", "intercept.py"), ("mutation", "inject.py"), ("_compat.py",))
)


@dataclass
class Issued:
    """An operation whose work nobody has waited on yet."""

    work: Work
    op: Op
    claimed: bool = False


@dataclass
class Tracker:
    """One rank's record of the operations of the current run (see the module docstring)."""

    board: Writer | None = None
    active: bool = False
    reliable: bool = True  # False once noting failed: then no proof may rest on this rank
    base: dict[str, int] = field(default_factory=dict)  # sequence numbers at the run's start
    p2p: Counter[str] = field(default_factory=Counter)
    seen: Counter[str] = field(default_factory=Counter)  # collectives issued from Python
    sends: Counter[tuple[str, int, int]] = field(default_factory=Counter)
    recvs: Counter[tuple[str, int, int]] = field(default_factory=Counter)
    issued: dict[tuple[str, int], Op] = field(default_factory=dict)  # recent collectives
    live: dict[int, Issued] = field(default_factory=dict)  # id(work) -> not yet waited on
    groups: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    members: dict[str, int] = field(default_factory=dict)  # group -> board.members_bits
    #: group -> its name in messages: ranks and the call that made it (``_rank.groups``)
    labels: dict[str, str] = field(default_factory=dict)
    #: floating dtypes that went through an operation: dtype -> the first ("an all_reduce at
    #: model.py:42"), what a precision hint needs as evidence (``RunRecord.dtypes``)
    dtypes: dict[str, str] = field(default_factory=dict)
    _sites: dict[tuple[CodeType, int], str] = field(default_factory=dict)

    # ------------------------------------------------------------------ a run

    def begin(self, mutation: MutantMode = OFF) -> None:
        """A run starts (in ``mutation``'s mode: the injector's, ``harness._mutation.inject``)."""
        self.p2p.clear()
        self.seen.clear()
        self.sends.clear()
        self.recvs.clear()
        self.issued.clear()
        self.live.clear()
        self.groups.clear()
        self.members.clear()
        self.labels.clear()
        self.dtypes.clear()
        self.reliable = True
        self.base = {name: seq for name, (seq, _) in group_sequence_numbers().items()}
        INJECTOR.begin(mutation)
        self.active = True

    def end(self) -> None:
        self.active = False
        INJECTOR.end()

    def counts(self) -> Counts | None:
        """This run's counts now (``None`` if they cannot be trusted or read)."""
        if not self.reliable:
            return None
        try:
            seqs = group_sequence_numbers()
            return Counts(
                collectives={
                    name: seq - self.base.get(name, 0) - self.p2p[name]
                    for name, (seq, _) in seqs.items()
                },
                sends=dict(self.sends),
                recvs=dict(self.recvs),
                issued=dict(self.issued),
            )
        except RuntimeError:  # a dict changed size under us (asked from another thread)
            return None

    def unseen(self, counts: Counts | None) -> int:
        """Collectives torch counted that the harness did not see issued (from C++: DDP's
        reducer, functional collectives); ``-1`` when the counts are not known."""
        if counts is None:
            return -1
        return sum(max(0, n - self.seen[g]) for g, n in counts.collectives.items())

    def leftovers(self) -> list[Op]:
        """Operations whose work has not completed."""
        return [i.op for i in list(self.live.values()) if not _completed(i.work)]

    def unwaited(self) -> list[Op]:
        """Operations whose work nobody waited on (``async_op=True`` and never ``wait()``)."""
        return [i.op for i in list(self.live.values()) if not i.claimed]

    def settle(self, grace: float) -> list[Op]:
        """Wait up to ``grace`` seconds for the leftovers to complete; those still not.

        By waiting on them: gloo marks a send or receive complete only inside ``wait()``,
        so polling ``is_completed()`` would wait for ever for an isend its peer received.
        """
        import datetime

        deadline = time.monotonic() + grace
        left = []
        for issued in list(self.live.values()):
            if _completed(issued.work):
                continue
            seconds = max(0.001, deadline - time.monotonic())
            try:
                _ORIGINAL_WAIT(issued.work, datetime.timedelta(seconds=seconds))
            except Exception:  # noqa: BLE001 - timed out (or failed): report it
                if not _completed(issued.work):
                    left.append(issued.op)
        return left

    # ------------------------------------------------------------------ noting

    def note(
        self,
        pg: ProcessGroup,
        method: str,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        work: Work | None,
        name: str = "",
    ) -> Op | None:
        try:
            return self._note(pg, method, args, kwargs, work, name)
        except Exception:  # noqa: BLE001 - never break the caller; distrust the counts
            self.reliable = False
            return None

    def _note(
        self,
        pg: ProcessGroup,
        method: str,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        work: Work | None,
        caller: str,
    ) -> Op:
        name, kind, sized = _METHODS[method]
        if caller in _PUBLIC:
            name = caller
        group, members = self._group(pg)
        numel, dtype = _size(args[sized] if sized is not None and len(args) > sized else None)
        site = self._site()
        seen = dtype or _size(args[:2])[1]  # an operation with no sized argument: its tensors
        if seen not in self.dtypes and seen.startswith(_FLOATING):
            article = "an" if name[0] in "aeiou" else "a"
            self.dtypes[seen] = f"{article} {name} at {_user_site() or site} ran in {seen}"
        if INJECTOR.mode.record:
            INJECTOR.record(site, method, name, members, args)
        if kind == Kind.COLLECTIVE:
            index = sequence_number(pg) - self.base.get(group, 0) - self.p2p[group]
            if method in _BLOCKING:
                index += 1  # noted before the call: torch has not counted it yet
            label = self.labels.get(group, "")
            op = Op(kind, group, name, index, numel=numel, dtype=dtype, site=site, label=label)
            self.issued[(group, index)] = op
            self.seen[group] += 1
            self.issued.pop((group, index - 64), None)  # recent ones only
        else:
            self.p2p[group] += 1
            if method == "recv_anysource":
                peer = ANY_SOURCE
                tag = _arg(args, kwargs, 1, "tag", 0)
            else:
                local = _arg(args, kwargs, 1, "dstRank" if kind == Kind.SEND else "srcRank", 0)
                peer = members[local] if 0 <= local < len(members) else local
                tag = _arg(args, kwargs, 2, "tag", 0)
            counter = self.sends if kind == Kind.SEND else self.recvs
            counter[(group, peer, tag)] += 1
            index = counter[(group, peer, tag)]
            op = Op(
                kind, group, name, index, peer, tag, numel, dtype, site, self.labels.get(group, "")
            )
        if work is not None:
            if len(self.live) > 512:  # keep only what may still matter
                self.live = {
                    k: i for k, i in self.live.items() if not (i.claimed and _completed(i.work))
                }
            self.live[id(work)] = Issued(work, op)
        return op

    def blocking(self, pg: ProcessGroup, op: Op, before: int) -> None:
        """A blocking method returned: it counts as one collective on its group, however
        many operations torch counted for it (gloo's ``monitored_barrier`` is a send and a
        receive per rank, from C++: two on a member, 2 (n - 1) on the group's first)."""
        self.p2p[op.group] += max(0, sequence_number(pg) - before - 1)

    def _group(self, pg: ProcessGroup) -> tuple[str, tuple[int, ...]]:
        known = self.groups.get(id(pg))
        if known is None:
            import torch.distributed as dist

            known = (group_name(pg), tuple(dist.get_process_group_ranks(pg)))
            self.groups[id(pg)] = known
            self.members[known[0]] = members_bits(known[1])
            world = pg is dist.group.WORLD
            self.labels[known[0]] = group_labels.label(known[0], known[1], world)
        return known

    def _site(self) -> str:
        """``"/path/model.py:41 in halo"``: the innermost frame outside torch, the standard
        library and the harness's plumbing (``harness._base.frames``); for an operation the
        harness itself issues, the innermost frame outside torch and this module. Cached per
        code object and line: a frame walk is the cost, ~2 µs."""
        frame = sys._getframe(1)
        first = None
        while frame is not None:
            path = frame.f_code.co_filename
            if standard_library(path):
                if first is not None:
                    break  # past the harness's own code: where multiprocessing started it
            elif not path.startswith(_TORCH):
                if not plumbing(path):
                    return self._text(frame)
                if first is None and path not in _OWN:
                    first = frame
            frame = frame.f_back  # type: ignore[assignment]
        return "" if first is None else self._text(first)

    def _text(self, frame: FrameType) -> str:
        key = (frame.f_code, frame.f_lineno)
        text = self._sites.get(key)
        if text is None:
            text = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            self._sites[key] = text
        return text

    # ------------------------------------------------------------------ waiting

    def waiting(self, work: Work, bounded: bool) -> Issued | None:
        issued = self.live.get(id(work)) if self.active else None
        if issued is None:
            return None
        issued.claimed = True
        self.enter(issued.op, bounded)
        return issued

    def enter(self, op: Op, bounded: bool) -> None:
        """The main thread begins to wait on ``op``: say so on the board."""
        if self.board is not None:
            self.board.enter(
                time.monotonic(),
                kind=int(op.kind),
                index=op.index,
                peer=op.peer,
                tag=op.tag,
                numel=op.numel,
                bounded=bounded,
                members=self.members.get(op.group, 0),
                group=op.group,
                op=op.op,
                dtype=op.dtype,
                site=op.site,
                label=op.label,
            )

    def waited(self, issued: Issued, ok: bool) -> None:
        """Its wait is over: a wait that returned completed the work, whatever the work's
        ``is_completed()`` says afterwards (some works, such as gloo's emulated
        reduce_scatter on torch 2.14, never report it)."""
        if self.board is not None:
            self.board.leave(time.monotonic(), State.RUNNING)
        if ok or _completed(issued.work):
            self.live.pop(id(issued.work), None)

    def claim(self, work: Work) -> None:
        issued = self.live.get(id(work)) if self.active else None
        if issued is not None:
            issued.claimed = True


#: dtype names (as ``_size`` gives them) whose values carry rounding: floating and complex
_FLOATING = ("float", "complex", "bfloat")


def _user_site() -> str:
    """``"model.py:42"``: the innermost frame of model code (so a model's own line, not
    ``collectives.py`` under it), else of the harness's library; never beyond where the
    harness started the user's code (``harness._base.frames.user_site``). Walked only when a
    dtype is first seen in a run."""
    model, library = user_site(sys._getframe(1), skip=(_TORCH,))
    return model or library


def _completed(work: Work) -> bool:
    try:
        return bool(_ORIGINAL_IS_COMPLETED(work))
    except Exception:  # noqa: BLE001 - a failed work is not in flight
        return True


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: int) -> int:
    value = args[pos] if len(args) > pos else kwargs.get(name, default)
    return int(value)


def _size(tensors: Any) -> tuple[int | None, str]:
    """Elements and dtype of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, (list, tuple)):
        flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
    else:
        flat = [tensors]
    flat = [t for t in flat if hasattr(t, "numel")]
    if not flat:
        return None, ""
    return sum(int(t.numel()) for t in flat), str(flat[0].dtype).replace("torch.", "")


# ---------------------------------------------------------------------- installing


def torch_dir() -> str:
    """torch's package directory, with a trailing separator (after ``install``)."""
    return _TORCH


TRACKER = Tracker()


def _not_installed(*_: object) -> bool:
    raise RuntimeError("harness._rank.intercept.install() has not run")


#: ``Work``'s own methods (after ``install``), for the watcher's waits that must not count
#: as the caller's; before it, a call raises, which both callers take as "not waiting"
_ORIGINAL_IS_COMPLETED: Callable[..., bool] = _not_installed
_ORIGINAL_WAIT: Callable[..., bool] = _not_installed
_INSTALLED = threading.Lock()
_DONE = False


def install() -> Tracker:
    """Wrap ``ProcessGroup``'s operations and ``Work``'s waits (once per process)."""
    global _ORIGINAL_IS_COMPLETED, _ORIGINAL_WAIT, _DONE, _TORCH, _C10D
    with _INSTALLED:
        if _DONE:
            return TRACKER
        import torch
        from torch.distributed import ProcessGroup, Work, distributed_c10d

        _TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
        _C10D = distributed_c10d.__file__

        for method in _METHODS:
            original = ProcessGroup.__dict__.get(method)
            if original is not None:
                setattr(ProcessGroup, method, _operation(method, original))
        _ORIGINAL_IS_COMPLETED, _ORIGINAL_WAIT = Work.is_completed, Work.wait
        Work.wait = _wait(Work.wait)  # type: ignore[method-assign]
        Work.is_completed = _is_completed(Work.is_completed)  # type: ignore[method-assign,assignment]
        for method in _CLAIMS:
            original = Work.__dict__.get(method)
            if original is not None:
                setattr(Work, method, _claim(original))
        INJECTOR.install_ddp(TRACKER._site)
        group_labels.watch_creation(ProcessGroup)
        _DONE = True
    return TRACKER


_F = TypeVar("_F", bound=Callable[..., object])
#: a ``ProcessGroup`` method: it returns the operation's ``Work`` (``None``: blocking)
_Operation = Callable[..., "Work | None"]


def _operation(method: str, original: _Operation) -> _Operation:
    if method in _BLOCKING:
        return _blocking(method, original)

    def operation(pg: ProcessGroup, *args: object, **kwargs: object) -> Work | None:
        mutant = INJECTOR.mode.mutant
        if mutant is not None and TRACKER.active and TRACKER._site() == mutant.site:
            work, used = INJECTOR.perform(mutant, method, original, pg, args, kwargs)
            if used is not None:
                TRACKER.note(used, method, args, kwargs, work, _caller())
            return cast("Work | None", work)
        work = original(pg, *args, **kwargs)
        if TRACKER.active:
            TRACKER.note(pg, method, args, kwargs, work, _caller())
        return work

    return _like(operation, original)


def _blocking(method: str, original: _Operation) -> _Operation:
    """A method that waits inside the call (``monitored_barrier``): noted before it, on the
    board while it runs, counted as one collective after. Its only mutant is ``skip``."""

    def operation(pg: ProcessGroup, *args: object, **kwargs: object) -> Work | None:
        if not TRACKER.active:
            return original(pg, *args, **kwargs)
        mutant = INJECTOR.mode.mutant
        if mutant is not None and mutant.kind == MutantKind.SKIP and TRACKER._site() == mutant.site:
            return None
        before = sequence_number(pg)
        op = TRACKER.note(pg, method, args, kwargs, None, _caller())
        if op is not None:
            TRACKER.enter(op, bounded=False)
        try:
            return original(pg, *args, **kwargs)
        finally:
            if TRACKER.board is not None:
                TRACKER.board.leave(time.monotonic(), State.RUNNING)
            if op is not None:
                TRACKER.blocking(pg, op, before)

    return _like(operation, original)


def _caller() -> str:
    """The torch.distributed function that called the watcher (two frames up), as the user
    wrote it: ``isend`` rather than ``send``, ``all_gather_into_tensor`` rather than the
    ``all_gather_single`` torch 2.13 forwards it to; ``""`` if not called from there."""
    here: FrameType = sys._getframe(2)
    code = here.f_code
    if code.co_filename != _C10D:
        return ""
    name = str(code.co_name)
    outer = _FORWARDS.get(name, ())
    frame = here.f_back if outer else None
    for _ in range(4):  # through a deprecation wrapper or two
        if frame is None:
            break
        if frame.f_code.co_filename == _C10D and frame.f_code.co_name in outer:
            return outer[0]  # the public name, also for the private alias
        frame = frame.f_back
    return name


def _wait(original: Callable[..., bool]) -> Callable[..., bool]:
    def wait(work: Work, *args: object, **kwargs: object) -> bool:
        timeout = args[0] if args else kwargs.get("timeout")
        issued = TRACKER.waiting(work, bounded=bool(timeout)) if TRACKER.active else None
        if issued is None:
            done = original(work, *args, **kwargs)
        else:
            try:
                done = original(work, *args, **kwargs)
            except BaseException:
                TRACKER.waited(issued, ok=False)
                raise
            TRACKER.waited(issued, ok=True)
        if INJECTOR.after:
            INJECTOR.run_after(work)
        return done

    return _like(wait, original)


def _is_completed(original: Callable[[Work], bool]) -> Callable[[Work], bool]:
    def is_completed(work: Work) -> bool:
        done = bool(original(work))
        if done and TRACKER.active:
            TRACKER.claim(work)  # the caller saw it complete: that is a wait
            if INJECTOR.after:
                INJECTOR.run_after(work)
        return done

    return _like(is_completed, original)


def _claim(original: Callable[..., object]) -> Callable[..., object]:
    def claimed(work: Work, *args: object, **kwargs: object) -> object:
        if TRACKER.active:
            TRACKER.claim(work)
        return original(work, *args, **kwargs)

    return _like(claimed, original)


def _like(wrapper: _F, original: Callable[..., object]) -> _F:
    """``wrapper`` wearing ``original``'s name and doc (``help()`` and tracebacks read as
    torch's), with ``__wrapped__`` pointing at it."""
    return cast(_F, functools.wraps(original)(wrapper))
