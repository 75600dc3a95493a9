"""What the interceptor notes of one operation, on hand-made process groups and works.

No processes here: a ``Tracker`` is fed the calls its watchers would pass on (a group whose
name and global ranks are already known, a work that says what a gloo work says), and what it
records is what the deadlock proof and the pending check later read.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness._deadlock import ANY_SOURCE, Kind, Op
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
