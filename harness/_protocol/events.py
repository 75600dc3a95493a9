"""The messages between a pool and its ranks: one small dataclass per event.

Each travels pickled over a pipe and is handled by the receiver's ``on_<name>`` method
(``on_done`` for ``Done``), as pytest-xdist's controller turns worker events into calls.

    pool -> rank:   RunCall, Fence, Release, Stop
    rank -> pool:   Ready, Done, Fenced, Released
    pool -> probe:  Probe          probe -> pool: Probed

A run: ``RunCall`` -> ``Done``. Once every rank is done, the pool decides from the ranks'
``Report``s whether the process groups are clean: leftovers that can never complete fail the
run at once; matched ones get a ``Fence`` (wait for them) -> ``Fenced``; then ``Release``
(keep the groups, proving them with one collective, or tear them down) -> ``Released``.

Pure data: no torch, no pytest.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from harness._mutation.catalogue import SiteStats
from harness._mutation.mode import OFF, MutantMode
from harness._protocol.deadlock import Counts, Op


@dataclass(frozen=True)
class Report:
    """What a rank did on its process groups during a run, as it returned."""

    counts: Counts | None  # None: not to be trusted (noting an operation failed)
    groups: dict[str, tuple[int, ...]]  # every group it belongs to -> its global ranks
    leftovers: list[Op] = field(default_factory=list)  # issued, not completed
    #: collectives torch counted that were not seen one by one (issued from C++); -1: unknown
    unseen: int = -1
    #: a recording run (--spatial-mutants): every call site reached, with what was seen there
    sites: dict[str, SiteStats] = field(default_factory=dict)
    unwaited: list[Op] = field(default_factory=list)  # issued, never waited on


# ---------------------------------------------------------------------- pool -> rank


@dataclass(frozen=True)
class RunCall:
    run_id: int
    payload: bytes
    store: str
    sys_path: list[str]
    timeout: float
    reuse: bool
    mutation: MutantMode = OFF  # --spatial-mutants: record the call sites, or inject a mutant


@dataclass(frozen=True)
class Fence:
    """Every rank returned and their leftovers are matched: wait up to ``grace`` seconds
    for them to complete, then say what has not."""

    run_id: int
    grace: float


@dataclass(frozen=True)
class Release:
    run_id: int
    keep: bool
    verify: bool


@dataclass(frozen=True)
class Stop:
    pass


# ---------------------------------------------------------------------- rank -> pool


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Done:
    run_id: int
    ok: bool
    result: bytes = b""
    summary: str = ""
    detail: str = ""
    phase: str | None = None
    report: Report | None = None


@dataclass(frozen=True)
class Fenced:
    run_id: int
    pending: list[Op]


@dataclass(frozen=True)
class Released:
    run_id: int
    ok: bool
    detail: str


# ---------------------------------------------------------------------- probes


@dataclass(frozen=True)
class Probe:
    n: int


@dataclass(frozen=True)
class Probed:
    """A rank's probe thread, on where its main thread is (for ranks the board shows as
    running, or waiting long): the innermost frame, whether it is inside torch, the process's
    CPU time, when its slot last changed, and its counts then."""

    n: int
    where: str
    in_torch: bool
    cpu: float
    since: float
    counts: Counts | None
    groups: dict[str, tuple[int, ...]]


def send(conn: Connection, event: object) -> None:
    """Send one event over a pool pipe."""
    conn.send_bytes(pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL))


def send_all(conns: Iterable[Connection], event: object) -> None:
    """Send one event to several pipes, pickled once (a run's call goes to every rank). A
    closed pipe, a rank that died, is passed over: its process sentinel tells the pool."""
    data = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
    for conn in conns:
        try:
            conn.send_bytes(data)
        except OSError:
            pass


def receive(conn: Connection) -> Any:
    """The next event from a pool pipe (loosely typed: whatever was pickled; callers know which)."""
    return pickle.loads(conn.recv_bytes())


def handler_name(event: object) -> str:
    """``Done`` -> ``"on_done"``; ``RunCall`` -> ``"on_runcall"``."""
    return f"on_{type(event).__name__.lower()}"
