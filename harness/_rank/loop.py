"""What runs inside a rank process of a ``RankPool``.

The pool's parent side (``harness.pool``) starts ``worker_main`` in each rank process and
talks to it in the events of ``harness._protocol.events`` (``RunCall`` -> ``Done``, ``Fence`` ->
``Fenced``, ``Release`` -> ``Released``), one handler each. What the rank is doing right now
(its run, its phase, the operation its main thread waits on) it writes on its slot of the
pool's notice board (``harness._protocol.board``) instead of sending it: the pool reads that
whenever it
likes, with no message and no help from the rank. A thread of the rank answers the pool's
probes (``Probe`` -> ``Probed``) for what the board cannot show: where the main thread is
when it is inside torch on something the harness does not see (DDP's reducer), and the
rank's counts of operations.

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
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from harness._base import wire
from harness._base.pids import pid_alive as _pid_alive
from harness._protocol.board import Board, State, Writer
from harness._protocol.events import (
    Done,
    Fence,
    Fenced,
    Probe,
    Probed,
    Ready,
    Release,
    Released,
    Report,
    RunCall,
    Stop,
    handler_name,
    receive,
    send,
)
from harness._rank.state import RankState
from harness.errors import exception_summary, user_traceback

if TYPE_CHECKING:
    from harness._rank.intercept import Tracker

#: Deadline of the fence collective that proves a kept group still pairs every rank.
VERIFY_TIMEOUT = 10.0


# ---------------------------------------------------------------------- progress


_CURRENT: _Rank | None = None


def report_progress(phase: str, step: int | None = None) -> None:
    """Tell the pool what this rank is doing now ("step 0 forward"), so that a failure, a
    crash or a hang can say where it happened. Written on the rank's board slot: no message,
    ~1 µs. A no-op outside a pool's rank process."""
    rank = _CURRENT
    if rank is not None and rank.run_id is not None:
        rank.board.phase(phase, step)


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
            _exec_module(spec, main, "__mp_main__")
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
    _exec_module(spec, module, name)


def _exec_module(spec: importlib.machinery.ModuleSpec, module: types.ModuleType, name: str) -> None:
    """Run ``module`` as ``sys.modules[name]``; if it raises, take it out again, as Python's
    own import does: a warm rank must not keep a half-run module (the next run would find it
    by its file and fail on a missing name instead of loading it afresh)."""
    assert spec.loader is not None  # checked by the callers
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        raise


# ---------------------------------------------------------------------- the rank


def _watch_parent(parent_pid: int, workdir: str) -> None:
    # A rank whose pool owner is gone (SIGKILL, crash) has nobody to serve: exit, even from
    # inside a collective, and take the pool's directory with it (the owner cannot any
    # more). This is what keeps rank processes and their files from outliving a session.
    # Under forkserver the direct parent is the fork server, so watch both: the owner by pid,
    # the direct parent by being re-parented.
    # Where the OS gives process file descriptors (Linux >= 5.3), the thread sleeps until one
    # of them exits: no wake-ups at all while the pool serves, on a machine other suites load.
    import shutil

    direct_parent = os.getppid()
    owner = _pidfd(parent_pid)
    parent = _pidfd(direct_parent) if direct_parent != parent_pid else None
    if owner is not None and (parent is not None or direct_parent == parent_pid):
        import select

        watched = [fd for fd in (owner, parent) if fd is not None]
        ready, _, _ = select.select(watched, [], [])  # readable once that process has exited
        if owner in ready:  # gone (a zombie not yet reaped still answers kill(pid, 0))
            shutil.rmtree(workdir, ignore_errors=True)
        os._exit(3)
    while True:
        time.sleep(0.5)
        if os.getppid() != direct_parent or not _pid_alive(parent_pid):
            if not _pid_alive(parent_pid):
                shutil.rmtree(workdir, ignore_errors=True)
            os._exit(3)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when ``pid`` exits; ``None`` where the OS has
    none (not Linux, a kernel before 5.3, a process already gone)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def worker_main(
    rank: int,
    world: int,
    conn: Connection,
    workdir: str,
    parent_pid: int,
    backend: str,
    *,
    probe: Connection | None = None,
    preload: tuple[str, ...] = (),
    cpu: int | None = None,
) -> None:
    _pin_to(cpu)  # first: every thread the rank starts (gloo's among them) inherits it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    out = open(os.path.join(workdir, f"rank{rank}.out"), "ab", buffering=0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    crash = open(os.path.join(workdir, f"rank{rank}.crash"), "w")
    stack = open(os.path.join(workdir, f"rank{rank}.stack"), "w")
    faulthandler.enable(file=crash, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    threading.excepthook = _ThreadErrors(os.path.join(workdir, f"rank{rank}.threads"))
    threading.Thread(target=_watch_parent, args=(parent_pid, workdir), daemon=True).start()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    # Several ranks share a few cores: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    for module in preload:  # at start, not inside the first run's timeout
        importlib.import_module(module)
    _warm_up(torch, os.path.join(workdir, f"warmup{rank}"), backend)
    from harness._rank import intercept as _intercept

    tracker = _intercept.install()
    board = Writer(Board(os.path.join(workdir, "board"), world), rank)
    tracker.board = board
    global _CURRENT
    _CURRENT = _Rank(rank, world, conn, backend, board, tracker)
    if probe is not None:
        main = threading.get_ident()
        threading.Thread(
            target=_serve_probes,
            args=(probe, main, tracker, board),
            name="harness-probe",
            daemon=True,
        ).start()
    send(conn, Ready(pid=os.getpid()))
    _CURRENT.serve()


def _pin_to(cpu: int | None) -> None:
    """Run this process on ``cpu`` (the pool's choice: ``harness.pool._cpus``): every thread
    it has (the imports before this may have started some) and, through the main thread,
    every thread it starts from now on. A CPU the OS refuses (a cpuset changed since) leaves
    the process where it was."""
    if cpu is None:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # no /proc: the main thread, and what it starts
    for tid in threads:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(tid, {cpu})


#: Between the thread errors in a rank's ``rank<N>.threads`` file.
THREAD_ERROR_END = "\x1e\n"


class _ThreadErrors:
    """``threading.excepthook`` of a rank: a thread that raised (a data loader's worker
    whose failure leaves the main thread waiting on its queue for ever) is printed as
    Python would, and written to a file of the pool's directory, so the report of the hung
    run names it (``Run``): its first line, then its traceback."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.original = threading.excepthook

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        self.original(args)
        with contextlib.suppress(Exception):  # never fail in a hook
            name = args.thread.name if args.thread is not None else "(unknown)"
            exc = args.exc_value if args.exc_value is not None else args.exc_type()
            text = "".join(traceback.format_exception(args.exc_type, exc, args.exc_traceback))
            with open(self.path, "a") as f:
                f.write(f"thread {name!r} raised {exception_summary(exc)}\n{text}")
                f.write(THREAD_ERROR_END)


def _warm_up(torch: types.ModuleType, store_path: str, backend: str) -> None:
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
    RankState.save().restore()  # its first call imports for a second too


def _serve_probes(conn: Connection, main: int, tracker: Tracker, board: Writer) -> None:
    """Answer the pool's probes from a thread of its own, while the main thread runs (or
    waits): where the main thread is, whether inside torch, this process's CPU time and the
    run's counts. Asked only about ranks whose board slot cannot say enough (inside torch
    on something unseen, or waiting long); the main thread waiting has released the GIL, so
    the answer does not wait for it."""
    from harness._base.compat import current_frame, group_sequence_numbers
    from harness._rank.intercept import torch_dir

    while True:
        try:
            probe: Probe = receive(conn)
        except (EOFError, OSError):
            return
        frame = current_frame(main)
        where, in_torch = "", False
        if frame is not None:
            code = frame.f_code
            where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
            in_torch = code.co_filename.startswith(torch_dir())
        since = board.since
        counts = tracker.counts() if tracker.active else None
        groups = {name: ranks for name, (_, ranks) in group_sequence_numbers().items()}
        try:
            send(
                conn,
                Probed(
                    n=probe.n,
                    where=where,
                    in_torch=in_torch,
                    cpu=time.process_time(),
                    since=since if board.since == since else -1.0,
                    counts=counts,
                    groups=groups,
                ),
            )
        except (OSError, ValueError):
            return


class _Rank:
    """One rank's side of the protocol: a handler per event from the parent."""

    def __init__(
        self, rank: int, world: int, conn: Connection, backend: str, board: Writer, tracker: Tracker
    ) -> None:
        self.rank, self.world, self.conn, self.backend = rank, world, conn, backend
        self.board, self.tracker = board, tracker
        self.run_id: int | None = None
        self.saved: RankState | None = None
        self.ok = False

    def serve(self) -> None:
        while True:
            try:
                event = receive(self.conn)
            except (EOFError, OSError):
                return
            if isinstance(event, Stop):
                return
            try:
                getattr(self, handler_name(event))(event)
            except (EOFError, OSError):  # the parent is gone: nothing left to serve
                return

    def on_runcall(self, call: RunCall) -> None:
        self.run_id = call.run_id
        self.board.begin(call.run_id, time.monotonic())  # the pool now sees this rank started
        for p in call.sys_path:
            if p not in sys.path:
                sys.path.append(p)
        self.saved = RankState.save()
        ok, fields = _run_one(self.rank, self.world, call, self.backend, self.tracker)
        self.tracker.end()
        self.ok = ok
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        self.board.leave(time.monotonic(), State.RETURNED)
        # Keep the process group up until every rank is done: a rank that returned while
        # others still wait in a collective (it skipped one) must leave them hanging, as it
        # would in production, not break them by tearing down. (A rank whose function
        # raised has torn its group down already, to free peers blocked on it.)
        send(self.conn, Done(run_id=call.run_id, ok=ok, **fields))
        # Then put back what the run changed (RNG, dtype, cwd, environment...: none of it is
        # the group's), while the pool waits for the other ranks: a kept group then needs no
        # message at all before the next run (the pool sends a ``Release`` only to tear the
        # group down or prove it with the fence), and on a loaded machine each message is a
        # wake-up of every rank, on the pool's path between two tests.
        self.run_id = None
        if self.saved is not None:
            self.saved.restore()
            self.saved = None

    def on_fence(self, fence: Fence) -> None:
        """Every rank returned and what this rank left in flight is matched: wait for it."""
        send(self.conn, Fenced(run_id=fence.run_id, pending=self.tracker.settle(fence.grace)))

    def on_release(self, release: Release) -> None:
        """The run is over: keep the group for the next run (after proving it still pairs
        every rank, if asked) or tear it down. Not sent for a kept group the counts alone
        prove: the next ``RunCall`` (``reuse``) is its release."""
        ok, detail = True, ""
        if release.keep and release.verify:
            ok, detail = _verify_group(release.run_id, self.world)
        # Answer first, then tear down: the parent returns the run's results meanwhile, and
        # the next run's message waits in the pipe until this rank is done. Only a fence
        # is answered: the pool reads nothing else (``Run.verified``), and an
        # answer nobody reads is a write, a wake-up and a stale event for the next run.
        if release.verify:
            send(self.conn, Released(run_id=release.run_id, ok=ok, detail=detail))
        self.board.leave(time.monotonic(), State.IDLE)
        if not (release.keep and ok and self.ok):
            _end_group()  # the state the run changed was put back when it returned


def _verify_group(run_id: int, world: int) -> tuple[bool, str]:
    """One all-reduce of (run id, 1) on the default group, with a short deadline: a group
    whose ranks are out of step (a collective left pending somewhere) fails it, and so does
    one that pairs this rank with another run's fence (a different run id)."""
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


def _could_not_join(exc: Exception) -> dict[str, Any]:
    """What a rank that failed to join the run's process group reports. Joining is the
    harness's work, not the user's: its frames stay out (``user_traceback``), and the
    summary keeps torch's message, so a rank that lost a peer still forming the group
    (one that joined, raised at once and left) reads as the consequence it is
    (``PEER_LOST``), listed after the rank that failed first."""
    return {
        "summary": f"could not join the process group: {exception_summary(exc)}",
        "detail": user_traceback(exc),
    }


def _run_one(
    rank: int, world: int, call: RunCall, backend: str, tracker: Tracker
) -> tuple[bool, dict[str, Any]]:
    # long: install the watchers, run, answer, uninstall: the order the protocol needs
    import torch.distributed as dist

    from harness._base.compat import group_sequence_numbers
    from harness._mutation.inject import INJECTOR

    try:
        where, payload = pickle.loads(call.payload)
        for module, file in where:
            _ensure_module(module, file)
        fn, args, kwargs = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001
        return False, {
            "summary": f"could not load the rank function on rank {rank}: {exc!r}. "
            "Rank processes import it by module and name: define it at module level "
            "in an importable module.",
            "detail": user_traceback(exc),
        }
    if not (call.reuse and dist.is_initialized()):
        _end_group()
        try:
            dist.init_process_group(
                backend,
                store=dist.FileStore(  # type: ignore[attr-defined]  # not in the stubs
                    call.store, world
                ),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=max(call.timeout * 2, 60)),
            )
        except Exception as exc:  # noqa: BLE001 - e.g. a peer that failed at once and left
            _end_group()
            return False, _could_not_join(exc)
    tracker.begin(call.mutation)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a rank's SystemExit is a failure too
        fields = {
            "summary": exception_summary(exc),
            "detail": user_traceback(exc),
            "phase": getattr(exc, "harness_phase", None),
        }
        counts = tracker.counts()
        leftovers, unseen = tracker.leftovers(), tracker.unseen(counts)
        tracker.end()
        if leftovers or unseen != 0:
            # Work of this rank may be in flight: tearing the group down would wait in it
            # (gloo joins its worker threads) until gloo's timeout. Leave it; the report
            # says so and the pool replaces this rank's process instead.
            groups = {name: ranks for name, (_, ranks) in group_sequence_numbers().items()}
            fields["report"] = Report(counts, groups, leftovers=leftovers, unseen=unseen)
            return False, fields
        # Tear the group down at once: peers blocked in a collective with this rank then
        # fail fast ("Connection closed by peer") instead of waiting for the timeout.
        _end_group()
        return False, fields
    counts = tracker.counts()
    report = Report(
        counts=counts,
        unseen=tracker.unseen(counts),
        groups={name: ranks for name, (_, ranks) in group_sequence_numbers().items()},
        leftovers=tracker.leftovers(),
        unwaited=tracker.unwaited(),
        sites=dict(INJECTOR.sites),
    )
    try:
        data = wire.dumps(result)  # plain CPU tensors as their bytes, not torch.save each
    except Exception as exc:  # noqa: BLE001
        return False, {
            "summary": f"PicklingProblem: rank {rank} returned a {type(result).__module__}."
            f"{type(result).__qualname__} that cannot be pickled ({exc}); return tensors, "
            "numbers, lists or dicts of them",
            "detail": user_traceback(exc),
            "report": report,
        }
    return True, {"result": data, "report": report}


def _end_group() -> None:
    """Destroy the default group (and with it every subgroup) and forget cached subgroups."""
    import torch.distributed as dist

    from harness.topology import clear_group_cache

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    clear_group_cache()
