"""The rank processes of one start of a pool, as the parent sees them.

Starting them (with ``__main__`` hidden from multiprocessing), waiting for them for as long
as they make progress (``ProgressWatch``, read from ``/proc``), what they write to the pool's
directory (``RankLogs``: output, crash traces, the stacks of a hang) and their memory
(``rank_memory``). ``harness.pool`` owns their life; the ranks themselves run
``harness._rank.loop``.

Imports neither torch nor pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
import types
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from harness._base.frames import plumbing
from harness._protocol.board import Board
from harness._protocol.events import Ready, Stop, receive, send
from harness._rank.loop import worker_main
from harness.errors import RankCrash, RankProblem


class Processes:
    """The rank processes of one start of a pool, as a ``Run`` sees them (``_watch.Ranks``):
    their pipes, sentinels, probe pipes, board and logs, and a way to kill them all."""

    def __init__(self, world_size: int, workdir: str) -> None:
        self.world_size, self.workdir = world_size, workdir
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.probes: list[Connection] = []
        self.board = Board(os.path.join(workdir, "board"), world_size, create=True)
        self.logs = RankLogs(workdir)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def spawn(
        self,
        ctx: Any,
        parent_pid: int,
        backend: str,
        preload: tuple[str, ...],
        cpus: Sequence[int | None] = (),
    ) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            probe_end, probe_child = ctx.Pipe(duplex=True)  # answered by a rank's own thread
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.world_size, child_end, self.workdir, parent_pid, backend),
                kwargs={
                    "probe": probe_child,
                    "preload": preload,
                    "cpu": cpus[rank] if cpus else None,
                },
                name=f"harness-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            probe_child.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
            self.probes.append(probe_end)

    def await_ready(self, watch: ProgressWatch) -> None:
        """Wait for every rank's ``Ready``, for as long as the starting ranks make progress."""
        starting = set(range(self.world_size))
        while starting:
            by_waitable = {}
            for r in starting:
                by_waitable[self.conns[r]] = by_waitable[self.procs[r].sentinel] = r
            ready = wait(list(by_waitable), timeout=0.5)
            for r in sorted({by_waitable[w] for w in ready}):
                if r not in starting:
                    continue
                ok = False
                if self.conns[r] in ready:
                    with contextlib.suppress(EOFError, OSError):
                        ok = isinstance(receive(self.conns[r]), Ready)
                if not ok:
                    self._failed_to_start(r, "process exited")
                starting.discard(r)
            if starting and watch.stalled([self.procs[r].pid for r in starting]):
                self._failed_to_start(min(starting), watch.why())

    def _failed_to_start(self, rank: int, why: str) -> NoReturn:
        output = self.read_log(rank, 0)
        self.kill()
        raise RankCrash(
            f"rank {rank}/{self.world_size} failed to start ({why}); its output follows. "
            "Check that torch imports in a fresh interpreter.",
            self.world_size,
            [RankProblem(rank, "crash", "failed to start", output)],
        )

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                send(conn, Stop())
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self.procs:
            proc.join(5.0)
            with contextlib.suppress(ValueError):
                proc.close()
        for conn in [*self.conns, *self.probes]:
            with contextlib.suppress(OSError):
                conn.close()
        self.procs, self.conns, self.probes = [], [], []
        self.board.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # what a Run reads
    def log_size(self, rank: int, what: str = "out") -> int:
        return self.logs.size(rank, what)

    def read_log(self, rank: int, offset: int, what: str = "out") -> str:
        return self.logs.read(rank, offset, what)

    def crash_log(self, rank: int) -> str:
        return self.logs.crash(rank)

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        return self.logs.stacks({r: self.procs[r].pid for r in ranks if r < len(self.procs)})


class ProgressWatch:
    """Whether processes still get anywhere: a wait that lasts as long as they do.

    A process makes progress while its CPU time grows, or while it is runnable or in disk
    I/O (Linux ``/proc/PID/stat``): a loaded machine slows it down, it does not stop it.
    ``stalled`` says when none of the watched processes has made progress for ``stall``
    seconds. Where the OS does not say (no ``/proc``), ``stalled`` is a plain deadline of
    ``fallback`` seconds from the first call.
    """

    def __init__(self, stall: float, *, fallback: float) -> None:
        self.stall, self.fallback = stall, fallback
        self.ticks: dict[int, int] = {}
        self.started = self.moved = time.monotonic()
        self.known = False

    def stalled(self, pids: Sequence[int]) -> bool:
        now = time.monotonic()
        for pid in pids:
            sample = process_progress(pid)
            if sample is None:
                continue
            self.known = True
            state, ticks = sample
            if state in "RD" or self.ticks.get(pid) != ticks:
                self.moved = now
            self.ticks[pid] = ticks
        if not self.known:
            return now - self.started > self.fallback
        return now - self.moved > self.stall

    def why(self) -> str:
        if not self.known:
            return f"not started after {self.fallback:g}s"
        return f"no progress for {self.stall:g}s: no CPU time used, neither runnable nor in I/O"


def process_progress(pid: int) -> tuple[str, int] | None:
    """``(state, CPU clock ticks used)`` of ``pid`` from ``/proc``; ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state; utime + stime
    except (OSError, IndexError, ValueError):
        return None


class RankLogs:
    """What the ranks of a pool write to its directory: output, crash traces, stacks."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    def path(self, rank: int, what: str = "out") -> str:
        return os.path.join(self.workdir, f"rank{rank}.{what}")

    def size(self, rank: int, what: str = "out") -> int:
        return _size(self.path(rank, what))

    def read(self, rank: int, offset: int = 0, what: str = "out") -> str:
        try:
            with open(self.path(rank, what), "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def crash(self, rank: int) -> str:
        """faulthandler's trace of a rank that died of a signal."""
        return self.read(rank, 0, "crash").strip()

    def stacks(self, pids: dict[int, int | None]) -> dict[int, str]:
        """Ask each rank (rank -> pid) for its Python stack (faulthandler on SIGUSR1: written
        from the signal handler, so it needs neither the GIL nor the rank's main thread) and
        read them back."""
        before = {r: self.size(r, "stack") for r in pids}
        for pid in pids.values():
            with contextlib.suppress(OSError, ValueError, TypeError):
                os.kill(pid, signal.SIGUSR1)  # type: ignore[arg-type]
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and len(stacks) < len(pids):
            time.sleep(0.05)
            for r in pids:
                if r not in stacks and self.size(r, "stack") > before[r]:
                    time.sleep(0.05)  # let faulthandler finish writing every thread
                    stacks[r] = self.read(r, before[r], "stack")
        return {r: _clean_stack(s) for r, s in stacks.items()}


@contextlib.contextmanager
def no_main_module() -> Any:
    """Hide ``__main__`` from multiprocessing while ranks start.

    spawn re-runs the parent's main script in every child, which fails for ``python -`` or
    ``python -c`` and imports pytest's entry script into ranks. Ranks load a function
    defined in ``__main__`` from its file when a run needs it (``_ensure_module``).

    One thread at a time: pools of a sweep start in the threads that run them
    (``harness.layouts._lanes``), and two interleaved swaps would leave one thread's
    stand-in as ``__main__`` for good, and the other spawning with the real one.
    """
    with _MAIN_SWAP:
        real = sys.modules["__main__"]
        stand_in = types.ModuleType("__main__")
        stand_in.__spec__ = None
        sys.modules["__main__"] = stand_in
        try:
            yield
        finally:
            sys.modules["__main__"] = real


#: held while ``__main__`` is swapped out (``no_main_module``); reentrant for a nested start
_MAIN_SWAP = threading.RLock()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _clean_stack(text: str) -> str:
    """A faulthandler dump without the pool's own threads (watchdog, probe) and without the
    frames that are the rank's plumbing (its main loop, multiprocessing's start): the user's
    frames, torch's, and the line the rank waits on."""
    blocks = text.strip().split("\n\n")
    keep = [b for b in blocks if "_watch_parent" not in b and "_serve_probes" not in b]
    lines = [
        line
        for block in keep or blocks
        for line in [*block.splitlines(), ""]
        if not plumbing(line.split('File "', 1)[-1].split('"', 1)[0])
        and f"multiprocessing{os.sep}" not in line
        and 'File "<string>"' not in line
    ]
    return "\n".join(lines).strip()


def rank_memory(pid: int) -> tuple[int, int] | None:
    """``(RSS, PSS)`` of a process in KiB, from Linux's ``/proc/PID/smaps_rollup``;
    ``None`` where unreadable. PSS counts a page shared by N processes as 1/N of it: the
    fork server's torch, shared by every rank forked from it, is counted once in all."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    fields = {}
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            fields[name] = int(value[0])
    if "Rss" not in fields or "Pss" not in fields:
        return None
    return fields["Rss"], fields["Pss"]
