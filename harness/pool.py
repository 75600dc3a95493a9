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
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

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
                if r in results:
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


def _ensure_module(name: str | None, file: str | None) -> None:
    """Make ``name`` importable on a rank, as the parent sees it.

    Warm ranks outlive test modules: pytester runs can reuse a module name for a different
    file, and ``--import-mode=importlib`` gives test modules names that are not importable.
    So a module whose file differs from the parent's is loaded again from the parent's file.
    """
    if not name or not file:
        return
    if name == "__main__":
        # Load the parent's script under another name so its ``if __name__ == "__main__"``
        # block does not run, then let pickle find it as ``__main__`` (as spawn does).
        main = sys.modules.get("__mp_main__")
        if main is None or getattr(main, "__file__", None) != file:
            spec = importlib.util.spec_from_file_location("__mp_main__", file)
            if spec is None or spec.loader is None:
                return
            main = importlib.util.module_from_spec(spec)
            sys.modules["__mp_main__"] = main
            spec.loader.exec_module(main)
        sys.modules["__main__"] = main
        return
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None) == file:
        return
    if mod is None:
        try:
            mod = importlib.import_module(name)
            if getattr(mod, "__file__", None) == file:
                return
        except Exception:  # noqa: BLE001 - fall back to loading from the file
            pass
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    parts = name.split(".")
    for i in range(1, len(parts)):  # pickle imports parents first; give it stand-ins
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            try:
                importlib.import_module(parent)
            except Exception:  # noqa: BLE001
                stub = types.ModuleType(parent)
                stub.__path__ = []
                sys.modules[parent] = stub
    sys.modules[name] = module
    spec.loader.exec_module(module)


# ---------------------------------------------------------------------- rank side


def _watch_parent(parent_pid: int) -> None:
    # A rank whose pool owner is gone (SIGKILL, crash) has nobody to serve: exit, even from
    # inside a collective. This is what keeps rank processes from outliving a session.
    # Under forkserver the direct parent is the fork server, so watch both: the owner by pid,
    # the direct parent by being re-parented.
    direct_parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != direct_parent or not _pid_alive(parent_pid):
            os._exit(3)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_main(
    rank: int, world: int, conn: Connection, workdir: str, parent_pid: int, backend: str
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    out = open(os.path.join(workdir, f"rank{rank}.out"), "ab", buffering=0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    crash = open(os.path.join(workdir, f"rank{rank}.crash"), "w")
    stack = open(os.path.join(workdir, f"rank{rank}.stack"), "w")
    faulthandler.enable(file=crash, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    # Several ranks share a few cores: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    _warm_up(torch, os.path.join(workdir, f"warmup{rank}"), backend)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, run_id, payload, store, parent_path, timeout, reuse = msg
        for p in parent_path:
            if p not in sys.path:
                sys.path.append(p)
        saved = _RankState.save()
        ok, body = _run_one(rank, world, payload, store, backend, timeout, reuse)
        keep = False
        try:
            conn.send_bytes(pickle.dumps(("done", run_id, ok, body)))
            if ok:
                # Keep the process group up until every rank is done: a rank that returned
                # while others still wait in a collective (it skipped one) must leave them
                # hanging, as it would in production, not break them by tearing down.
                reply = pickle.loads(conn.recv_bytes())
                if reply[0] != "release":
                    return
                keep = reply[1]
        except (EOFError, OSError):
            return
        finally:
            _end_run(saved, keep_group=keep)


def _warm_up(torch: Any, store_path: str, backend: str) -> None:
    """Pay torch.distributed's lazy imports (seconds: it pulls in torch._dynamo) at start.

    Otherwise the first run on a fresh pool spends them inside its timeout.
    """
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    _end_run(_RankState.save())  # its first call imports for a second too


def _run_one(
    rank: int,
    world: int,
    payload: bytes,
    store_path: str,
    backend: str,
    timeout: float,
    reuse: bool,
) -> tuple[bool, Any]:
    import datetime

    import torch.distributed as dist

    try:
        module, file, call = pickle.loads(payload)
        _ensure_module(module, file)
        fn, args, kwargs = pickle.loads(call)
    except Exception as exc:  # noqa: BLE001
        return False, (
            f"could not load the rank function on rank {rank}: {exc!r}. "
            "Rank processes import it by module and name: define it at module level "
            "in an importable module.",
            traceback.format_exc(),
        )
    if not (reuse and dist.is_initialized()):
        _end_group()
        dist.init_process_group(
            backend,
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=max(timeout * 2, 60)),
        )
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a rank's SystemExit is a failure too
        # Tear the group down at once: peers blocked in a collective with this rank then
        # fail fast ("Connection closed by peer") instead of waiting for the timeout.
        _end_group()
        return False, (_exc_summary(exc), traceback.format_exc())
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    try:
        return True, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001
        return False, (
            f"PicklingProblem: rank {rank} returned a {type(result).__module__}."
            f"{type(result).__qualname__} that cannot be pickled ({exc}); return tensors, "
            "numbers, lists or dicts of them",
            traceback.format_exc(),
        )


def _end_group() -> None:
    """Destroy the default group (and with it every subgroup) and forget cached subgroups."""
    import torch.distributed as dist

    from harness.topology import clear_group_cache

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    clear_group_cache()


def _end_run(saved: _RankState, *, keep_group: bool = False) -> None:
    if not keep_group:
        _end_group()
    saved.restore()


def _exc_summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass
class _RankState:
    """Process-wide state a run may change, put back after it."""

    torch_rng: Any
    np_rng: Any
    py_rng: Any
    dtype: Any
    grad: bool
    anomaly: bool
    deterministic: bool
    threads: int
    cwd: str

    @classmethod
    def save(cls) -> _RankState:
        import random

        import numpy as np
        import torch

        return cls(
            torch_rng=torch.get_rng_state(),
            np_rng=np.random.get_state(),
            py_rng=random.getstate(),
            dtype=torch.get_default_dtype(),
            grad=torch.is_grad_enabled(),
            anomaly=torch.is_anomaly_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            threads=torch.get_num_threads(),
            cwd=os.getcwd(),
        )

    def restore(self) -> None:
        import random

        import numpy as np
        import torch

        torch.set_rng_state(self.torch_rng)
        np.random.set_state(self.np_rng)
        random.setstate(self.py_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.autograd.set_detect_anomaly(self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_num_threads(self.threads)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        # torch-harmonics keeps its polar/azimuth groups in module globals; a later run
        # must not find the previous run's (destroyed) groups there.
        th = sys.modules.get("torch_harmonics.distributed.utils")
        if th is not None:
            for name, value in (
                ("_POLAR_PARALLEL_GROUP", None),
                ("_AZIMUTH_PARALLEL_GROUP", None),
                ("_IS_INITIALIZED", False),
            ):
                setattr(th, name, value)


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

    @property
    def pools(self) -> dict[int, RankPool]:
        return dict(self._pools)

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
