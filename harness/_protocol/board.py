"""The ranks' notice board: what each rank of a pool is doing, readable without asking it.

Every rank process of a ``RankPool`` owns one fixed-size slot of a memory-mapped file in the
pool's directory. The rank writes its slot when a run starts, when it reports a phase, when
its main thread enters and leaves a wait on a torch.distributed operation, and when its
function returns; the pool reads every slot whenever it likes. Reading takes no message, no
thread and no CPU time of the rank: a rank that waits, a rank starved of CPU by a loaded
machine and a rank holding the GIL in a long C call are all read the same way, at once.
That is what lets the deadlock rule (``harness._protocol.deadlock``) decide from evidence in a few
hundred milliseconds, and lets a crashed rank's last phase be read after it died.

A slot is guarded by a sequence lock: the writer makes the version odd, writes, makes it even
again; a reader retries until it reads the same even version before and after. One writer
per slot (the rank's main thread), any number of readers.

Pure Python (``mmap`` and ``struct``): no torch, no pytest.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any


class State(IntEnum):
    """What a rank is doing, as its slot says."""

    IDLE = 0  # between runs
    RUNNING = 1  # inside the run's function, not waiting on an operation it issued
    WAITING = 2  # the main thread waits on one operation (Work.wait, a blocking collective)
    RETURNED = 3  # the function returned or raised; the rank waits for the pool


_HEAD = struct.Struct("<Q")  # the version of the sequence lock
#: the slot's fields, in order, with their struct codes
_FIELDS = (
    ("run_id", "q"),
    ("state", "i"),
    ("step", "i"),  # -1: none
    ("started", "d"),
    ("since", "d"),
    ("kind", "i"),
    ("index", "q"),
    ("peer", "i"),  # -1: none
    ("tag", "i"),
    ("numel", "q"),  # -1: not known
    ("bounded", "i"),
    ("members", "Q"),  # bit r set: global rank r is a member of ``group`` (ranks < 64)
    ("group", "64s"),
    ("op", "32s"),
    ("dtype", "16s"),
    ("site", "160s"),
    ("phase", "64s"),
    ("label", "96s"),  # the group as the user made it (harness._protocol.deadlock.Op.label)
)
_BODY = struct.Struct("<" + "".join(code for _, code in _FIELDS))
_AT = {name: i for i, (name, _) in enumerate(_FIELDS)}
_TEXT = [i for i, (_, code) in enumerate(_FIELDS) if code.endswith("s")]
SLOT = 512
assert _HEAD.size + _BODY.size <= SLOT
#: ranks the members bitmap can name; a group with a rank beyond it is left unnamed (0)
MEMBER_BITS = 64


@dataclass(frozen=True)
class Slot:
    """One rank's slot as last written (times are ``time.monotonic()``: one clock for every
    process of the machine)."""

    run_id: int = -1
    state: State = State.IDLE
    step: int | None = None
    started: float = 0.0  # when the rank began the run
    since: float = 0.0  # when the state last changed (the current wait began)
    kind: int = (
        0  # 0 none, else a harness._protocol.deadlock.Kind (of the last wait, once it ended)
    )
    index: int = 0  # the collective's number on its group this run, or the n-th send/recv
    peer: int | None = None  # global rank of a send's or receive's peer (deadlock.ANY_SOURCE)
    tag: int = 0
    numel: int | None = None  # elements of the operation's tensor(s), where one count is known
    bounded: bool = False  # the wait has a timeout of its own: it will end by itself
    members: tuple[int, ...] = ()  # the global ranks of ``group`` (empty: not known)
    group: str = ""
    op: str = ""  # e.g. "all_reduce", "broadcast", "send"
    dtype: str = ""
    site: str = ""  # "model.py:41 in halo": where the user's code issued the operation
    phase: str = ""  # the last phase the rank reported ("step 0 forward")
    label: str = ""  # the group as the user made it: "the group of ranks [0, 1] (...)"

    @property
    def waiting(self) -> bool:
        return self.state == State.WAITING


def members_bits(ranks: tuple[int, ...]) -> int:
    """``(0, 2) -> 0b101``; ``0`` when a rank does not fit."""
    if any(not 0 <= r < MEMBER_BITS for r in ranks):
        return 0
    return sum(1 << r for r in ranks)


def _members(bits: int) -> tuple[int, ...]:
    return tuple(r for r in range(MEMBER_BITS) if bits >> r & 1)


class Board:
    """The memory-mapped slots of every rank of one pool (``path`` holds ``ranks`` slots)."""

    def __init__(self, path: str, ranks: int, *, create: bool = False) -> None:
        self.path, self.ranks = path, ranks
        size = SLOT * ranks
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def read(self, rank: int) -> Slot:
        """The slot of ``rank``, consistent (never half of one write and half of another)."""
        off = rank * SLOT
        for _ in range(10_000):
            (v1,) = _HEAD.unpack_from(self._map, off)
            if v1 % 2 == 0:
                raw = _BODY.unpack_from(self._map, off + _HEAD.size)
                (v2,) = _HEAD.unpack_from(self._map, off)
                if v1 == v2:
                    return _slot(raw) if v1 else Slot()
            time.sleep(0)  # the writer is mid-write: let it finish
        return Slot()  # a writer that died mid-write: nothing known

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass


def _slot(raw: tuple[Any, ...]) -> Slot:
    f = dict(zip((name for name, _ in _FIELDS), raw))
    return Slot(
        run_id=f["run_id"],
        state=State(f["state"]),
        step=None if f["step"] < 0 else f["step"],
        started=f["started"],
        since=f["since"],
        kind=f["kind"],
        index=f["index"],
        peer=None if f["peer"] == -1 else f["peer"],
        tag=f["tag"],
        numel=None if f["numel"] < 0 else f["numel"],
        bounded=bool(f["bounded"]),
        members=_members(f["members"]),
        group=_text(f["group"]),
        op=_text(f["op"]),
        dtype=_text(f["dtype"]),
        site=_text(f["site"]),
        phase=_text(f["phase"]),
        label=_text(f["label"]),
    )


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class Writer:
    """A rank's pen on its own slot. Cheap: one ``struct.pack_into`` per change (a wait on a
    collective costs two of them, ~2 µs)."""

    def __init__(self, board: Board, rank: int) -> None:
        self._map, self._off = board._map, rank * SLOT
        (self._version,) = _HEAD.unpack_from(self._map, self._off)
        self._version += self._version % 2
        self._fields: list[Any] = [0, 0, -1, 0.0, 0.0, 0, 0, -1, 0, -1, 0, 0] + [b""] * 6

    @property
    def since(self) -> float:
        """When the slot's state last changed (monotonic seconds)."""
        return float(self._fields[_AT["since"]])

    def begin(self, run_id: int, now: float) -> None:
        self._fields[:12] = [run_id, int(State.RUNNING), -1, now, now, 0, 0, -1, 0, -1, 0, 0]
        for i in _TEXT:
            self._fields[i] = b""
        self._flush()

    def phase(self, phase: str, step: int | None) -> None:
        self._fields[_AT["step"]] = -1 if step is None else step
        self._fields[_AT["phase"]] = phase.encode("utf-8", "replace")
        self._flush()

    def enter(
        self,
        now: float,
        *,
        kind: int,
        index: int,
        peer: int | None,
        tag: int,
        numel: int | None,
        bounded: bool,
        members: int,
        group: str,
        op: str,
        dtype: str,
        site: str,
        label: str = "",
    ) -> None:
        """The main thread begins to wait on an operation."""
        f = self._fields
        f[1:2] = [int(State.WAITING)]
        f[4:12] = [
            now,
            kind,
            index,
            -1 if peer is None else peer,
            tag,
            -1 if numel is None else numel,
            int(bounded),
            members,
        ]
        f[12:16] = [s.encode("utf-8", "replace") for s in (group, op, dtype, site)]
        f[_AT["label"]] = label.encode("utf-8", "replace")
        self._flush()

    def leave(self, now: float, state: State = State.RUNNING) -> None:
        """The wait is over (or the run: ``State.RETURNED``, ``State.IDLE``). The operation's
        fields stay: the last operation this rank waited on this run, which a crash report
        compares with the collective a dead peer was waiting in."""
        self._fields[1], self._fields[4] = int(state), now
        self._flush()

    def _flush(self) -> None:
        self._version += 1
        _HEAD.pack_into(self._map, self._off, self._version)  # odd: being written
        _BODY.pack_into(self._map, self._off + _HEAD.size, *self._fields)
        self._version += 1
        _HEAD.pack_into(self._map, self._off, self._version)  # even: consistent again
