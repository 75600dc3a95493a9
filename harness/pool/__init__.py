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
rank processes import torch after limiting their threads. The processes of one start (their
progress, logs, stacks and memory) are ``harness.pool._processes``; how a call is pickled for the
ranks is ``harness.pool._pickling``.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict, runtime_checkable

from harness._base.compat import stop_forkserver
from harness._base.deprecation import forward
from harness._mutation.catalogue import SiteStats
from harness._mutation.mode import current as mutant_mode
from harness._protocol.board import Board
from harness._protocol.events import RunCall, send_all
from harness.errors import ConfigError, HarnessWarning, UnwaitedWork
from harness.pool._cpus import PIN_MODES, check_pin, rank_cpus
from harness.pool._pickling import dump_call
from harness.pool._processes import (
    Processes,
    ProgressWatch,
    RankLogs,
    no_main_module,
    process_progress,
    rank_memory,
)
from harness.pool._run import DiedIdle, Run

__all__ = [
    "PIN_MODES",
    "PoolRegistry",
    "ProgressWatch",
    "RankLogs",
    "RankPool",
    "Runner",
    "keep_limits",
    "process_progress",
    "rank_memory",
    "shared_registry",
]

# Importable from here for older code (with a DeprecationWarning): it always ran on a rank.
__getattr__ = forward(__name__, {"report_progress": "harness._rank.loop"})

DEFAULT_TIMEOUT = 120.0
#: Shorter per-run timeouts are refused: starting a run on a loaded machine alone can take
#: longer, so they could only ever fail correct programs.
MIN_TIMEOUT = 1.0
#: How long healthy ranks get to finish after another rank raised, before they are taken to
#: be stuck in a collective with the failed rank and the pool is restarted.
ERROR_GRACE = 3.0
#: A rank may take as long as it needs to start (import torch, set up: minutes on a loaded
#: runner): its start fails only when it exits, or when the starting ranks have made no
#: progress (used no CPU time, were neither runnable nor in disk I/O) for this long.
START_STALL = 60.0
#: Where the OS does not say whether a process makes progress (no /proc): a fixed deadline.
START_TIMEOUT = 600.0
#: A deadlock proven from the ranks' evidence (``harness._protocol.deadlock``: a rank waits for a
#: peer
#: that returned without its part, ranks entered different collectives, or wait on each
#: other in a cycle) fails the run once the proof has held this long, instead of at the
#: timeout. 0 turns detection off.
DEADLOCK_WINDOW = 1.0
START_METHODS = ("spawn", "forkserver")

#: More rank processes than this many per core is refused unless asked for: they would
#: time-slice every collective and turn minutes into hours (and timeouts into false alarms).
OVERSUBSCRIBE_LIMIT = 4
_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    """The one owner of pool lifetimes at exit: every live pool, whoever made it, closes."""
    for pool in list(_LIVE_POOLS):
        pool.close()
    # The fork server would notice our exit within a second or so; stop it now, so that
    # nothing of ours is left running once this process is gone. (Only at exit: its
    # children are the ranks of live pools, which watch for being re-parented.)
    stop_forkserver()


@runtime_checkable
class Runner(Protocol):
    """What runs a function on every rank: a ``RankPool``, or under torchrun/srun the
    ``LauncherRunner`` that runs it in place. ``check_equivalence`` takes either."""

    world_size: int
    last_outputs: list[str]

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order, or a
        ``RankFailure`` naming every rank that failed."""
        ...


class RankPool:
    """``world_size`` warm rank processes that run a function together.

    Usage (``rank_fn`` a module-level function)::

        with RankPool(4) as pool:
            results = pool.run(rank_fn, 3, timeout=30)  # [rank 0's result, ..., rank 3's]

    Inside ``fn`` the default process group (gloo, world = pool size) is initialised.
    ``fn`` and its arguments are pickled, so ``fn`` must be importable by module and name
    (defined at module level). The pool starts on first use and restarts after a crash or a
    timeout. ``pin_ranks`` (``auto``, ``on``, ``off``): whether each rank runs on one CPU,
    the ranks in turn over the CPUs; ``auto`` pins where the pool has more ranks than CPUs,
    where collectives then cost about half (``harness.pool._cpus``).
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        start_method: str = "spawn",
        backend: str = "gloo",
        error_grace: float = ERROR_GRACE,
        deadlock_window: float = DEADLOCK_WINDOW,
        preload: Sequence[str] = (),
        pin_ranks: str = "auto",
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"RankPool needs world_size >= 1, got {world_size!r}")
        if start_method not in START_METHODS:
            raise ConfigError(
                f"start_method {start_method!r} is not supported; use one of {START_METHODS} "
                "(plain fork after torch is imported can deadlock the ranks)"
            )
        self.world_size = world_size
        self.timeout = check_seconds(timeout, "timeout", minimum=MIN_TIMEOUT)
        self.start_method = start_method
        self.backend = backend
        self.error_grace = error_grace
        if deadlock_window < 0:
            raise ConfigError(
                f"deadlock_window must be >= 0 seconds (0: off), got {deadlock_window!r}"
            )
        self.deadlock_window = float(deadlock_window)
        self.preload = tuple(preload)
        #: ``auto``: each rank pinned to a CPU where there are more ranks than CPUs
        #: (``harness.pool._cpus``); ``on``: always; ``off``: never
        self.pin_ranks = check_pin(pin_ranks)
        self.starts = 0  # how many times the processes were (re)started
        self.runs = 0
        self.last_outputs: list[str] = [""] * world_size
        self._ranks: Processes | None = None
        #: the ``Background`` runs handed this pool and not ended (``busy`` from the moment
        #: one is made, before its thread takes the pool's lock)
        self._claims: set[int] = set()
        # After a run that every rank finished cleanly, the next run reuses its process group
        # and cached subgroups (saves ~50 ms a run, more with many subgroups); after any
        # failure the ranks build a fresh group, so a broken one can never be reused.
        self._group_ok = False
        self._verifying: Run | None = None  # a kept run whose fence answers are not read yet
        #: --spatial-mutants: the call sites the last run's ranks recorded, in a recording
        #: run (its ``MutantMode``, ``harness._mutation.mode``, comes from the caller's context)
        self.last_sites: list[dict[str, SiteStats]] = []
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
        """The pool's rank processes are started and every one of them is running."""
        return self._ranks is not None and self._ranks.alive

    @property
    def busy(self) -> bool:
        """A run is under way on the pool, or handed to a thread that is about to run it
        (``harness.pool.overlap.Background``: a sweep's layouts of other world sizes,
        ``harness.layouts``); ``PoolRegistry`` never closes a busy pool."""
        return self._lock.locked() or bool(self._claims)

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids in rank order (empty before the pool starts)."""
        return [p.pid for p in self._ranks.procs] if self._ranks else []

    def memory_kib(self) -> list[tuple[int, int]] | None:
        """``(RSS, PSS)`` in KiB of each rank process (``rank_memory``); ``None`` when the
        pool is not started or the OS does not say."""
        mem = [rank_memory(pid) for pid in self.pids]
        if not mem or any(m is None for m in mem):
            return None
        return [m for m in mem if m is not None]

    @property
    def workdir(self) -> str | None:
        """The pool's temporary directory (rendezvous files, logs, the board), while started."""
        return self._ranks.workdir if self._ranks else None

    def start(self) -> None:
        """Start the rank processes (no-op if they are running)."""
        if self.alive:
            return
        self._kill()
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The server imports torch (and the modules asked for) once; each rank is then a
            # cheap fork of it. The server is one per process: a second preload list only
            # applies to a server started later, so ranks import the list again (cheap when
            # the server has it already).
            ctx.set_forkserver_preload(["harness._rank.preload", *self.preload])
        workdir = tempfile.mkdtemp(prefix=f"harness-pool{self.world_size}-")
        self._ranks = Processes(self.world_size, workdir)
        with no_main_module():
            cpus = rank_cpus(self.world_size, self.pin_ranks)
            self._ranks.spawn(ctx, os.getpid(), self.backend, self.preload, cpus)
        self._ranks.await_ready(ProgressWatch(START_STALL, fallback=START_TIMEOUT))
        self.starts += 1

    def close(self) -> None:
        """Stop every rank process and remove the pool's temporary directory."""
        if self._ranks is not None:
            self._ranks.close()
        self._kill()

    def _kill(self) -> None:
        if self._ranks is not None:
            self._ranks.kill()
            self._ranks = None
        self._group_ok = False
        self._verifying = None

    # ------------------------------------------------------------------ running

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises ``RankError`` (a rank raised), ``RankCrash`` (a rank died), ``RankTimeout``
        (the run took longer than ``timeout`` seconds; every rank's stack is attached),
        ``RankDeadlock`` (a ``RankTimeout`` proven before the timeout: ranks wait for a peer
        that returned without its part, or for each other) or ``RankPending`` (every rank
        returned, but an operation was left that can never complete), each a
        ``RankFailure`` listing every rank's problem. ``PicklingProblem`` if ``fn``, its
        arguments or a result cannot cross the process boundary. A rank that died while
        idle is replaced, silently, and the run goes to fresh processes. Work that completed
        but was never waited on is not a failure: it is warned about (``UnwaitedWork``).
        """
        __tracebackhide__ = True
        return self._run_pickled(dump_call(fn, args, kwargs), timeout)

    def _run_pickled(self, payload: bytes, timeout: float | None = None) -> list[Any]:
        """``run`` of a call already pickled (``harness.pool._pickling.dump_call``): taken
        where it was pickled, as its arguments were then (``harness.pool.overlap``: pickled
        in the calling thread, before serial work there may change them)."""
        __tracebackhide__ = True
        timeout = (
            self.timeout
            if timeout is None
            else check_seconds(timeout, "timeout", minimum=MIN_TIMEOUT)
        )
        with self._lock:
            for attempt in (1, 2):
                run = self._begin(payload, timeout)  # starts the ranks if they are not alive
                try:
                    results, clean = run.collect()
                except DiedIdle:
                    self._kill()  # killed from outside between runs: not this run's fault
                    if attempt == 2:
                        raise
                    continue
                except BaseException:
                    # KeyboardInterrupt or a bug here: never leave ranks running behind us.
                    if self.alive and run.pending:
                        self._kill()
                    raise
                finally:
                    self.last_outputs = run.outputs
                self._group_ok = clean.keep
                self._verifying = run if clean.verify else None
                self.last_sites = [r.sites for r in run.reports.values() if r.sites]
                _warn_unwaited(clean.unwaited)
                return results
        raise AssertionError("unreachable")

    def _settle_fence(self) -> None:
        """Read the answers of the last kept run's fence (see ``Run.prove_clean``): a group not
        proven in step is not reused, and its ranks are replaced."""
        previous, self._verifying = self._verifying, None
        if previous is None or not self._group_ok:
            return
        ok, detail = previous.verified()
        if not ok:
            import warnings

            self._group_ok = False
            warnings.warn(
                HarnessWarning(
                    f"run {previous.run_id} left the process groups out of step although "
                    f"every rank's counts matched ({detail}); the next run starts on fresh "
                    "ranks. Please report this with the test that ran it."
                ),
                stacklevel=3,
            )
            # ranks that no longer answer, or whose fence collective failed or timed out
            # (it may still be in flight: tearing its group down would wait in it until
            # gloo's timeout, through the next run), are replaced
            self._kill()

    def _begin(self, payload: bytes, timeout: float) -> Run:
        self._settle_fence()
        if not self.alive:
            self.start()
        ranks = self._ranks
        assert ranks is not None
        self.runs += 1
        run = Run(
            ranks,
            self.runs,
            timeout,
            error_grace=self.error_grace,
            deadlock_window=self.deadlock_window,
        )
        reuse = self._group_ok
        run.reused = reuse
        self._group_ok = False
        call = RunCall(
            run_id=run.run_id,
            payload=payload,
            store=os.path.join(ranks.workdir, f"store-{run.run_id}"),
            sys_path=list(sys.path),
            timeout=timeout,
            reuse=reuse,
            mutation=mutant_mode(),
        )
        # a rank that died since the last run has its pipe closed: its sentinel tells the
        # run, which then starts afresh
        send_all(ranks.conns, call)
        return run

    def discard(self) -> None:
        """Stop the rank processes now; the next run starts brand-new ones."""
        with self._lock:
            self.close()

    # ------------------------------------------------------------------ diagnostics

    @property
    def logs(self) -> RankLogs:
        """What the ranks wrote to the pool's directory (output, crash traces, stacks)."""
        assert self._ranks is not None, "the pool is not started"
        return self._ranks.logs

    @property
    def board(self) -> Board:
        """What each rank is doing now (``harness._protocol.board``), while started."""
        assert self._ranks is not None, "the pool is not started"
        return self._ranks.board


def check_seconds(value: Any, what: str, *, minimum: float = MIN_TIMEOUT) -> float:
    """A finite number of seconds ``>= minimum``, or one clear error naming ``what``."""
    import math

    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < minimum:
        raise ConfigError(
            f"{what} must be a finite number of seconds >= {minimum:g}, got {value!r}; "
            f"e.g. {what}={DEFAULT_TIMEOUT:g}"
        )
    return seconds


def _warn_unwaited(unwaited: Sequence[tuple[int, Any]]) -> None:
    """One warning per operation (by call site) that completed without anyone waiting on
    it: not a failure (it matched and finished), but a race on backends that do not
    finish an operation before its tensor is used (NCCL)."""
    import warnings

    by_site: dict[tuple[str, str], list[int]] = {}
    for rank, op in unwaited:
        by_site.setdefault((op.op, op.site), []).append(rank)
    for (name, site), ranks in by_site.items():
        warnings.warn(
            UnwaitedWork(
                f"rank {', '.join(map(str, sorted(set(ranks))))}: {name}"
                f"{' issued at ' + site if site else ''} was never waited on: its work "
                "completed, but nothing ordered the rank's use of its tensors after it. Call "
                "work.wait() (or use async_op=False) before reading or reusing them; on NCCL "
                "this is a race."
            ),
            stacklevel=3,
        )


def check_oversubscription(ranks: int, *, allow: bool = False, how: str = "allow=True") -> None:
    """Refuse far more rank processes than cores, unless ``allow``.

    Up to ``OVERSUBSCRIBE_LIMIT`` per core (and at least 8) is fine: ranks mostly wait in
    collectives. Beyond that every collective time-slices and the timeouts turn into false
    alarms, so it is an error that says how to insist (``how``).
    """
    cores = os.cpu_count() or 1
    limit = max(8, OVERSUBSCRIBE_LIMIT * cores)
    if ranks > limit and not allow:
        raise ConfigError(
            f"{ranks} rank processes on a machine with {cores} CPU core(s) is more than "
            f"{OVERSUBSCRIBE_LIMIT} per core ({limit}): every collective would time-slice and "
            f"runs would crawl into their timeouts. Use fewer ranks, or {how} to insist."
        )


class PoolRegistry:
    """One warm ``RankPool`` per world size, made on first use, closed together.

    Pools of several sizes stay alive at once (a layout sweep, or tests of 2, 3 and 4
    ranks, start each once), within two caps, by closing the least recently used pool:

    - ``max_processes``: rank processes alive in all (a session that uses 1, 2, 3 and 4
      ranks should not hold ten processes on a two-core machine);
    - ``memory_budget_mib`` (``None``: no budget): the proportional memory (PSS, from
      ``/proc``; pages shared with the fork server counted once, split between the ranks
      sharing them) of every idle rank, plus the new pool's estimate (its size times the
      median rank's), in MiB. Measured only when a new pool is made, never on a warm
      ``get``. Where the OS does not say (no ``/proc``), only ``max_processes`` applies.

    With ``start_method="forkserver"`` every pool's ranks are forks of the one fork server
    of this process, whatever their world size: torch is imported once.
    """

    def __init__(
        self,
        *,
        default_ranks: int = 4,
        timeout: float = DEFAULT_TIMEOUT,
        start_method: str = "spawn",
        max_processes: int = 8,
        deadlock_window: float = DEADLOCK_WINDOW,
        preload: Sequence[str] = (),
        memory_budget_mib: float | None = None,
        pin_ranks: str = "auto",
    ) -> None:
        if memory_budget_mib is not None and not memory_budget_mib > 0:
            raise ConfigError(
                f"memory_budget_mib must be a positive number of MiB (or None: no budget), "
                f"got {memory_budget_mib!r}; an idle rank holds ~40 MiB of its own"
            )
        self.default_ranks = default_ranks
        self.timeout = timeout
        self.start_method = start_method
        self.deadlock_window = deadlock_window
        self.preload = tuple(preload)
        self.pin_ranks = check_pin(pin_ranks)
        self.max_processes = max(max_processes, default_ranks)
        self.memory_budget_mib = memory_budget_mib
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        """The warm pool of ``world_size`` ranks, made on first use; closes the least
        recently used pools beyond ``max_processes`` or ``memory_budget_mib``."""
        pool = self._pools.pop(world_size, None)
        made = pool is None
        if pool is None:
            pool = RankPool(
                world_size,
                timeout=self.timeout,
                start_method=self.start_method,
                deadlock_window=self.deadlock_window,
                preload=self.preload,
                pin_ranks=self.pin_ranks,
            )
        self._pools[world_size] = pool  # most recently used last
        while sum(p.world_size for p in self._pools.values()) > self.max_processes:
            if not self._close_oldest(world_size):
                break
        if made and self.memory_budget_mib is not None:
            self._fit_memory(pool)
        return pool

    def _close_oldest(self, keep: int) -> bool:
        """Close the least recently used pool that is neither ``keep`` nor busy (a run under
        way on it: a concurrent sweep's other world sizes); ``False`` where none is."""
        oldest = next((w for w, p in self._pools.items() if w != keep and not p.busy), None)
        if oldest is None:
            return False
        self._pools.pop(oldest).close()
        return True

    def _fit_memory(self, new: RankPool) -> None:
        """Close the least recently used pools until the idle ranks' PSS and the new pool's
        estimate fit ``memory_budget_mib`` (measured only here: reading ``/proc`` costs a
        millisecond or so a rank, too much for every warm ``get``)."""
        assert self.memory_budget_mib is not None
        while len(self._pools) > 1:
            per_rank = {
                size: [pss for _, pss in mem]
                for size, p in self._pools.items()
                if p is not new and (mem := p.memory_kib()) is not None
            }
            if not per_rank:
                return  # nothing measurable: the process cap alone applies
            known = sorted(kib for ranks in per_rank.values() for kib in ranks)
            median = known[len(known) // 2]
            mem = new.memory_kib()
            estimate = sum(p for _, p in mem) if mem else median * new.world_size
            used = sum(known) + estimate
            if used / 1024 <= self.memory_budget_mib or not self._close_oldest(new.world_size):
                return  # within the budget, or every other pool is running: over it for now

    def memory_kib(self) -> dict[int, list[tuple[int, int]]]:
        """Each live pool's ranks' memory now: world size -> ``(RSS, PSS)`` in KiB per rank
        (``harness.pool.rank_memory``); pools not started, or where ``/proc`` does not say,
        are left out."""
        out = {}
        for size, pool in sorted(self._pools.items()):
            mem = pool.memory_kib()
            if mem is not None:
                out[size] = mem
        return out

    @property
    def live(self) -> list[int]:
        """The world sizes of the pools kept, least recently used first."""
        return list(self._pools)

    def close(self) -> None:
        """Close every pool kept."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_SHARED: PoolRegistry | None = None


def shared_registry() -> PoolRegistry:
    """The process-wide pools ``check_equivalence`` and ``check_layouts`` use when given none
    (outside pytest).

    forkserver: torch is imported once and each rank forks from it (~0.1 s, not ~6 s).
    Pools of every size a sweep uses stay alive within ``default_memory_budget_mib`` (a
    second sweep, or a check after one, starts none); where the memory cannot be read, at
    most 8 rank processes are kept.
    """
    global _SHARED
    if _SHARED is None:
        # its pools close at exit with all
        _SHARED = PoolRegistry(start_method="forkserver", **keep_limits())
    return _SHARED


class KeepLimits(TypedDict):
    max_processes: int
    memory_budget_mib: float | None


def keep_limits() -> KeepLimits:
    """How many idle ranks a registry that serves sweeps keeps (the shared one, the
    plugin's, ``harness-check``'s): every layout up to 8 ranks within a quarter of the free
    memory; 8 processes where the memory cannot be read."""
    budget = default_memory_budget_mib()
    most = SHARED_MAX_PROCESSES if budget is not None else 8
    return {"max_processes": most, "memory_budget_mib": budget}


#: the most rank processes the shared pools keep when a memory budget caps them: every
#: layout up to 8 ranks (36 processes), idle
SHARED_MAX_PROCESSES = 40


def default_memory_budget_mib() -> float | None:
    """A quarter of the memory available now (``MemAvailable`` of ``/proc/meminfo``), in
    MiB: what idle warm ranks may hold; ``None`` where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024 / 4
    except (OSError, ValueError, IndexError):
        pass
    return None
