"""The parent's side of one run of a ``RankPool``: events in, verdict out.

A ``Run`` sends the function to every rank, handles each rank's events (``on_started``,
``on_progress``, ``on_done``, ``on_fenced``, ``on_released``: one handler per event of
``harness._rank``), notices deaths through the process sentinels, and ends in one of:

- every rank returned and the group is proven clean: the results, in rank order;
- a rank raised, died, hung, or left an operation in flight: a ``RankFailure`` naming every
  rank (its traceback or stack, its phase, and for a hang which ranks had returned when);
- a rank that died while idle, before it saw the run: ``DiedIdle``, which the pool answers
  by starting fresh processes and running again.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, NoReturn

from harness._rank import FENCE_GRACE, VERIFY_TIMEOUT, receive, send
from harness.errors import RankProblem, failure_from

if TYPE_CHECKING:
    from harness.pool import RankPool

#: How long the parent waits for the fence and release answers beyond the ranks' own
#: deadlines, before it takes a silent rank to be stuck (then the pool restarts).
FENCE_MARGIN = 10.0
#: Deadlock detection starts this far into a run (shorter runs never pay for it) and
#: probes the running ranks this often.
PROBE_AFTER = 0.5
PROBE_EVERY = 0.5


class DeadlockWatch:
    """Decides, from the ranks' probes, that a run can no longer finish.

    A running rank is *blocked* when its main thread sits inside a torch.distributed call
    and the operation count of its groups has not moved since the last probe. When every
    running rank has been blocked for ``window`` seconds (some ranks may have returned),
    nothing can complete any more: each waits for a peer that waits too, or that is gone.
    A rank that is computing (its main thread outside torch.distributed, or too busy to
    answer) is progress, so slow ranks never raise the alarm.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.next_probe = PROBE_AFTER
        self.blocked: dict[int, tuple[float, tuple[Any, str]]] = {}  # rank -> (since, state)
        self.stacks: dict[int, str] = {}

    def deadlocked(self, run: Run, elapsed: float) -> bool:
        if not self.window or elapsed < self.next_probe or run.problems:
            return False
        self.next_probe = elapsed + PROBE_EVERY
        running = sorted(run.pending)
        answers = run.pool._probe(running, timeout=PROBE_EVERY)
        for r in running:
            a = answers.get(r)
            if a is None or not a["waiting"] or a["operations"] is None:
                self.blocked.pop(r, None)
                continue
            state = (a["operations"], a["where"])
            since, before = self.blocked.get(r, (elapsed, state))
            self.blocked[r] = (since if before == state else elapsed, state)
            self.stacks[r] = a["stack"]
        return bool(running) and all(
            r in self.blocked and elapsed - self.blocked[r][0] >= self.window for r in running
        )


class DiedIdle(Exception):
    """A rank died before it saw the run (killed while idle): not the run's fault."""


class Run:
    """One call of ``RankPool.run``, from sending the function to the verdict."""

    def __init__(self, pool: RankPool, run_id: int, timeout: float) -> None:
        self.pool, self.run_id, self.timeout = pool, run_id, timeout
        self.n = pool.world_size
        self.t0 = time.monotonic()
        self.offsets = [pool.logs.size(r) for r in range(self.n)]
        self.pending = set(range(self.n))  # ranks that have not answered "done"
        self.started: set[int] = set()
        self.results: dict[int, Any] = {}
        self.problems: list[RankProblem] = []
        self.progress: dict[int, tuple[str, int | None]] = {}
        self.returned_at: dict[int, float] = {}
        self.fences: dict[int, tuple[list[str], dict[str, Any]]] = {}
        self.releases: dict[int, tuple[bool, str]] = {}
        self.first_failure: float | None = None
        self.crashed = False
        self.dead: set[int] = set()
        self.watch = DeadlockWatch(pool.deadlock_window)

    # ------------------------------------------------------------------ handlers

    def on_started(self, rank: int) -> None:
        self.started.add(rank)

    def on_progress(self, rank: int, phase: str, step: int | None) -> None:
        self.progress[rank] = (phase, step)

    def on_done(
        self,
        rank: int,
        ok: bool,
        result: bytes = b"",
        summary: str = "",
        detail: str = "",
        phase: str | None = None,
        in_flight: list[str] | None = None,
        sequences: dict[str, Any] | None = None,
    ) -> None:
        if ok:  # what the rank said at return; the fence asks again only if needed
            self.fences[rank] = (in_flight or [], sequences or {})
        self.pending.discard(rank)
        self.returned_at[rank] = time.monotonic() - self.t0
        self.pool._idle[rank] = True
        if not ok:
            self.fail(rank, "error", summary, detail, phase=phase)
            return
        try:
            self.results[rank] = pickle.loads(result)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure
            self.fail(rank, "error", f"result could not be unpickled: {exc!r}")

    def on_fenced(self, rank: int, pending: list[str], sequences: dict[str, Any]) -> None:
        self.fences[rank] = (pending, sequences)

    def on_released(self, rank: int, ok: bool, detail: str) -> None:
        self.releases[rank] = (ok, detail)

    def fail(
        self, rank: int, kind: str, summary: str, detail: str = "", phase: str | None = None
    ) -> None:
        where, step = self.progress.get(rank, ("", None))
        if phase and phase != where:  # the exception knows better than the last report
            where, step = phase, _step_of(phase)
        self.problems.append(
            RankProblem(
                rank,
                kind,
                summary,
                detail,
                phase=where,
                step=step,
                seconds=time.monotonic() - self.t0,
            )
        )
        if self.first_failure is None:
            self.first_failure = time.monotonic()

    # ------------------------------------------------------------------ the loop

    def poll(self, ranks: Iterable[int], seconds: float) -> None:
        """Wait up to ``seconds`` for events or deaths of ``ranks`` and handle them."""
        pool = self.pool
        ranks = sorted(ranks)
        waitables: list[Any] = []
        for r in ranks:
            waitables += [pool._conns[r], pool._procs[r].sentinel]
        ready = wait(waitables, timeout=max(0.0, seconds))
        for r in ranks:
            conn, proc = pool._conns[r], pool._procs[r]
            if conn in ready:
                # Drain every event first: a rank that said "started" and then died
                # must be seen as started.
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll():
                        event, fields = receive(conn)
                        if fields.pop("run_id", self.run_id) != self.run_id:
                            continue  # a late answer of an earlier, failed run
                        getattr(self, f"on_{event}")(r, **fields)
            if r not in self.dead and (proc.sentinel in ready or not proc.is_alive()):
                self.dead.add(r)
                self._died(r)

    def _died(self, rank: int) -> None:
        proc = self.pool._procs[rank]
        proc.join(0.5)
        if rank not in self.started:
            raise DiedIdle(rank)
        self.pending.discard(rank)
        self.crashed = True
        self.fail(rank, "crash", _describe_exit(proc.exitcode), self.pool.logs.crash(rank))

    def collect(self) -> list[Any]:
        """Wait for every rank's answer, then prove the group clean; the results or raise."""
        deadline = self.t0 + self.timeout
        while self.pending:
            now = time.monotonic()
            if now >= deadline:
                break
            if self.first_failure is not None and (
                self.crashed or now - self.first_failure >= self.pool.error_grace
            ):
                break
            if self.watch.deadlocked(self, now - self.t0):
                name_the_stuck(self, deadlock=True)
            self.poll(self.pending, min(0.2, deadline - now))
        if self.pending:
            name_the_stuck(self)
        if self.problems:
            self.release_all(keep=False)
            if self.crashed:
                self.pool._kill()
            raise self.failure()
        return prove_clean(self)

    # ------------------------------------------------------------------ the fence

    def await_answers(self, answers: dict[int, Any], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while len(answers) < self.n and time.monotonic() < deadline and not self.crashed:
            self.poll(set(range(self.n)) - set(answers), deadline - time.monotonic())
        if len(answers) < self.n:
            silent = sorted(set(range(self.n)) - set(answers) - self.dead)
            for r in silent:
                self.fail(
                    r,
                    "pending",
                    "did not answer the pool after returning (stuck in "
                    "an operation left in flight?)",
                )
            self.pool._kill()
            raise self.failure()

    def send_all(self, event: str, **fields: Any) -> None:
        for conn in self.pool._conns:
            with contextlib.suppress(OSError):
                send(conn, event, run_id=self.run_id, **fields)

    def release_all(self, *, keep: bool, verify: bool = False) -> None:
        """Every rank that answered waits for this, error or not."""
        for r, conn in enumerate(self.pool._conns):
            if r in self.returned_at:
                with contextlib.suppress(OSError):
                    send(conn, "release", run_id=self.run_id, keep=keep, verify=verify)

    # ------------------------------------------------------------------ the verdict

    def attach_outputs(self) -> None:
        outputs = [self.pool._read_log(r, self.offsets[r]) for r in range(self.n)]
        self.pool.last_outputs = outputs
        for p in self.problems:
            p.output = outputs[p.rank]

    def failure(self) -> Exception:
        self.attach_outputs()
        return failure_from(self.problems, self.n, self.timeout)


def name_the_stuck(run: Run, *, deadlock: bool = False) -> NoReturn:
    """Ranks still running at the deadline, deadlocked, or left after another failed:
    name everyone."""
    pool = run.pool
    stuck = sorted(run.pending)
    stacks = pool._dump_stacks(stuck)
    waited = time.monotonic() - run.t0
    kind = "deadlock" if deadlock else "stopped" if run.problems else "timeout"
    for r in stuck:
        if kind == "deadlock":
            where = run.watch.blocked[r][1][1]
            why = (
                f"waiting inside torch.distributed for {run.watch.window:g}s with no "
                f"operation completing on any of its groups ({waited:.1f}s into the run; "
                f"at {where})"
            )
            stack = run.watch.stacks.get(r) or stacks.get(r, "")
        elif kind == "timeout":
            why = f"still running after {waited:.1f}s (timeout {run.timeout:g}s)"
        else:
            why = "still running after another rank failed (waiting in a collective?)"
        if kind != "deadlock":
            stack = stacks.get(r, "")
        run.fail(r, kind, why, stack or "(no stack collected)")
    if kind in ("timeout", "deadlock"):
        for r in sorted(run.returned_at, key=run.returned_at.__getitem__):
            if r in run.results:
                t = run.returned_at[r]
                last = run.progress.get(r, ("", None))[0]
                run.problems.append(
                    RankProblem(
                        r,
                        "returned",
                        f"returned without error after {t:.2f}s while rank(s) "
                        f"{', '.join(map(str, stuck))} still waited: the likely culprit "
                        "(did it skip a collective the others entered?)",
                        f"rank {r} finished its function {t:.2f}s into the run"
                        + (f"; the last phase it reported was {last!r}" if last else "")
                        + "; the waiting ranks' stacks show the collective it never entered.",
                        phase=last,
                        seconds=t,
                    )
                )
    pool._kill()  # ranks stuck in a collective cannot be reused: start afresh next run
    run.attach_outputs()
    raise run.failure()


def prove_clean(run: Run) -> list[Any]:
    """Every rank returned: prove the group clean before the next run may reuse it.

    Operations a rank started and left in flight fail the run (they would be matched by
    the next run's operations, or hang it). Operation counts that differ between the
    members of a group, with nothing tracked in flight, are legitimate (an uneven
    point-to-point pattern, a halo exchange with edge ranks) or untracked: either way
    the next run gets a fresh group. Equal counts: one fence collective with the run id
    and a short deadline, then the group is kept.
    """
    everyone = range(run.n)
    if any(in_flight for in_flight, _ in run.fences.values()):
        # In flight at return: an isend may only complete once its peer, returning
        # later, has received it. Ask again, now that every rank has returned.
        run.fences.clear()
        run.send_all("fence")
        run.await_answers(run.fences, FENCE_GRACE + FENCE_MARGIN)
    pending = {r: f[0] for r, f in run.fences.items() if f[0]}
    if pending:
        for r, ops in sorted(pending.items()):
            more = f" (and {len(ops) - 1} more)" if len(ops) > 1 else ""
            run.problems.append(
                RankProblem(
                    r,
                    "pending",
                    f"{ops[0]}{more} never completed",
                    "\n".join(ops),
                    seconds=run.returned_at.get(r),
                )
            )
        run.release_all(keep=False)
        raise run.failure()
    keep = _consistent(run.fences[r][1] for r in everyone)
    run.release_all(keep=keep, verify=keep)
    if keep:
        run.await_answers(run.releases, VERIFY_TIMEOUT + FENCE_MARGIN)
        bad = {r: d for r, (ok, d) in run.releases.items() if not ok}
        if bad:
            for r, detail in sorted(bad.items()):
                run.problems.append(
                    RankProblem(r, "pending", "the process group was left out of step: " + detail)
                )
            raise run.failure()
    run.pool._group_ok = keep
    run.attach_outputs()
    return [run.results[r] for r in everyone]


def _consistent(reports: Iterable[dict[str, Any]]) -> bool:
    """Did the members of every group issue the same number of operations on it?"""
    seen: dict[str, set[int]] = {}
    for sequences in reports:
        for name, (seq, _ranks) in sequences.items():
            seen.setdefault(name, set()).add(seq)
    return all(len(counts) == 1 for counts in seen.values())


def _step_of(phase: str) -> int | None:
    """``"step 3 forward"`` -> 3."""
    parts = phase.split()
    if len(parts) >= 2 and parts[0] == "step" and parts[1].isdigit():
        return int(parts[1])
    return None


def _describe_exit(code: int | None) -> str:
    import signal

    if code is None:
        return "process died (exit status unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process killed by {name}"
    return f"process exited with code {code}"
