"""The parent's side of one run of a ``RankPool``: events in, verdict out.

A ``Run`` sends the function to every rank, handles each rank's events (``on_done``,
``on_fenced``, ``on_released``, ``on_probed``: one handler per event of
``harness._protocol.events``),
notices deaths through the process sentinels, watches the ranks' notice board for a
deadlock (``harness.pool._watch.DeadlockWatch``, which feeds the pure rule of
``harness._protocol.deadlock``),
and ends in one of:

- every rank returned and the groups are proven clean: the results, in rank order;
- a rank raised, died, hung, or left an operation that can never complete: a ``RankFailure``
  naming every rank (its traceback or stack, its phase, and for a deadlock the evidence);
- a rank that died while idle, before it saw the run: ``DiedIdle``, which the pool answers
  by starting fresh processes and running again.

A ``Run`` sees the pool only through ``Ranks``: the processes' pipes, sentinels, board and
logs, and a way to kill them all. It never touches the pool itself.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterable, Sequence
from multiprocessing.connection import wait
from typing import Any

from harness._protocol import deadlock as deadlock
from harness._protocol.board import Slot
from harness._protocol.deadlock import Counts, Op
from harness._protocol.events import (
    Done,
    Fence,
    Fenced,
    Probed,
    Release,
    Released,
    Report,
    handler_name,
    receive,
    send,
    send_all,
)
from harness._rank.loop import VERIFY_TIMEOUT as _VERIFY_TIMEOUT
from harness.errors import RankProblem, failure_from
from harness.pool._watch import CHECK_EVERY, DeadlockWatch, Ranks, _skipped_here, name_the_stuck

#: How long the parent waits for the fence and release answers beyond the ranks' own
#: deadlines, before it takes a silent rank to be stuck (then the pool restarts).
FENCE_MARGIN = 10.0
#: Operations every member has entered (or a send whose receive was posted) complete by
#: themselves: after every rank returned, they get this long (at most the run's time left).
FENCE_WAIT = 30.0


class DiedIdle(Exception):
    """A rank died before it saw the run (killed while idle): not the run's fault."""


class Run:
    """One call of ``RankPool.run``, from sending the function to the verdict."""

    def __init__(
        self,
        ranks: Ranks,
        run_id: int,
        timeout: float,
        *,
        error_grace: float,
        deadlock_window: float,
    ) -> None:
        self.ranks, self.run_id, self.timeout = ranks, run_id, timeout
        self.error_grace = error_grace
        self.n = ranks.world_size
        self.t0 = time.monotonic()
        self.offsets = [ranks.log_size(r) for r in range(self.n)]
        self.thread_offsets = [ranks.log_size(r, "threads") for r in range(self.n)]
        self.pending = set(range(self.n))  # ranks that have not answered "done"
        self.results: dict[int, Any] = {}
        self.reports: dict[int, Report] = {}
        self.problems: list[RankProblem] = []
        self.returned_at: dict[int, float] = {}
        self.fenced: dict[int, list[Op]] = {}
        self.releases: dict[int, tuple[bool, str]] = {}
        self.first_failure: float | None = None
        self.crashed = False
        self.dead: set[int] = set()
        self.outputs: list[str] = [""] * self.n
        self.outputs_read = False
        self.keep = False  # may the next run reuse the process groups?
        self.reused = False  # did this run start on the groups of the run before?
        self.verify = False  # was the fence collective asked for?
        self.unwaited: list[tuple[int, Op]] = []
        self.probe_groups: dict[str, tuple[int, ...]] = {}
        self.watch = DeadlockWatch(deadlock_window)

    # ------------------------------------------------------------------ handlers

    def on_done(self, rank: int, done: Done) -> None:
        self.pending.discard(rank)
        self.returned_at[rank] = time.monotonic() - self.t0
        if done.report is not None:
            self.reports[rank] = done.report
        if not done.ok:
            self.fail(rank, "error", done.summary, done.detail, phase=done.phase)
            return
        try:
            self.results[rank] = pickle.loads(done.result)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure
            self.fail(rank, "error", f"result could not be unpickled: {exc!r}")

    def on_fenced(self, rank: int, fenced: Fenced) -> None:
        self.fenced[rank] = fenced.pending

    def on_released(self, rank: int, released: Released) -> None:
        self.releases[rank] = (released.ok, released.detail)

    def on_probed(self, rank: int, probed: Probed) -> None:
        self.probe_groups.update(probed.groups)
        self.watch.answer(rank, probed, time.monotonic() - self.t0)

    def groups(self, slots: dict[int, Slot] | None = None) -> dict[str, tuple[int, ...]]:
        """Every process group the ranks said they belong to -> its global ranks (from their
        reports, probe answers, and the board slots of ranks waiting on one)."""
        out = {s.group: s.members for s in (slots or {}).values() if s.waiting and s.members}
        out.update(self.probe_groups)
        for report in self.reports.values():
            out.update(report.groups)
        return out

    def fail(
        self, rank: int, kind: str, summary: str, detail: str = "", phase: str | None = None
    ) -> None:
        slot = self.ranks.board.read(rank)
        where, step = (slot.phase, slot.step) if slot.run_id == self.run_id else ("", None)
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
        """Wait up to ``seconds`` for events or deaths of ``ranks`` (and probe answers from
        any rank) and handle them."""
        pool = self.ranks
        ranks = sorted(ranks)
        waitables: list[Any] = list(pool.probes)
        for r in ranks:
            waitables += [pool.conns[r], pool.procs[r].sentinel]
        ready = wait(waitables, timeout=max(0.0, seconds))
        for r, probe in enumerate(pool.probes):
            if probe in ready:
                with contextlib.suppress(EOFError, OSError):
                    while probe.poll():
                        self.on_probed(r, receive(probe))
        for r in ranks:
            conn, proc = pool.conns[r], pool.procs[r]
            if conn in ready:
                # Drain every event first: a rank that answered and then died must be seen
                # as having answered.
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll():
                        event = receive(conn)
                        if getattr(event, "run_id", self.run_id) != self.run_id:
                            continue  # a late answer of an earlier, failed run
                        getattr(self, handler_name(event))(r, event)
            # ``wait`` returns every object ready at once: a sentinel not among them is a
            # live process (asking ``is_alive`` again is a wait of its own per rank)
            if r not in self.dead and proc.sentinel in ready:
                self.dead.add(r)
                self._died(r)

    def _died(self, rank: int) -> None:
        proc = self.ranks.procs[rank]
        proc.join(0.5)
        if self.ranks.board.read(rank).run_id != self.run_id and rank in self.pending:
            raise DiedIdle(rank)
        self.pending.discard(rank)
        self.crashed = True
        summary = _describe_exit(proc.exitcode) + _skipped_here(self, rank)
        self.fail(rank, "crash", summary, self.ranks.crash_log(rank))

    def collect(self) -> list[Any]:
        """Wait for every rank's answer, then prove the groups clean; the results or raise."""
        __tracebackhide__ = True  # pytest: the failure is the rank's, not ours
        deadline = self.t0 + self.timeout
        while self.pending:
            now = time.monotonic()
            if now >= deadline:
                break
            if self.first_failure is not None and (
                self.crashed or now - self.first_failure >= self.error_grace
            ):
                break
            verdict = self.watch.check(self, now - self.t0)
            if verdict is not None:
                name_the_stuck(self, verdict)
            self.poll(self.pending, min(CHECK_EVERY, deadline - now))
        if self.pending:
            name_the_stuck(self, None)
        if self.problems:
            self.end_failed()
            raise self.failure()
        return prove_clean(self)

    # ------------------------------------------------------------------ the fence

    def await_answers(self, answers: dict[int, Any], ranks: Iterable[int], seconds: float) -> None:
        __tracebackhide__ = True
        ranks = set(ranks)
        deadline = time.monotonic() + seconds
        while ranks - set(answers) and time.monotonic() < deadline and not self.crashed:
            self.poll(ranks - set(answers), deadline - time.monotonic())
        silent = sorted(ranks - set(answers) - self.dead)
        if silent or self.crashed:
            for r in silent:
                self.fail(
                    r,
                    "pending",
                    "did not answer the pool after returning (stuck in "
                    "an operation left in flight?)",
                )
            self.kill()
            raise self.failure()

    def verified(self) -> tuple[bool, str]:
        """After a kept run: did the fence collective prove every group in step? Waits for
        the ranks' answers (they are usually in by the time the next run starts); never
        raises: a group not proven is simply not reused."""
        deadline = time.monotonic() + _VERIFY_TIMEOUT + FENCE_MARGIN
        everyone = set(range(self.n))
        while everyone - set(self.releases) and time.monotonic() < deadline:
            if self.dead or not all(p.is_alive() for p in self.ranks.procs):
                return False, "a rank died after the run"
            with contextlib.suppress(DiedIdle):
                self.poll(everyone - set(self.releases), deadline - time.monotonic())
        silent = sorted(everyone - set(self.releases))
        if silent:
            return False, f"rank {', '.join(map(str, silent))} did not answer the fence"
        bad = [f"rank {r}: {d}" for r, (ok, d) in sorted(self.releases.items()) if not ok]
        return (not bad), "; ".join(bad)

    def in_flight(self, *, seen: bool = True) -> list[int]:
        """Ranks that may still have work in flight on their groups: operations they
        issued that had not completed when they returned or raised (with ``seen``), or
        operations torch counted that the harness did not see one by one (issued from C++:
        nobody knows whether they completed), or counts that could not be read."""
        return sorted(
            r
            for r, rep in self.reports.items()
            if (seen and rep.leftovers) or rep.counts is None or rep.unseen != 0
        )

    def end_failed(self) -> None:
        """A failed run's ranks: torn down in place, or replaced where that could hang.

        Tearing a gloo group down waits for its worker threads, and a thread inside an
        operation that can never complete (a collective some members never entered) waits
        there until gloo's own timeout, twice the run's: the rank would sit in
        ``destroy_process_group`` through the next run, and its peers in that run's
        ``init_process_group``, so an innocent test would time out. Ranks that may have work
        in flight are therefore never torn down in place: the pool starts afresh."""
        if self.crashed or self.in_flight():
            self.kill()
        else:
            self.release_all(keep=False)

    def kill(self) -> None:
        """Stop every rank process, keeping what they printed for the report first (the
        pool's directory goes with them)."""
        self.attach_outputs()
        self.ranks.kill()

    def release_all(self, *, keep: bool, verify: bool = False) -> None:
        """Every rank that answered waits for this, error or not."""
        returned = [c for r, c in enumerate(self.ranks.conns) if r in self.returned_at]
        send_all(returned, Release(self.run_id, keep=keep, verify=verify))

    # ------------------------------------------------------------------ the verdict

    def attach_outputs(self) -> None:
        if not self.outputs_read:  # once: the logs are gone after a kill
            self.outputs = [self.ranks.read_log(r, self.offsets[r]) for r in range(self.n)]
            self.outputs_read = True
        for p in self.problems:
            p.output = self.outputs[p.rank]

    def failure(self, headline: str | None = None) -> Exception:
        self.attach_outputs()
        return failure_from(self.problems, self.n, self.timeout, headline=headline)


def prove_clean(run: Run) -> list[Any]:
    """Every rank returned: prove the groups clean before the next run may reuse them.

    Operations left in flight that can never complete (a collective some member never
    entered, a send nobody receives) fail the run at once: the next run would inherit them.
    Matched ones complete by themselves: the ranks wait for them (the fence). Then groups
    whose members issued the same collectives and matched every send are kept, after one
    fence collective with the run id proves them in step; any others are torn down.
    """
    # long: one pass over the end-of-run evidence, each leftover said where it is found
    __tracebackhide__ = True
    everyone = range(run.n)
    reports = [run.reports.get(r) for r in everyone]
    counts: dict[int, Counts] = {
        r: rep.counts for r, rep in enumerate(reports) if rep is not None and rep.counts is not None
    }
    groups = run.groups()
    leftovers = {r: rep.leftovers for r, rep in enumerate(reports) if rep and rep.leftovers}
    for r, ops in sorted(deadlock.unmatched(leftovers, counts, groups).items()):
        first, why = ops[0]
        more = f" (and {len(ops) - 1} more)" if len(ops) > 1 else ""
        run.problems.append(
            RankProblem(
                r,
                "pending",
                f"{first.describe()} can never complete: {why}{more}",
                "\n".join(f"{op.describe()}: {w}" for op, w in ops),
                seconds=run.returned_at.get(r),
            )
        )
    if run.problems:
        run.end_failed()  # what can never complete is in flight: fresh ranks next run
        raise run.failure()
    if leftovers:  # matched: they complete by themselves; wait for them
        grace = max(1.0, min(FENCE_WAIT, run.t0 + run.timeout - time.monotonic()))
        for r in leftovers:
            with contextlib.suppress(OSError):
                send(run.ranks.conns[r], Fence(run.run_id, grace))
        run.await_answers(run.fenced, leftovers, grace + FENCE_MARGIN)
        for r, still in sorted(run.fenced.items()):
            if still:
                run.problems.append(
                    RankProblem(
                        r,
                        "pending",
                        f"{still[0].describe()} never completed, {grace:.0f}s after every rank "
                        "returned, although its peers did their part",
                        "\n".join(op.describe() for op in still),
                        seconds=run.returned_at.get(r),
                    )
                )
        if run.problems:
            run.end_failed()
            raise run.failure()
    keep = len(counts) == run.n and deadlock.consistent(counts, groups)
    # Kept groups are in step by the counts: torch's sequence numbers agree between members
    # and with what the harness saw issued. Where some operations were not seen one by one
    # (issued from C++: DDP, functional collectives) or the groups are new, a second witness
    # proves it: one fence collective with the run id. It runs while the caller goes on;
    # its answers are read before the next run starts (``Run.verified``) and decide only
    # whether that run may reuse the groups.
    verify = needs_fence(keep=keep, reused=run.reused, reports=reports)
    if not keep and run.in_flight(seen=False):
        # groups out of step with operations nobody saw complete: tearing them down could
        # wait in one of those (see ``Run.end_failed``); the next run gets fresh ranks
        run.kill()
    elif verify or not keep:
        run.release_all(keep=keep, verify=verify)
    # else: groups the counts alone prove are kept without a message: the next run's
    # ``RunCall`` (``reuse``) is their release, and the ranks put back what the run changed
    # as they returned. On a loaded machine every message wakes every rank, between tests.
    run.verify = verify
    run.keep = keep
    run.unwaited = [(r, op) for r, rep in enumerate(reports) if rep for op in rep.unwaited]
    run.attach_outputs()
    return [run.results[r] for r in everyone]


def needs_fence(*, keep: bool, reused: bool, reports: Sequence[Report | None]) -> bool:
    """Must one fence collective prove kept groups in step before the next run reuses them?

    The counts alone prove them where every operation was seen one by one on groups the run
    before already proved: no fence then. Groups new this run, a rank that sent no report,
    or collectives torch counted that the harness did not see (``Report.unseen``: issued
    from C++, DDP's reducer; ``-1``: not known) need the second witness. Groups not kept are
    torn down: nothing to prove.
    """
    return keep and (not reused or any(rep is None or rep.unseen != 0 for rep in reports))


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
