"""What the interceptor notes of one operation, on hand-made process groups and works.

No processes here: a ``Tracker`` is fed the calls its watchers would pass on (a group whose
name and global ranks are already known, a work that says what a gloo work says), and what it
records is what the deadlock proof and the pending check later read.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from harness._protocol.board import Board, State, Writer
from harness._protocol.deadlock import ANY_SOURCE, Kind, Op
from harness._rank import intercept as _intercept


class Group:
    """A process group as the tracker sees it after its first use: only its identity."""


def _tracker(group: Group, name: str, members: tuple[int, ...]) -> _intercept.Tracker:
    tracker = _intercept.Tracker()
    tracker.groups[id(group)] = (name, members)  # as _group would have cached it
    tracker.active = True
    return tracker


@pytest.mark.parametrize(("method", "counter"), [("send", "sends"), ("recv", "recvs")])
def test_the_peer_of_a_send_or_receive_on_a_subgroup_is_its_global_rank(method, counter):
    # group "3" holds global ranks 2 and 5: its local rank 1 is global rank 5
    group = Group()
    tracker = _tracker(group, "3", (2, 5))
    tracker.note(group, method, ([torch.ones(2)], 1, 7), {}, None, method)
    assert dict(getattr(tracker, counter)) == {("3", 5, 7): 1}
    assert tracker.reliable


def test_a_receive_from_any_source_is_from_any_rank_never_from_rank_none():
    group = Group()
    tracker = _tracker(group, "0", (0, 1, 2))
    work = object()
    op = tracker.note(group, "recv_anysource", ([torch.ones(2)], 4), {}, work, "recv")
    assert op is not None and op.peer == ANY_SOURCE
    assert dict(tracker.recvs) == {("0", ANY_SOURCE, 4): 1}
    assert op.describe().startswith("recv from any rank (tag 4, #1)")
    assert "None" not in op.describe()


class NeverCompletes:
    """A work whose wait returns but whose ``is_completed()`` stays False (gloo's emulated
    reduce_scatter on torch 2.13 and 2.14)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return False


def test_a_work_that_never_reports_completion_is_done_once_its_wait_returned(monkeypatch):
    monkeypatch.setattr(_intercept, "_ORIGINAL_IS_COMPLETED", lambda w: w.is_completed())
    tracker = _intercept.Tracker(active=True)
    work = NeverCompletes()
    tracker.live[id(work)] = _intercept.Issued(work, Op(Kind.COLLECTIVE, "0", "reduce_scatter", 1))
    issued = tracker.waiting(work, bounded=False)
    assert issued is not None
    tracker.waited(issued, ok=True)
    assert tracker.leftovers() == [] and tracker.unwaited() == []


def test_a_work_whose_wait_failed_stays_in_flight(monkeypatch):
    # the other side of the rule above: only a wait that returned completes a work
    monkeypatch.setattr(_intercept, "_ORIGINAL_IS_COMPLETED", lambda w: w.is_completed())
    tracker = _intercept.Tracker(active=True)
    work = NeverCompletes()
    op = Op(Kind.COLLECTIVE, "0", "reduce_scatter", 1)
    tracker.live[id(work)] = _intercept.Issued(work, op)
    issued = tracker.waiting(work, bounded=False)
    assert issued is not None
    tracker.waited(issued, ok=False)
    assert tracker.leftovers() == [op]


class Counted(Group):
    """A group that counts what was issued on it, as torch's sequence number does."""

    def __init__(self) -> None:
        self.seq = 0

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


def test_a_collectives_number_counts_only_the_collectives_on_its_group():
    # torch's sequence number counts sends and receives too; the n-th collective is the
    # n-th on every member only once they are taken out (a halo's members send unevenly)
    group = Counted()
    tracker = _tracker(group, "0", (0, 1))
    for method in ("send", "recv", "send"):
        group.seq += 1
        tracker.note(group, method, ([torch.ones(2)], 1, 0), {}, object(), method)
    group.seq += 1
    op = tracker.note(group, "allreduce", ([torch.ones(2)],), {}, object(), "all_reduce")
    assert op is not None and (op.op, op.index) == ("all_reduce", 1)
    assert tracker.issued == {("0", 1): op} and tracker.reliable


class Polled:
    """A work that completes after ``polls`` calls of ``is_completed()``."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls <= 0


def test_a_work_polled_until_it_completed_counts_as_waited_on(monkeypatch):
    monkeypatch.setattr(_intercept, "_ORIGINAL_IS_COMPLETED", lambda w: w.polls <= 0)
    tracker = _intercept.Tracker(active=True)
    monkeypatch.setattr(_intercept, "TRACKER", tracker)
    is_completed = _intercept._is_completed(Polled.is_completed)
    work = Polled(3)
    op = Op(Kind.COLLECTIVE, "0", "all_reduce", 1)
    tracker.live[id(work)] = _intercept.Issued(work, op)
    assert not is_completed(work) and not is_completed(work)
    assert tracker.unwaited() == [op]  # polled, not yet seen complete: not a wait
    assert is_completed(work)
    assert tracker.unwaited() == []  # the caller saw it complete: that is a wait


class Watched:
    """A work whose wait reads the board while it waits (what the pool would read)."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.seen: list[bool] = []

    def wait(self, timeout: Any = None) -> bool:
        self.seen.append(self.board.read(0).bounded)
        return True


@pytest.mark.parametrize(
    ("args", "kwargs", "bounded"),
    [
        ((), {}, False),
        ((datetime.timedelta(0),), {}, False),  # torch's default: no timeout of its own
        ((datetime.timedelta(seconds=5),), {}, True),
        ((), {"timeout": datetime.timedelta(seconds=5)}, True),
    ],
    ids=["no-timeout", "zero", "positional", "keyword"],
)
def test_a_wait_with_a_timeout_is_announced_bounded_and_no_proof_rests_on_it(
    tmp_path, monkeypatch, args, kwargs, bounded
):
    board = Board(str(tmp_path / "board"), 1, create=True)
    tracker = _intercept.Tracker(board=Writer(board, 0), active=True)
    tracker.board.begin(1, 0.0)  # type: ignore[union-attr]
    monkeypatch.setattr(_intercept, "TRACKER", tracker)
    wait = _intercept._wait(Watched.wait)
    work = Watched(board)
    tracker.live[id(work)] = _intercept.Issued(work, Op(Kind.COLLECTIVE, "0", "barrier", 1))
    assert wait(work, *args, **kwargs)
    assert work.seen == [bounded]
    assert board.read(0).state == State.RUNNING  # the wait is over
    assert tracker.unwaited() == []


def test_only_the_recent_collectives_are_kept_for_a_crash_report_to_compare():
    # a long run issues many thousands: each rank keeps the last 64 per group
    group = Counted()
    tracker = _tracker(group, "0", (0, 1))
    for _ in range(100):
        group.seq += 1
        tracker.note(group, "allreduce", ([torch.ones(2)],), {}, None, "all_reduce")
    assert sorted(i for _, i in tracker.issued) == list(range(37, 101))


def test_a_blocking_barrier_is_one_collective_numbered_as_it_runs(tmp_path, monkeypatch):
    # gloo's monitored_barrier waits inside the call, and torch counts its sends and
    # receives from C++: on the board it is collective #1 while it runs, and after it the
    # next collective is #2 on every member, however many operations torch counted
    board = Board(str(tmp_path / "board"), 1, create=True)
    group = Counted()
    tracker = _tracker(group, "0", (0, 1, 2))
    tracker.board = Writer(board, 0)
    tracker.board.begin(1, 0.0)
    monkeypatch.setattr(_intercept, "TRACKER", tracker)
    during: list[tuple[str, int, State]] = []

    def monitored_barrier(pg: Counted, *args: object) -> None:
        slot = board.read(0)
        during.append((slot.op, slot.index, slot.state))
        pg.seq += 4  # the group's first rank: a send and a receive per other member

    barrier = _intercept._operation("monitored_barrier", monitored_barrier)
    assert barrier(group) is None
    assert during == [("monitored_barrier", 1, State.WAITING)]
    assert board.read(0).state == State.RUNNING
    group.seq += 1
    op = tracker.note(group, "allreduce", ([torch.ones(2)],), {}, None, "all_reduce")
    assert op is not None and op.index == 2
