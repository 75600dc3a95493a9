"""What runs inside a rank process of a ``RankPool``.

The pool's parent side (``harness.pool``) starts ``_worker_main`` in each rank process and
talks to it over a pipe in named events with keyword fields (``send(conn, "done",
run_id=3, ok=True, result=...)``), one handler each on either side:

    parent -> rank: run, fence, release, stop
    rank -> parent: ready, started, progress, done, fenced, released

A run: ``run`` -> ``started``, ``progress``..., ``done``. Once every rank is done, the
parent proves the process group clean before anything reuses it: ``fence`` -> ``fenced``
(operations left in flight, operation counts per group), then ``release`` (keep the group or
not; ``verify`` runs one collective with the run id and a short deadline) -> ``released``.

This module imports neither pytest nor, until a rank starts, torch.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import importlib.util
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from harness.errors import exception_summary

#: How long a rank waits for the operations it started asynchronously to complete once
#: every rank has returned (an isend completes when its peer's recv arrives: milliseconds).
FENCE_GRACE = 1.0
#: Deadline of the fence collective that proves a kept group still pairs every rank.
VERIFY_TIMEOUT = 10.0


def send(conn: Connection, event: str, **fields: Any) -> None:
    """Send one named event over a pool pipe."""
    conn.send_bytes(pickle.dumps((event, fields), protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> tuple[str, dict[str, Any]]:
    """The next named event from a pool pipe."""
    event, fields = pickle.loads(conn.recv_bytes())
    return event, fields


# ---------------------------------------------------------------------- progress


_CURRENT: _Rank | None = None


def report_progress(phase: str, step: int | None = None) -> None:
    """Tell the pool what this rank is doing now ("step 0 forward"), so that a failure, a
    crash or a hang can say where it happened. A no-op outside a pool's rank process."""
    rank = _CURRENT
    if rank is not None and rank.run_id is not None:
        with contextlib.suppress(OSError, ValueError):
            send(rank.conn, "progress", run_id=rank.run_id, phase=phase, step=step)


# ---------------------------------------------------------------------- loading functions


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


# ---------------------------------------------------------------------- the rank


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
    rank: int,
    world: int,
    conn: Connection,
    workdir: str,
    parent_pid: int,
    backend: str,
    *,
    probe: Connection | None = None,
    preload: tuple[str, ...] = (),
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
    for module in preload:  # at start, not inside the first run's timeout
        importlib.import_module(module)
    _warm_up(torch, os.path.join(workdir, f"warmup{rank}"), backend)
    if probe is not None:
        main = threading.get_ident()
        threading.Thread(
            target=_serve_probes, args=(probe, main), name="harness-probe", daemon=True
        ).start()
    global _CURRENT
    _CURRENT = _Rank(rank, world, conn, backend)
    send(conn, "ready", pid=os.getpid())
    _CURRENT.serve()


def _warm_up(torch: Any, store_path: str, backend: str) -> None:
    """Pay torch.distributed's lazy imports (seconds: it pulls in torch._dynamo) at start.

    Otherwise the first run on a fresh pool spends them inside its timeout.
    """
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        store=dist.FileStore(  # type: ignore[attr-defined]  # not in the stubs
            store_path, 1
        ),
        rank=0,
        world_size=1,
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    _end_group()
    _RankState.save().restore()  # its first call imports for a second too


def _serve_probes(conn: Connection, main: int) -> None:
    """Answer the pool's probes from a thread of its own, while the main thread runs (or
    hangs in) the function: where the main thread is, whether that is inside a
    torch.distributed call, and how many operations this rank's groups have seen. What the
    pool's deadlock detection reads; a main thread holding the GIL delays the answer, which
    the pool takes as progress."""
    from harness._compat import current_frame, operations_issued

    while True:
        try:
            _, fields = receive(conn)
        except (EOFError, OSError):
            return
        frame = current_frame(main)
        where, waiting, stack = "", False, ""
        if frame is not None:
            code = frame.f_code
            where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
            waiting = f"{os.sep}torch{os.sep}distributed{os.sep}" in code.co_filename
            if waiting:
                stack = "".join(traceback.format_stack(frame, limit=40))
        try:
            send(
                conn,
                "probed",
                n=fields.get("n"),
                where=where,
                waiting=waiting,
                operations=operations_issued(),
                stack=stack,
            )
        except (OSError, ValueError):
            return


class _Rank:
    """One rank's side of the protocol: a handler per event from the parent."""

    def __init__(self, rank: int, world: int, conn: Connection, backend: str) -> None:
        from harness._compat import WorkTracker

        self.rank, self.world, self.conn, self.backend = rank, world, conn, backend
        self.run_id: int | None = None
        self.saved: _RankState | None = None
        self.ok = False
        self.works = WorkTracker()
        self.works.install()

    def serve(self) -> None:
        while True:
            try:
                event, fields = receive(self.conn)
            except (EOFError, OSError):
                return
            if event == "stop":
                return
            try:
                getattr(self, f"on_{event}")(**fields)
            except (EOFError, OSError):  # the parent is gone: nothing left to serve
                return

    def on_run(
        self,
        run_id: int,
        payload: bytes,
        store: str,
        sys_path: list[str],
        timeout: float,
        reuse: bool,
    ) -> None:
        send(self.conn, "started", run_id=run_id)
        self.run_id = run_id
        for p in sys_path:
            if p not in sys.path:
                sys.path.append(p)
        self.saved = _RankState.save()
        self.works.clear()
        ok, fields = _run_one(self.rank, self.world, payload, store, self.backend, timeout, reuse)
        self.ok = ok
        if ok:  # what the fence needs, now: most runs then need no fence round trip
            from harness._compat import group_sequence_numbers

            fields["in_flight"] = self.works.pending(0.0)
            fields["sequences"] = group_sequence_numbers()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # Keep the process group up until every rank is done: a rank that returned while
        # others still wait in a collective (it skipped one) must leave them hanging, as it
        # would in production, not break them by tearing down. (A rank whose function
        # raised has torn its group down already, to free peers blocked on it.)
        send(self.conn, "done", run_id=run_id, ok=ok, **fields)

    def on_fence(self, run_id: int) -> None:
        """Every rank returned: report what this rank left in flight, and its counts."""
        from harness._compat import group_sequence_numbers

        pending = self.works.pending(FENCE_GRACE)
        send(
            self.conn, "fenced", run_id=run_id, pending=pending, sequences=group_sequence_numbers()
        )

    def on_release(self, run_id: int, keep: bool, verify: bool) -> None:
        """The run is over: keep the group for the next run (after proving it still pairs
        every rank, if asked) or tear it down; then put back what the run changed."""
        ok, detail = True, ""
        if keep and verify:
            ok, detail = _verify_group(run_id, self.world)
        # Answer first, then put things back: the parent returns the run's results while
        # the ranks restore, and the next run's message waits in the pipe until they have.
        send(self.conn, "released", run_id=run_id, ok=ok, detail=detail)
        self.works.clear()
        self.run_id = None
        if self.saved is not None:
            _end_run(self.saved, keep_group=keep and ok and self.ok)
            self.saved = None


def _verify_group(run_id: int, world: int) -> tuple[bool, str]:
    """One all-reduce of (run id, 1) on the default group, with a short deadline: a group
    whose ranks are out of step (a collective left pending somewhere) fails it."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return False, "no process group"
    t = torch.tensor([float(run_id), 1.0], dtype=torch.float64)
    try:
        work = dist.all_reduce(t, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=VERIFY_TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - a timed-out or broken fence: not clean
        return False, f"fence collective failed: {exception_summary(exc)}"
    expected = [float(run_id) * world, float(world)]
    if t.tolist() != expected:
        return False, f"fence collective gave {t.tolist()}, expected {expected}"
    return True, ""


def _run_one(
    rank: int,
    world: int,
    payload: bytes,
    store_path: str,
    backend: str,
    timeout: float,
    reuse: bool,
) -> tuple[bool, dict[str, Any]]:
    import torch.distributed as dist

    try:
        where, call = pickle.loads(payload)
        for module, file in where:
            _ensure_module(module, file)
        fn, args, kwargs = pickle.loads(call)
    except Exception as exc:  # noqa: BLE001
        return False, {
            "summary": f"could not load the rank function on rank {rank}: {exc!r}. "
            "Rank processes import it by module and name: define it at module level "
            "in an importable module.",
            "detail": traceback.format_exc(),
        }
    if not (reuse and dist.is_initialized()):
        _end_group()
        try:
            dist.init_process_group(
                backend,
                store=dist.FileStore(  # type: ignore[attr-defined]  # not in the stubs
                    store_path, world
                ),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=max(timeout * 2, 60)),
            )
        except Exception as exc:  # noqa: BLE001 - e.g. a peer that failed at once and left
            _end_group()
            return False, {"summary": exception_summary(exc), "detail": traceback.format_exc()}
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a rank's SystemExit is a failure too
        # Tear the group down at once: peers blocked in a collective with this rank then
        # fail fast ("Connection closed by peer") instead of waiting for the timeout.
        _end_group()
        return False, {
            "summary": exception_summary(exc),
            "detail": traceback.format_exc(),
            "phase": getattr(exc, "harness_phase", None),
        }
    try:
        return True, {"result": pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)}
    except Exception as exc:  # noqa: BLE001
        return False, {
            "summary": f"PicklingProblem: rank {rank} returned a {type(result).__module__}."
            f"{type(result).__qualname__} that cannot be pickled ({exc}); return tensors, "
            "numbers, lists or dicts of them",
            "detail": traceback.format_exc(),
        }


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
    environ: dict[str, str]

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
            environ=dict(os.environ),
        )

    def restore(self) -> None:
        import random

        import numpy as np
        import torch

        from harness._compat import reset_torch_harmonics_groups

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
        if os.environ != self.environ:  # what a run set, unset or changed goes back
            os.environ.clear()
            os.environ.update(self.environ)
        reset_torch_harmonics_groups()
