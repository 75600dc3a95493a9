"""What runs inside a rank process of a ``RankPool``.

The pool's parent side (``harness.pool``) starts ``_worker_main`` in each rank process and
talks to it over a pipe: ``("run", ...)`` messages in, ``("done", ...)`` replies out, then
``("release", keep)`` once every rank is done. This module imports neither pytest nor,
until a rank starts, torch.
"""

from __future__ import annotations

import contextlib
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
            # Keep the process group up until every rank is done: a rank that returned while
            # others still wait in a collective (it skipped one) must leave them hanging, as
            # it would in production, not break them by tearing down. (A rank whose function
            # raised has torn its group down already, to free peers blocked on it.)
            reply = pickle.loads(conn.recv_bytes())
            if reply[0] != "release":
                return
            keep = ok and reply[1]
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
        try:
            dist.init_process_group(
                backend,
                store=dist.FileStore(store_path, world),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=max(timeout * 2, 60)),
            )
        except Exception as exc:  # noqa: BLE001 - e.g. a peer that failed at once and left
            _end_group()
            return False, (_exc_summary(exc), traceback.format_exc())
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
