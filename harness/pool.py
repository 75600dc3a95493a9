"""Warm rank processes that run one function on every rank of a gloo group.

A ``RankPool`` starts ``world_size`` processes once (spawn or forkserver, never fork after
torch is imported) and serves many runs. Each run gets a fresh default process group that
meets through a ``FileStore`` in the pool's own temporary directory: no ports, so any number
of pools, xdist workers and pytest sessions can run side by side. Between runs a rank puts
back what a run may change (RNG state, default dtype, grad mode, torch-harmonics' process
group globals), so runs cannot leak into each other.

Failures are the point of a test harness, so they are first-class:

- a rank that raises comes back with its traceback; every failing rank is listed;
- a rank that dies is noticed through its process sentinel at once, and named with its exit
  code or signal;
- a run past its timeout collects every rank's Python stack (faulthandler on SIGUSR1), then
  the pool is killed and starts afresh on next use. Only that run fails.

This module imports neither torch nor pytest at import time: the parent stays light, and
rank processes import torch after limiting their threads.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from harness._rank import _worker_main
from harness.errors import (
    ConfigError,
    PicklingProblem,
    RankCrash,
    RankError,
    RankFailure,
    RankProblem,
    RankTimeout,
)

DEFAULT_TIMEOUT = 120.0
#: How long healthy ranks get to finish after another rank raised, before they are taken to
#: be stuck in a collective with the failed rank and the pool is restarted.
ERROR_GRACE = 3.0
#: How long a rank may take to start (import torch, set up) before the start counts as failed.
START_TIMEOUT = 180.0
START_METHODS = ("spawn", "forkserver")

_RELEASE_KEEP = pickle.dumps(("release", True))  # the run went well: keep the group
_RELEASE_DROP = pickle.dumps(("release", False))  # something failed: next run starts afresh
_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()
    # The fork server would notice our exit within a second or so; stop it now, so that
    # nothing of ours is left running once this process is gone. (Only at exit: its
    # children are the ranks of live pools, which watch for being re-parented.)
    from multiprocessing import forkserver

    with contextlib.suppress(Exception):
        forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private, 3.8+


class RankPool:
    """``world_size`` warm rank processes that run a function together.

    Usage (``rank_fn`` a module-level function)::

        with RankPool(4) as pool:
            results = pool.run(rank_fn, 3, timeout=30)  # [rank 0's result, ..., rank 3's]

    Inside ``fn`` the default process group (gloo, world = pool size) is initialised.
    ``fn`` and its arguments are pickled, so ``fn`` must be importable by module and name
    (defined at module level). The pool starts on first use and restarts after a crash or a
    timeout.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        start_method: str = "spawn",
        backend: str = "gloo",
        error_grace: float = ERROR_GRACE,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"RankPool needs world_size >= 1, got {world_size!r}")
        if start_method not in START_METHODS:
            raise ConfigError(
                f"start_method {start_method!r} is not supported; use one of {START_METHODS} "
                "(plain fork after torch is imported can deadlock the ranks)"
            )
        if timeout is None or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.start_method = start_method
        self.backend = backend
        self.error_grace = error_grace
        self.starts = 0  # how many times the processes were (re)started
        self.runs = 0
        self.last_outputs: list[str] = [""] * world_size
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._workdir: str | None = None
        self._idle: list[bool] = [True] * world_size
        # After a run that every rank finished cleanly, the next run reuses its process group
        # and cached subgroups (saves ~50 ms a run, more with many subgroups); after any
        # failure the ranks build a fresh group, so a broken one can never be reused.
        self._group_ok = False
        self._lock = threading.Lock()
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        """Start the rank processes (no-op if they are running)."""
        if self.alive:
            return
        self._kill()
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The server imports torch once; each rank is then a cheap fork of it.
            ctx.set_forkserver_preload(["harness._preload"])
        self._workdir = tempfile.mkdtemp(prefix=f"harness-pool{self.world_size}-")
        parent_pid = os.getpid()
        with _no_main_module():
            self._spawn(ctx, parent_pid)
        deadline = time.monotonic() + START_TIMEOUT
        self._await_ready(deadline)
        self.starts += 1

    def _spawn(self, ctx: Any, parent_pid: int) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, child_end, self._workdir, parent_pid, self.backend),
                name=f"harness-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def _await_ready(self, deadline: float) -> None:
        for rank, conn in enumerate(self._conns):
            left = max(0.0, deadline - time.monotonic())
            ready = wait([conn, self._procs[rank].sentinel], timeout=left)
            if conn in ready:
                with contextlib.suppress(EOFError, OSError):
                    conn.recv_bytes()
                    continue
            output = self._read_log(rank, 0)
            self._kill()
            raise RankCrash(
                f"rank {rank}/{self.world_size} failed to start "
                f"({'timed out' if not ready else 'process exited'}); its output follows. "
                "Check that torch imports in a fresh interpreter.",
                self.world_size,
                [RankProblem(rank, "crash", "failed to start", output)],
            )

    def close(self) -> None:
        """Stop every rank process and remove the pool's temporary directory."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps(("stop",)))
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self._procs:
            proc.join(5.0)
            with contextlib.suppress(ValueError):
                proc.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._procs, self._conns = [], []
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # ------------------------------------------------------------------ running

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises ``RankError`` (a rank raised), ``RankCrash`` (a rank died) or ``RankTimeout``
        (the run took longer than ``timeout`` seconds; every rank's stack is attached), each a
        ``RankFailure`` listing every rank's problem. ``PicklingProblem`` if ``fn``, its
        arguments or a result cannot cross the process boundary.
        """
        payload = _dump_call(fn, args, kwargs)
        timeout = self.timeout if timeout is None else float(timeout)
        with self._lock:
            if not self.alive:
                self.start()
            assert self._workdir is not None
            self.runs += 1
            run_id = self.runs
            store = os.path.join(self._workdir, f"store-{run_id}")
            offsets = [self._log_size(r) for r in range(self.world_size)]
            reuse = self._group_ok
            self._group_ok = False
            message = pickle.dumps(
                ("run", run_id, payload, store, list(sys.path), timeout, reuse)
            )
            self._idle = [False] * self.world_size
            try:
                for conn in self._conns:
                    conn.send_bytes(message)
                return self._collect(run_id, timeout, offsets)
            except BaseException:
                # KeyboardInterrupt or a bug here: never leave ranks running behind us.
                if self.alive and not all(self._idle):
                    self._kill()
                raise

    def _collect(self, run_id: int, timeout: float, offsets: list[int]) -> list[Any]:
        n = self.world_size
        results: dict[int, Any] = {}
        replied: set[int] = set()
        problems: list[RankProblem] = []
        pending = set(range(n))
        start = time.monotonic()
        deadline = start + timeout
        first_failure: float | None = None
        crashed = False
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            if first_failure is not None and (crashed or now - first_failure >= self.error_grace):
                break
            waitables: list[Any] = []
            for r in pending:
                waitables += [self._conns[r], self._procs[r].sentinel]
            ready = wait(waitables, timeout=min(0.2, max(0.0, deadline - now)))
            for r in sorted(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready:
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None:
                        pending.discard(r)
                        replied.add(r)
                        self._idle[r] = True
                        _, rid, ok, body = msg
                        assert rid == run_id, (rid, run_id)
                        if ok:
                            try:
                                results[r] = pickle.loads(body)
                            except Exception as exc:  # noqa: BLE001 - any unpickling failure
                                problems.append(
                                    RankProblem(
                                        r, "error", f"result could not be unpickled: {exc!r}"
                                    )
                                )
                        else:
                            summary, detail = body
                            problems.append(RankProblem(r, "error", summary, detail))
                        continue
                if proc.sentinel in ready or not proc.is_alive():
                    proc.join(0.5)
                    pending.discard(r)
                    crashed = True
                    problems.append(
                        RankProblem(r, "crash", _describe_exit(proc.exitcode), self._crash_log(r))
                    )
            if problems and first_failure is None:
                first_failure = time.monotonic()

        outputs = [self._read_log(r, offsets[r]) for r in range(n)]
        if pending:
            stacks = self._dump_stacks(sorted(pending))
            kind = "stopped" if problems else "timeout"
            waited = time.monotonic() - start
            for r in sorted(pending):
                why = (
                    f"still running after {waited:.1f}s (timeout {timeout:g}s)"
                    if kind == "timeout"
                    else "still running after another rank failed (waiting in a collective?)"
                )
                problems.append(RankProblem(r, kind, why, stacks.get(r, "(no stack collected)")))
            self._kill()  # ranks stuck in a collective cannot be reused: start afresh next run
        else:
            release = _RELEASE_DROP if problems else _RELEASE_KEEP
            for r, conn in enumerate(self._conns):
                if r in replied:  # every rank that answered waits for this, error or not
                    with contextlib.suppress(OSError):
                        conn.send_bytes(release)
        outputs = [o or self._read_log(r, offsets[r]) for r, o in enumerate(outputs)]
        self.last_outputs = outputs
        for p in problems:
            p.output = outputs[p.rank]
        if not problems:
            self._group_ok = True
            return [results[r] for r in range(n)]
        if crashed:
            self._kill()
        raise _failure(problems, n, timeout)

    # ------------------------------------------------------------------ diagnostics

    def _log_path(self, rank: int, what: str = "out") -> str:
        assert self._workdir is not None
        return os.path.join(self._workdir, f"rank{rank}.{what}")

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._log_path(rank))
        except OSError:
            return 0

    def _read_log(self, rank: int, offset: int, what: str = "out") -> str:
        if self._workdir is None:
            return ""
        try:
            with open(self._log_path(rank, what), "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _crash_log(self, rank: int) -> str:
        return self._read_log(rank, 0, "crash").strip()

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask each rank for its Python stack (faulthandler on SIGUSR1) and read them back."""
        before = {r: _size(self._log_path(r, "stack")) for r in ranks}
        for r in ranks:
            with contextlib.suppress(OSError, ValueError):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and len(stacks) < len(ranks):
            time.sleep(0.05)
            for r in ranks:
                if r not in stacks and _size(self._log_path(r, "stack")) > before[r]:
                    time.sleep(0.05)  # let faulthandler finish writing every thread
                    stacks[r] = self._read_log(r, before[r], "stack")
        return {r: _clean_stack(s) for r, s in stacks.items()}


@contextlib.contextmanager
def _no_main_module() -> Any:
    """Hide ``__main__`` from multiprocessing while ranks start.

    spawn re-runs the parent's main script in every child, which fails for ``python -`` or
    ``python -c`` and imports pytest's entry script into ranks. Ranks load a function
    defined in ``__main__`` from its file when a run needs it (``_ensure_module``).
    """
    real = sys.modules["__main__"]
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = None
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _clean_stack(text: str) -> str:
    """Drop the pool's own watchdog thread from a faulthandler dump; keep the rest."""
    blocks = text.strip().split("\n\n")
    keep = [b for b in blocks if "_watch_parent" not in b]
    return "\n\n".join(keep or blocks)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "process died (exit status unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process killed by {name}"
    return f"process exited with code {code}"


#: Messages of errors that a rank gets because a peer left a collective (it raised or
#: died): consequences, not causes, so they are listed after the rank that failed first.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "Connection refused",
)


def _failure(problems: list[RankProblem], world: int, timeout: float) -> RankFailure:
    def order(p: RankProblem) -> int:
        if p.kind == "error" and any(m in p.summary for m in _PEER_LOST):
            return 3
        return {"crash": 0, "timeout": 1, "error": 2, "stopped": 4}[p.kind]

    first = min(problems, key=order)  # min() keeps the earliest arrival among equals
    failing = sorted(p.rank for p in problems if order(p) == order(first))
    where = ", ".join(f"{r}/{world}" for r in failing)
    if first.kind == "crash":
        cls: type[RankFailure] = RankCrash
        msg = f"rank {where} died during the run: {first.summary}"
    elif first.kind == "timeout":
        cls = RankTimeout
        msg = (
            f"run timed out after {timeout:g}s on rank {where}; every rank's stack follows. "
            "A rank that skips a collective the others enter hangs like this; "
            "raise the timeout (--spatial-timeout) only if the work is really that slow."
        )
    else:
        cls = RankError
        msg = f"rank {where} raised {first.summary}"
    # Within a kind, arrival order: the rank that failed first is the likely cause.
    arrival = {id(p): i for i, p in enumerate(problems)}
    problems = sorted(problems, key=lambda p: (order(p), arrival[id(p)]))
    return cls(msg, world, problems)


# ---------------------------------------------------------------------- pickling


def _dump_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle a call for the ranks, turning pickling failures into advice."""
    if not callable(fn):
        raise PicklingProblem(f"pool.run needs a callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise PicklingProblem(
            f"rank function {qualname!r} is defined inside a function (or is a lambda), so "
            f"rank processes cannot import it. Move it to module level of {module!r} "
            "(rank processes import functions by module and name)."
        )
    try:
        call = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise PicklingProblem(
            f"cannot send {qualname or fn!r} and its arguments to the ranks: {exc}. "
            "Rank functions must be module-level and their arguments picklable "
            "(tensors, numbers, dataclasses; not open files, locks or lambdas)."
        ) from exc
    file = getattr(sys.modules.get(module or ""), "__file__", None)
    return pickle.dumps((module, file, call))


class PoolRegistry:
    """One warm ``RankPool`` per world size, made on first use, closed together.

    Caps the rank processes it keeps alive (``max_processes``) by closing the least recently
    used pool: a session that uses 1, 2, 3 and 4 ranks should not hold ten processes on a
    two-core machine.
    """

    def __init__(
        self,
        *,
        default_ranks: int = 4,
        timeout: float = DEFAULT_TIMEOUT,
        start_method: str = "spawn",
        max_processes: int = 8,
    ) -> None:
        self.default_ranks = default_ranks
        self.timeout = timeout
        self.start_method = start_method
        self.max_processes = max(max_processes, default_ranks)
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.pop(world_size, None)
        if pool is None:
            pool = RankPool(world_size, timeout=self.timeout, start_method=self.start_method)
        self._pools[world_size] = pool  # most recently used last
        while sum(p.world_size for p in self._pools.values()) > self.max_processes:
            oldest = next(iter(self._pools))
            if oldest == world_size:
                break
            self._pools.pop(oldest).close()
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_SHARED: PoolRegistry | None = None


def shared_registry() -> PoolRegistry:
    """The process-wide pools ``check_equivalence`` uses when given none (outside pytest).

    forkserver: torch is imported once and each rank forks from it (~0.1 s, not ~6 s).
    """
    global _SHARED
    if _SHARED is None:
        _SHARED = PoolRegistry(start_method="forkserver")
        atexit.register(_SHARED.close)
    return _SHARED
