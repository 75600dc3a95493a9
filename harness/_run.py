"""The parent's side of one run of a ``RankPool``: events in, verdict out.

A ``Run`` sends the function to every rank, handles each rank's events (``on_done``,
``on_fenced``, ``on_released``, ``on_probed``: one handler per event of ``harness._events``),
notices deaths through the process sentinels, watches the ranks' notice board for a
deadlock (``DeadlockWatch``, which feeds the pure rule of ``harness._deadlock``), and ends in
one of:

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
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Protocol

from harness import _deadlock as deadlock
from harness._board import Board, Slot, State
from harness._deadlock import Counts, Op, RankView, Status, Verdict
from harness._events import (
    Done,
    Fence,
    Fenced,
    Probe,
    Probed,
    Release,
    Released,
    Report,
    handler_name,
    receive,
    send,
)
from harness._rank.loop import THREAD_ERROR_END
from harness._rank.loop import VERIFY_TIMEOUT as _VERIFY_TIMEOUT
from harness.errors import RankProblem, failure_from

#: How long the parent waits for the fence and release answers beyond the ranks' own
#: deadlines, before it takes a silent rank to be stuck (then the pool restarts).
FENCE_MARGIN = 10.0
#: Operations every member has entered (or a send whose receive was posted) complete by
#: themselves: after every rank returned, they get this long (at most the run's time left).
FENCE_WAIT = 30.0
#: The deadlock watch starts this far into a run (shorter runs never pay for it) and reads
#: the board this often.
CHECK_AFTER = 0.2
CHECK_EVERY = 0.1
#: A rank the board shows running, unchanged this long, is probed (is it idle inside torch
#: on something unseen?), at most this often.
PROBE_AFTER = 0.5
PROBE_EVERY = 0.5
#: A rank is idle when its CPU time grew by less than this share of the time between two
#: probes (a rank waiting on gloo's sockets uses none; one computing uses all it is given).
IDLE_CPU_SHARE = 0.05


class Ranks(Protocol):
    """What a run may use of a pool: its rank processes, their pipes, board and logs."""

    world_size: int
    conns: list[Connection]
    probes: list[Connection]
    procs: list[Any]
    board: Board

    def log_size(self, rank: int, what: str = "out") -> int: ...
    def read_log(self, rank: int, offset: int, what: str = "out") -> str: ...
    def crash_log(self, rank: int) -> str: ...
    def stacks(self, ranks: Sequence[int]) -> dict[int, str]: ...
    def kill(self) -> None: ...


class RunState(Protocol):
    """What the deadlock watch and the naming of the stuck ranks read of a run under way (a
    ``Run``), and the little they do to it: fail a rank, poll, kill, raise."""

    ranks: Ranks
    run_id: int
    timeout: float
    n: int
    t0: float
    thread_offsets: list[int]
    pending: set[int]
    results: dict[int, Any]
    reports: dict[int, Report]
    problems: list[RankProblem]
    returned_at: dict[int, float]
    dead: set[int]
    watch: DeadlockWatch

    def groups(self, slots: dict[int, Slot] | None = None) -> dict[str, tuple[int, ...]]: ...
    def fail(
        self, rank: int, kind: str, summary: str, detail: str = "", phase: str | None = None
    ) -> None: ...
    def poll(self, ranks: Iterable[int], seconds: float) -> None: ...
    def kill(self) -> None: ...
    def failure(self, headline: str | None = None) -> Exception: ...


class DiedIdle(Exception):
    """A rank died before it saw the run (killed while idle): not the run's fault."""


@dataclass
class _Answers:
    """A rank's probe answers: the first of the current streak of answers that show it in
    the same place with the same counts, and the latest (each with when it came, seconds
    into the run)."""

    asked: float = -1e9
    waiting_for: int | None = None  # the probe number not yet answered
    first: tuple[float, Probed] | None = None
    latest: tuple[float, Probed] | None = None

    def add(self, elapsed: float, probed: Probed) -> None:
        self.latest = (elapsed, probed)
        if self.first is None or not _same_place(self.first[1], probed):
            self.first = (elapsed, probed)


def _same_place(a: Probed, b: Probed) -> bool:
    return (a.where, a.since, a.in_torch, a.counts) == (b.where, b.since, b.in_torch, b.counts)


class DeadlockWatch:
    """Gathers the evidence for ``harness._deadlock.decide`` while a run is under way.

    From the board: which operation each running rank waits on, since when. From the ranks
    that returned: what they did (their reports). From probes, asked only where the board
    cannot say enough: whether a rank that seems to run is in fact idle inside torch (DDP's
    backward waiting in the reducer's all-reduce), and the counts of ranks that wait long.
    A verdict is reported once it has held, unchanged, for half of ``window`` (the proof is
    exact; the hold only rides out a board read between two writes); a rank counts as idle
    inside torch only once its probes showed it so for the whole ``window``.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.next_check = CHECK_AFTER
        self.held: tuple[tuple[Any, ...], float] | None = None
        self.answers: dict[int, _Answers] = {}
        self.probe_count = 0
        self.verdict: Verdict | None = None

    def check(self, run: RunState, elapsed: float) -> Verdict | None:
        """The verdict, once proven and held for the window; else ``None``."""
        if not self.window or elapsed < self.next_check or run.problems:
            return None
        self.next_check = elapsed + CHECK_EVERY
        views, slots = self.views(run)
        verdict = deadlock.decide(views, run.groups(slots))
        self._probe(run, views, slots, verdict, elapsed)
        if verdict is None:
            self.held = None
            return None
        key = (
            verdict.kind,
            tuple(verdict.ranks),
            verdict.culprits,
            tuple(slots[r].since for r in verdict.ranks),
        )
        if self.held is None or self.held[0] != key:
            self.held = (key, elapsed)
            return None
        if elapsed - self.held[1] < self.window / 2:
            return None
        self.verdict = verdict
        return verdict

    def views(self, run: RunState) -> tuple[list[RankView], dict[int, Slot]]:
        """Every rank as the evidence shows it now."""
        views, slots = [], {}
        for r in range(run.n):
            report = run.reports.get(r)
            if r not in run.pending:
                status = Status.DEAD if r in run.dead else Status.RETURNED
                views.append(
                    RankView(
                        r,
                        status,
                        since=run.returned_at.get(r, 0.0),
                        counts=report.counts if report else None,
                    )
                )
                continue
            slot = run.ranks.board.read(r)
            slots[r] = slot
            views.append(self._running(run, r, slot))
        return views, slots

    def _running(self, run: RunState, r: int, slot: Slot) -> RankView:
        if slot.run_id != run.run_id:
            return RankView(r, Status.RUNNING)  # not started yet
        answers = self.answers.get(r)
        if slot.state == State.WAITING and not slot.bounded and slot.kind:
            op = _slot_op(slot)
            latest = answers.latest[1] if answers and answers.latest else None
            counts = latest.counts if latest and latest.since == slot.since else None
            return RankView(r, Status.WAITING, op, slot.since - run.t0, counts)
        if slot.state == State.RUNNING and answers and answers.first and answers.latest:
            (t1, a), (t2, b) = answers.first, answers.latest
            idle = (
                b.in_torch
                and b.since == slot.since
                and b.counts is not None
                and t2 - t1 >= self.window
                and b.cpu - a.cpu <= IDLE_CPU_SHARE * (t2 - t1)
            )
            if idle:
                return RankView(
                    r, Status.BLOCKED, since=slot.since - run.t0, counts=b.counts, where=b.where
                )
        return RankView(r, Status.RUNNING)

    def _probe(
        self,
        run: RunState,
        views: list[RankView],
        slots: dict[int, Slot],
        verdict: Verdict | None,
        elapsed: float,
    ) -> None:
        """Ask the ranks whose board slot cannot say enough."""
        if verdict is not None:
            return
        anyone_finished = any(v.status in deadlock.FINISHED for v in views)
        waiting = [v for v in views if v.status == Status.WAITING]
        now = time.monotonic()
        for v in views:
            slot = slots.get(v.rank)
            if slot is None or slot.run_id != run.run_id:
                continue
            quiet = now - slot.since
            if slot.state == State.RUNNING:
                wanted = anyone_finished and quiet >= PROBE_AFTER
            else:
                wanted = v.status == Status.WAITING and len(waiting) > 1 and quiet >= self.window
            answers = self.answers.setdefault(v.rank, _Answers())
            if wanted and elapsed - answers.asked >= PROBE_EVERY:
                self.probe_count += 1
                answers.asked, answers.waiting_for = elapsed, self.probe_count
                with contextlib.suppress(OSError, ValueError):
                    send(run.ranks.probes[v.rank], Probe(self.probe_count))

    def answer(self, rank: int, probed: Probed, elapsed: float) -> None:
        answers = self.answers.setdefault(rank, _Answers())
        if probed.n != answers.waiting_for:
            return  # a late answer to an earlier probe
        answers.waiting_for = None
        answers.add(elapsed, probed)


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
            if r not in self.dead and (proc.sentinel in ready or not proc.is_alive()):
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
        for r, conn in enumerate(self.ranks.conns):
            if r in self.returned_at:
                with contextlib.suppress(OSError):
                    send(conn, Release(self.run_id, keep=keep, verify=verify))

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


#: how long a crash report waits for the report of a rank the board shows returned
_REPORT_GRACE = 2.0


def _skipped_here(run: RunState, rank: int) -> str:
    """``"; it died in all_to_all_single #1 on group 0 ...; rank 1 ..."``: when ``rank`` died
    waiting in a collective (gloo aborts a rank sent another collective's data), the members
    whose counts on the board show they skipped it; ``""`` when none do."""
    slot = run.ranks.board.read(rank)
    wait = _slot_op(slot) if slot.run_id == run.run_id else None
    if wait is None or wait.kind != deadlock.Kind.COLLECTIVE:
        return ""
    deadline = time.monotonic() + _REPORT_GRACE
    for r in slot.members:  # a member between issuing and waiting, or returning: let it say
        while r not in run.returned_at and r not in run.dead and time.monotonic() < deadline:
            theirs = run.ranks.board.read(r)
            if theirs.run_id == run.run_id and theirs.kind and theirs.state != State.RETURNED:
                break
            run.poll([r], 0.1)
    members = []
    for r in slot.members:
        report = run.reports.get(r)
        if r in run.returned_at and report is not None:
            members.append(RankView(r, Status.RETURNED, counts=report.counts))
        else:
            theirs = run.ranks.board.read(r)
            op = _slot_op(theirs) if theirs.run_id == run.run_id else None
            status = Status.WAITING if theirs.waiting else Status.RUNNING  # RUNNING: did it
            members.append(RankView(r, status, wait=op))
    found = deadlock.skipped_by(rank, wait, members)
    if not found:
        return ""
    return f"; it died waiting in {wait.describe()}; " + "; ".join(text for _, text in found)


def _slot_op(slot: Slot) -> Op | None:
    """The operation a rank's slot says its main thread waits on (or died waiting on), or
    last waited on this run (a wait that ended)."""
    if not slot.kind:
        return None
    return Op(
        deadlock.Kind(slot.kind),
        slot.group,
        slot.op,
        slot.index,
        slot.peer,
        slot.tag,
        slot.numel,
        slot.dtype,
        slot.site,
    )


def name_the_stuck(run: RunState, verdict: Verdict | None) -> NoReturn:
    """A proven deadlock (``verdict``), or ranks still running at the deadline or after
    another rank failed: name everyone, with the evidence."""
    # long: one message from the verdict, the board and each stack, in reading order
    __tracebackhide__ = True  # pytest: the failure is the rank's, not ours
    if verdict is None and not run.problems and run.watch.window:
        # at the deadline: is a deadlock proven now? Then say so (it is the better report)
        views, slots = run.watch.views(run)
        verdict = deadlock.decide(views, run.groups(slots))
    if verdict is not None and run.watch.window:
        # a proof names the ranks whose waits were seen when it was made; under load a
        # peer's answer may land just after: look once more, and name every proven rank
        views, slots = run.watch.views(run)
        again = deadlock.decide(views, run.groups(slots))
        if again is not None and set(again.ranks) > set(verdict.ranks):
            verdict = again
    stuck = sorted(run.pending)
    stacks = run.ranks.stacks(stuck)
    waited = time.monotonic() - run.t0
    timed_out = verdict is None and not run.problems
    proven = set(verdict.ranks) if verdict else set()
    for r in stuck:
        slot = run.ranks.board.read(r)
        if r in proven:
            assert verdict is not None
            kind, why = "deadlock", verdict.reason(r)
        elif timed_out or verdict is not None:
            kind = "timeout" if timed_out else "stopped"
            why = f"still running after {waited:.1f}s" + (
                f" (timeout {run.timeout:g}s)"
                if timed_out
                else " (not proven part of the deadlock: its wait was not seen in time)"
            )
            if slot.run_id == run.run_id and slot.state == State.WAITING:
                why += (
                    f"; waiting since {slot.since - run.t0:.2f}s in {slot.op} on group {slot.group}"
                )
                if slot.site:
                    why += f" at {slot.site}"
        else:
            kind, why = (
                "stopped",
                "still running after another rank failed (waiting in a collective?)",
            )
        why, detail = _with_thread_errors(run, r, why, stacks.get(r, "") or "(no stack collected)")
        run.fail(r, kind, why, detail)
    headline = None
    if verdict is not None:
        for m in verdict.culprits:
            if m in run.results:
                run.problems.append(_culprit(run, m, verdict))
        headline = _deadlock_headline(run, verdict, proven_before_timeout=not timed_out)
    elif timed_out and run.returned_at:
        done = ", ".join(
            f"{r}/{run.n} (after {t:.2f}s)" for r, t in sorted(run.returned_at.items())
        )
        headline = (
            f"run timed out after {run.timeout:g}s on rank "
            f"{', '.join(f'{r}/{run.n}' for r in stuck)}; rank {done} had returned. Nothing "
            "proves a deadlock (every wait seen could still complete): raise the timeout "
            "(--spatial-timeout) if the work is really that slow; every rank's state follows."
        )
    run.kill()  # ranks stuck in a collective cannot be reused: start afresh next run
    raise run.failure(headline)


def _with_thread_errors(run: RunState, rank: int, why: str, detail: str) -> tuple[str, str]:
    """A hung rank's reason and stack, with what its threads raised during the run (a
    worker whose failure leaves the main thread waiting on its queue): often the cause."""
    text = run.ranks.read_log(rank, run.thread_offsets[rank], "threads")
    errors = [e.strip() for e in text.split(THREAD_ERROR_END) if e.strip()]
    if not errors:
        return why, detail
    first = errors[0].splitlines()[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{why}; its {first}{more}", detail + "\n\n" + "\n\n".join(errors)


def _culprit(run: RunState, rank: int, verdict: Verdict) -> RankProblem:
    t = run.returned_at[rank]
    waiting = ", ".join(str(s.rank) for s in verdict.stuck if rank in s.waits_for)
    report = run.reports.get(rank)
    counts = report.counts if report else None
    waited_on = sorted({s.group for s in _waits(run, verdict) if s})
    did = ""
    if counts is not None and waited_on:
        did = " having issued " + ", ".join(
            f"{counts.collectives_on(g)} collective{'s' if counts.collectives_on(g) != 1 else ''}"
            f" on group {g}"
            for g in waited_on
        )
    if verdict.kind == "mismatch":
        summary = (
            f"returned after {t:.2f}s{did}; rank(s) {waiting} wait in a collective it entered "
            "as a different operation or size: one side called the wrong one"
        )
    else:
        summary = (
            f"returned after {t:.2f}s{did}, while rank(s) {waiting} wait for its part in an "
            "operation it never entered: the culprit (did it skip a collective, a send or a "
            "receive the others issued?)"
        )
    return RankProblem(
        rank,
        "returned",
        summary,
        f"rank {rank} finished its function {t:.2f}s into the run; the waiting ranks' "
        "reasons and stacks show what they wait in.",
        seconds=t,
    )


def _waits(run: RunState, verdict: Verdict) -> list[Op | None]:
    """The operations the stuck ranks of ``verdict`` wait on (``None``: not seen)."""
    views, _ = run.watch.views(run)
    by_rank = {v.rank: v.wait for v in views}
    return [by_rank.get(r) for r in verdict.ranks]


def _deadlock_headline(run: RunState, verdict: Verdict, *, proven_before_timeout: bool) -> str:
    """``"run deadlocked on rank 0/4, 1/4 (found 1.4s into the run, before the 120s
    timeout): they wait for rank 3/4, which returned without its part. Rank 0: ..."``."""
    n = run.n
    ranks = ", ".join(f"{r}/{n}" for r in verdict.ranks)
    when = (
        f"found {time.monotonic() - run.t0:.1f}s into the run, before the {run.timeout:g}s timeout"
        if proven_before_timeout
        else f"proven at the {run.timeout:g}s timeout"
    )
    if verdict.kind == "missing":
        gone = ", ".join(f"{m}/{n}" for m in verdict.culprits)
        what = f"they wait for rank {gone}, which returned without its part"
    elif verdict.kind == "mismatch":
        what = "they wait in a collective that members of its group entered as another one"
    else:
        what = "they wait for each other in a cycle"
    first = verdict.stuck[0]
    return (
        f"run deadlocked on rank {ranks} ({when}): {what}. Rank {first.rank} {first.reason}. "
        "Every rank's state follows."
    )


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
    verify = keep and (not run.reused or any(rep is None or rep.unseen != 0 for rep in reports))
    if not keep and run.in_flight(seen=False):
        # groups out of step with operations nobody saw complete: tearing them down could
        # wait in one of those (see ``Run.end_failed``); the next run gets fresh ranks
        run.kill()
    else:
        run.release_all(keep=keep, verify=verify)
    run.verify = verify
    run.keep = keep
    run.unwaited = [(r, op) for r, rep in enumerate(reports) if rep for op in rep.unwaited]
    run.attach_outputs()
    return [run.results[r] for r in everyone]


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
