"""The run's evidence rules on hand-made evidence: when a rank counts as blocked inside torch,
how long a proof is held before it is reported, and when kept groups need a fence.

No rank processes: a ``Run`` is given a stand-in for the pool (a real notice board in a
temporary file, pens on its slots, no pipes), and each rule is fed probe answers, board
slots and reports as the ranks would send them. Times are arguments (``elapsed``, the
answers' arrival): nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from harness._protocol.board import Board, State, Writer, members_bits
from harness._protocol.deadlock import Counts, Kind, Op, Status
from harness._protocol.events import Probed, Report
from harness.pool._run import Run, needs_fence
from harness.pool._watch import IDLE_CPU_SHARE, _Answers, _skipped_here, idle_in_torch

WINDOW = 2.0
COUNTS = Counts(collectives={"0": 1})


def probed(
    cpu: float,
    *,
    n: int = 1,
    since: float = 5.0,
    in_torch: bool = True,
    counts: Counts | None = COUNTS,
    where: str = "torch/nn/parallel/distributed.py:1 in _reducer",
) -> Probed:
    return Probed(n, where, in_torch, cpu, since, counts, {"0": (0, 1)})


def streak(seconds: float, cpu_used: float, **latest: Any) -> tuple[tuple[float, Probed], ...]:
    """The first and latest answers of a streak ``seconds`` long over which the rank used
    ``cpu_used`` seconds of CPU."""
    return (10.0, probed(3.0)), (10.0 + seconds, probed(3.0 + cpu_used, **latest))


# ---------------------------------------------------------------- blocked inside torch


@pytest.mark.parametrize(
    ("share", "idle"),
    [
        (0.0, True),  # waiting on gloo's sockets: no CPU at all
        (0.03, True),  # waiting, while its probe thread answered and Python ticked
        (0.9 * IDLE_CPU_SHARE, True),  # just under the threshold
        (1.1 * IDLE_CPU_SHARE, False),  # just over it
        (0.1, False),  # computing, starved to a tenth of a core by a loaded machine
        (0.45, False),  # computing at under half a core
    ],
    ids=[
        "none",
        "three-percent",
        "just-under",
        "just-over",
        "tenth-of-a-core",
        "under-half-a-core",
    ],
)
def test_a_rank_is_idle_in_torch_only_while_it_uses_under_a_twentieth_of_a_core(share, idle):
    # the threshold is the rule: a rank computing slowly on a loaded machine must never be
    # taken for one waiting (it would be named deadlocked while it works)
    seconds = 4.0
    assert idle_in_torch(*streak(seconds, share * seconds), since=5.0, window=WINDOW) is idle


@pytest.mark.parametrize(
    ("seconds", "idle"),
    [(0.0, False), (0.5 * WINDOW, False), (0.99 * WINDOW, False), (WINDOW, True)],
    ids=["one-answer", "half-the-window", "just-short", "the-window"],
)
def test_a_rank_is_idle_in_torch_only_once_its_quiet_answers_span_the_whole_window(seconds, idle):
    # one quiet answer (or a few close together) is a rank caught between two calls
    assert idle_in_torch(*streak(seconds, 0.0), since=5.0, window=WINDOW) is idle


@pytest.mark.parametrize(
    "latest",
    [{"in_torch": False}, {"since": 6.0}, {"counts": None}],
    ids=["in-python", "slot-changed", "counts-unknown"],
)
def test_a_quiet_rank_is_not_idle_in_torch_outside_torch_after_its_slot_moved_or_uncounted(
    latest,
):
    assert idle_in_torch(*streak(WINDOW, 0.0), since=5.0, window=WINDOW)  # the control
    assert not idle_in_torch(*streak(WINDOW, 0.0, **latest), since=5.0, window=WINDOW)


def test_a_streak_starts_again_where_an_answer_shows_the_rank_somewhere_else():
    answers = _Answers()
    answers.add(1.0, probed(0.0, where="a.py:1"))
    answers.add(2.0, probed(0.0, where="b.py:2"))  # it moved: it was working
    answers.add(3.0, probed(0.0, where="b.py:2"))
    assert answers.first is not None and answers.latest is not None
    assert (answers.first[0], answers.latest[0]) == (2.0, 3.0)
    answers.add(4.0, probed(0.0, where="b.py:2", counts=Counts(collectives={"0": 2})))
    assert answers.first[0] == 4.0  # it issued another collective: a new streak


# ---------------------------------------------------------------- a run, without ranks


class Ranks:
    """The pool as a ``Run`` sees it: a real notice board, and nothing behind the pipes."""

    def __init__(self, path: str, n: int) -> None:
        self.world_size = n
        self.board = Board(path, n, create=True)
        self.conns: list[Any] = []
        self.probes: list[Any] = []
        self.procs: list[Any] = []

    def log_size(self, rank: int, what: str = "out") -> int:
        return 0

    def read_log(self, rank: int, offset: int, what: str = "out") -> str:
        return ""


def _run(tmp_path: Any, n: int = 2) -> tuple[Run, list[Writer]]:
    ranks = Ranks(str(tmp_path / "board"), n)
    run = Run(ranks, 1, 60.0, error_grace=1.0, deadlock_window=WINDOW)  # type: ignore[arg-type]
    pens = [Writer(ranks.board, r) for r in range(n)]
    for pen in pens:
        pen.begin(1, run.t0)
    return run, pens


def _waits_in_all_reduce(pen: Writer, at: float) -> None:
    pen.enter(at, kind=int(Kind.COLLECTIVE), index=1, peer=None, tag=0, numel=4,
              bounded=False, members=members_bits((0, 1)), group="0", op="all_reduce",
              dtype="float32", site="m.py:3 in f")  # fmt: skip


def _returned_without_it(run: Run, rank: int) -> None:
    run.pending.discard(rank)
    run.returned_at[rank] = 0.1
    run.reports[rank] = Report(Counts(collectives={"0": 0}), {"0": (0, 1)}, unseen=0)


def test_a_proven_deadlock_is_reported_only_once_it_held_for_half_the_window(tmp_path):
    # rank 0 waits in all_reduce #1; rank 1 returned having issued none: proven at once,
    # reported only after it held for half the window (a board read between two writes
    # of a rank must not make a verdict)
    run, pens = _run(tmp_path)
    _waits_in_all_reduce(pens[0], run.t0 + 0.05)
    _returned_without_it(run, 1)
    watch = run.watch
    assert watch.check(run, 0.2) is None  # first sighting
    assert watch.check(run, 0.2 + 0.475 * WINDOW) is None  # second sighting, just short
    verdict = watch.check(run, 0.2 + 0.525 * WINDOW)
    assert verdict is not None and verdict.kind == "missing"
    assert verdict.ranks == [0] and verdict.culprits == (1,)
    assert watch.verdict is verdict


def test_a_verdict_whose_evidence_changed_is_held_afresh(tmp_path):
    run, pens = _run(tmp_path)
    _waits_in_all_reduce(pens[0], run.t0 + 0.05)
    _returned_without_it(run, 1)
    watch = run.watch
    assert watch.check(run, 0.2) is None
    _waits_in_all_reduce(pens[0], run.t0 + 0.6)  # a new wait: the same proof, new evidence
    assert watch.check(run, 0.2 + 0.6 * WINDOW) is None  # held afresh from here
    assert watch.check(run, 0.2 + 1.2 * WINDOW) is not None


def test_no_verdict_is_given_before_the_watch_starts_or_after_a_rank_failed(tmp_path):
    run, pens = _run(tmp_path)
    _waits_in_all_reduce(pens[0], run.t0 + 0.05)
    _returned_without_it(run, 1)
    assert run.watch.check(run, 0.1) is None and run.watch.held is None  # before CHECK_AFTER
    run.fail(1, "error", "it raised")
    assert run.watch.check(run, 0.3) is None and run.watch.held is None


def test_a_running_rank_counts_as_blocked_once_its_answered_probes_show_it_idle(tmp_path):
    run, pens = _run(tmp_path)
    since = pens[0].since
    watch = run.watch

    def answer(n: int, at: float, cpu: float, *, late: bool = False) -> None:
        watch.answers.setdefault(0, _Answers()).waiting_for = n + 1 if late else n
        watch.answer(0, probed(cpu, n=n, since=since), at)

    def status() -> Status:
        return watch.views(run)[0][0].status

    answer(1, 1.0, 0.0)
    answer(2, 1.0 + 0.99 * WINDOW, 0.01)
    assert status() == Status.RUNNING  # not yet the whole window
    answer(3, 1.0 + WINDOW, 0.01, late=True)  # an answer to an earlier probe: not counted
    assert status() == Status.RUNNING
    answer(4, 1.0 + WINDOW, 0.01)
    view = watch.views(run)[0][0]
    assert view.status == Status.BLOCKED and view.counts == COUNTS
    assert view.where.startswith("torch/nn/parallel")
    pens[0].leave(since + 1.0, State.RUNNING)  # the slot moved: it is running again
    assert status() == Status.RUNNING


# ---------------------------------------------------------------- fencing reused groups


def report(unseen: int) -> Report:
    return Report(Counts(collectives={"0": 3}), {"0": (0, 1)}, unseen=unseen)


@pytest.mark.parametrize(
    ("keep", "reused", "reports", "fence"),
    [
        (True, True, [report(0), report(0)], False),  # every operation seen, groups proven
        (True, True, [report(0), report(2)], True),  # DDP's reducer issued 2 from C++
        (True, True, [report(0), report(-1)], True),  # unseen not known
        (True, True, [report(0), None], True),  # a rank sent no report
        (True, False, [report(0), report(0)], True),  # new groups: never proven yet
        (False, False, [report(0), report(2)], False),  # torn down: nothing to prove
    ],
    ids=["all-seen", "from-cpp", "unknown", "no-report", "new-groups", "not-kept"],
)
def test_kept_groups_are_fenced_when_new_or_after_collectives_the_interceptor_did_not_see(
    keep: bool, reused: bool, reports: Sequence[Report | None], fence: bool
) -> None:
    assert needs_fence(keep=keep, reused=reused, reports=reports) is fence


def test_ranks_that_may_have_work_in_flight_are_named(tmp_path):
    run, _ = _run(tmp_path, 4)
    op = Op(Kind.SEND, "0", "isend", 1, peer=1)
    run.reports = {
        0: report(0),
        1: Report(COUNTS, {}, leftovers=[op], unseen=0),
        2: Report(None, {}, unseen=0),
        3: report(1),
    }
    assert run.in_flight() == [1, 2, 3]
    assert run.in_flight(seen=False) == [2, 3]  # a seen leftover completes or is reported


def test_a_board_slot_of_an_earlier_run_counts_as_not_started(tmp_path):
    run, pens = _run(tmp_path)
    pens[0].begin(0, time.monotonic())  # still showing the run before
    _waits_in_all_reduce(pens[0], run.t0)
    assert run.watch.views(run)[0][0].status == Status.RUNNING


# ---------------------------------------------------------------- whom the watch probes


def _probes(run: Run) -> list[Any]:
    """Pipes in place of the ranks' probe threads; the ends the ranks would read."""
    import multiprocessing

    ends = [multiprocessing.Pipe() for _ in range(run.n)]
    run.ranks.probes = [parent for parent, _ in ends]
    return [child for _, child in ends]


def _asked(ends: list[Any]) -> list[int]:
    asked = []
    for r, end in enumerate(ends):
        while end.poll():
            end.recv_bytes()
            asked.append(r)
    return asked


def test_a_quiet_running_rank_is_probed_only_once_another_rank_finished(tmp_path):
    # while every rank runs, none can be waiting for a finished one: probing costs the
    # ranks CPU for nothing
    run, pens = _run(tmp_path, 3)
    ends = _probes(run)
    quiet = time.monotonic() - 1.0  # quiet for a second: longer than PROBE_AFTER
    for pen in pens:
        pen.begin(1, quiet)
    assert run.watch.check(run, 0.3) is None
    assert _asked(ends) == []
    _returned_without_it(run, 2)
    assert run.watch.check(run, 0.5) is None
    assert _asked(ends) == [0, 1]


def test_waiting_ranks_are_probed_only_when_several_wait_long(tmp_path):
    # a lone waiting rank's counts prove nothing more; several waiting ranks' counts may
    # show they wait in different collectives
    run, pens = _run(tmp_path, 3)
    ends = _probes(run)
    long_ago = time.monotonic() - 2 * WINDOW
    _waits_in_all_reduce(pens[0], long_ago)
    assert run.watch.check(run, 0.3) is None
    assert _asked(ends) == []
    _waits_in_all_reduce(pens[1], long_ago)
    assert run.watch.check(run, 0.5) is None  # both in all_reduce #1: in progress
    assert _asked(ends) == [0, 1]


def test_a_rank_that_died_is_seen_dead_and_one_that_returned_returned(tmp_path):
    run, _ = _run(tmp_path, 3)
    _returned_without_it(run, 1)
    run.pending.discard(2)
    run.dead.add(2)
    statuses = [v.status for v in run.watch.views(run)[0]]
    assert statuses == [Status.RUNNING, Status.RETURNED, Status.DEAD]


# ---------------------------------------------------------------- a collective gloo aborted


def _waits_in(pen: Writer, numel: int, site: str) -> None:
    pen.enter(time.monotonic(), kind=int(Kind.COLLECTIVE), index=1, peer=None, tag=0,
              numel=numel, bounded=False, members=members_bits((0, 1, 2, 3)), group="0",
              op="all_to_all_single", dtype="float32", site=site)  # fmt: skip


def test_a_rank_gloo_aborted_before_its_board_showed_the_wait_still_names_the_skipper(
    tmp_path,
):
    # issue #36: gloo may abort a victim between issuing and waiting; its slot shows no
    # wait, but the others' do: ranks 2 and 3 wait in #1 as the transpose, rank 1 (which
    # skipped it) in #1 as the transpose back
    run, pens = _run(tmp_path, 4)
    _waits_in(pens[1], 16, "m.py:8 in back")
    _waits_in(pens[2], 8, "m.py:7 in there")
    _waits_in(pens[3], 8, "m.py:7 in there")
    run.pending.discard(0)
    run.dead.add(0)
    text = _skipped_here(run, 0)
    assert text.startswith("; it died before its board showed the collective it waited in; ")
    assert "all_to_all_single 8 elements float32 at m.py:7 in there" in text  # the others'
    assert text.endswith("(rank 1 skipped one, or added one, before it)")
    assert not any(f"(rank {r} skipped" in text for r in (0, 2, 3))
    # one waiting peer against one other is no proof of which of them is out of step
    pens[3].begin(1, time.monotonic())  # rank 3 shows nothing this run
    assert _skipped_here(run, 0) == ""
