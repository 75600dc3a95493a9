"""The deadlock evidence of one run: gathered while it is under way, and told after it.

``DeadlockWatch`` reads the ranks' notice board (and probes the ranks where the board cannot
say enough) and feeds the pure rule of ``harness._protocol.deadlock``; ``name_the_stuck`` names
every
rank still running after a proven deadlock, the deadline or another rank's failure, with the
evidence; ``_skipped_here`` says which members skipped the collective a dead rank waited in.
They see a run only through ``RunState`` and the pool only through ``Ranks``; the run
itself (``harness.pool._run``) imports them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn, Protocol

from harness._protocol import deadlock as deadlock
from harness._protocol.board import Board, Slot, State
from harness._protocol.deadlock import Op, RankView, Status, Verdict
from harness._protocol.events import Probe, Probed, Report, send
from harness._rank.loop import THREAD_ERROR_END
from harness.errors import RankProblem

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


def idle_in_torch(
    first: tuple[float, Probed], latest: tuple[float, Probed], since: float, window: float
) -> bool:
    """Is a rank the board shows running in fact blocked inside torch (DDP's reducer
    waiting in an all-reduce it issued from C++)? ``first`` and ``latest``: the first and
    the latest probe answer (with when it came) of its current streak in one place;
    ``since``: when its board slot last changed.

    Yes when the latest answer shows it inside torch, in the state the board still shows,
    with counts to judge it by, the streak spans the whole ``window``, and it used less
    than ``IDLE_CPU_SHARE`` of a core over the streak (a rank waiting on gloo's sockets
    uses none; a rank computing, even starved on a loaded machine, far more).
    """
    (t1, a), (t2, b) = first, latest
    return (
        b.in_torch
        and b.since == since
        and b.counts is not None
        and t2 - t1 >= window
        and b.cpu - a.cpu <= IDLE_CPU_SHARE * (t2 - t1)
    )


class DeadlockWatch:
    """Gathers the evidence for ``harness._protocol.deadlock.decide`` while a run is under way.

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
            if idle_in_torch(answers.first, answers.latest, slot.since, self.window):
                b = answers.latest[1]
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


#: how long a crash report waits for the report of a rank the board shows returned
_REPORT_GRACE = 2.0


def _skipped_here(run: RunState, rank: int) -> str:
    """``"; it died in all_to_all_single #1 on group 0 ...; rank 1 ..."``: when ``rank`` died
    waiting in a collective (gloo aborts a rank sent another collective's data), the members
    whose counts on the board show they skipped it; ``""`` when none do."""
    slot = run.ranks.board.read(rank)
    wait = _slot_op(slot) if slot.run_id == run.run_id else None
    if wait is None or wait.kind != deadlock.Kind.COLLECTIVE:
        return "" if slot.waiting else _skipped_unseen(run, rank)
    deadline = time.monotonic() + _REPORT_GRACE
    for r in slot.members:  # a member between issuing and waiting, or returning: let it say
        while r not in run.returned_at and r not in run.dead and time.monotonic() < deadline:
            theirs = run.ranks.board.read(r)
            if theirs.run_id == run.run_id and theirs.kind and theirs.state != State.RETURNED:
                break
            run.poll([r], 0.1)
    found = deadlock.skipped_by(rank, wait, _member_views(run, slot.members))
    if not found:
        return "" if slot.waiting else _skipped_unseen(run, rank)
    return f"; it died waiting in {wait.describe()}; " + "; ".join(text for _, text in found)


def _member_views(run: RunState, members: Iterable[int]) -> list[RankView]:
    """Each member as the board and the reports show it: a returned one with its counts, a
    waiting one with its wait, a running one with the collective it last waited on."""
    views = []
    for r in members:
        report = run.reports.get(r)
        if r in run.returned_at and report is not None:
            views.append(RankView(r, Status.RETURNED, counts=report.counts))
        else:
            theirs = run.ranks.board.read(r)
            op = _slot_op(theirs) if theirs.run_id == run.run_id else None
            status = Status.WAITING if theirs.waiting else Status.RUNNING  # RUNNING: did it
            views.append(RankView(r, status, wait=op))
    return views


def _skipped_unseen(run: RunState, rank: int) -> str:
    """``rank`` died before its slot showed the wait gloo aborted (gloo can abort a rank
    between issuing and waiting): the other members' waits still show who is out of step
    where all of them but one wait in one collective and that one in another there."""
    for r in range(run.n):
        theirs = run.ranks.board.read(r)
        if r == rank or theirs.run_id != run.run_id or not theirs.waiting:
            continue
        wait = _slot_op(theirs)
        if wait is None or wait.kind != deadlock.Kind.COLLECTIVE or rank not in theirs.members:
            continue
        others = _member_views(run, [m for m in theirs.members if m != rank])
        found = deadlock.skipped_by(r, wait, others)
        with_evidence = [v for v in others if v.wait is not None or v.counts is not None]
        if len(found) == 1 and len(with_evidence) >= 3:
            return (
                "; it died before its board showed the collective it waited in; rank "
                f"{r} waits in {wait.describe()}; {found[0][1]}"
            )
    return ""


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
        slot.label,
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
                why += f"; waiting since {slot.since - run.t0:.2f}s in {slot.op} on " + (
                    slot.label or f"group {slot.group}"
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
    waited_on = {s.group: s.group_text() for s in _waits(run, verdict) if s}
    did = ""
    if counts is not None and waited_on:
        did = " having issued " + ", ".join(
            f"{counts.collectives_on(g)} collective{'s' if counts.collectives_on(g) != 1 else ''}"
            f" on {waited_on[g]}"
            for g in sorted(waited_on)
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
