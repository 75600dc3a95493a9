"""The deadlock rule on hand-made evidence: a deadlock only where the waits cannot complete.

Every case is a small world of ranks with what each was seen doing: waiting on one
operation (from its board slot), blocked inside torch (from its probes), returned (with its
final counts), or running (nothing known). Correct programs, however slow, give no verdict;
each kind of hang gives exactly one, naming who waits, for whom, and why.
"""

from __future__ import annotations

import pytest

from harness._protocol.deadlock import (
    ANY_SOURCE,
    Counts,
    Kind,
    Op,
    RankView,
    Status,
    compatible,
    consistent,
    decide,
    skipped_by,
    unmatched,
)

W = {"0": (0, 1, 2, 3)}  # the default group of 4 ranks


def allreduce(k: int, numel: int = 1, group: str = "0", site: str = "m.py:9 in f") -> Op:
    return Op(Kind.COLLECTIVE, group, "all_reduce", k, numel=numel, dtype="float32", site=site)


def waiting(rank: int, op: Op, counts: Counts | None = None, since: float = 0.5) -> RankView:
    return RankView(rank, Status.WAITING, wait=op, since=since, counts=counts)


def returned(rank: int, since: float = 0.1, **counts: object) -> RankView:
    return RankView(rank, Status.RETURNED, since=since, counts=Counts(**counts))  # type: ignore[arg-type]


def running(rank: int) -> RankView:
    return RankView(rank, Status.RUNNING)


# ---------------------------------------------------------------- correct programs: no verdict


def test_a_collective_every_member_waits_in_is_in_progress_however_long():
    views = [waiting(r, allreduce(3, numel=300_000_000), since=100.0) for r in range(4)]
    assert decide(views, W) is None


def test_ranks_waiting_for_a_late_rank_are_not_deadlocked():
    # rank 3 sleeps, runs a subprocess, waits on a lock: running, so it may still come
    views = [waiting(r, allreduce(1), since=60.0) for r in range(3)] + [running(3)]
    assert decide(views, W) is None


def test_a_late_rank_is_never_blamed_when_one_peer_returned_and_another_is_running():
    group = {"0": (0, 1, 2)}
    views = [waiting(0, allreduce(2)), returned(1, collectives={"0": 2}), running(2)]
    assert decide(views, group) is None  # rank 1 did its part; rank 2 may still do its own


def test_a_returned_rank_that_entered_the_collective_is_no_culprit():
    # rank 3 took part in all_reduce #1 and left; the others are still inside it
    views = [waiting(r, allreduce(1)) for r in range(3)] + [returned(3, collectives={"0": 1})]
    assert decide(views, W) is None


def test_a_finished_rank_whose_counts_are_unknown_proves_nothing():
    views = [waiting(0, allreduce(1)), RankView(1, Status.RETURNED, counts=None)]
    assert decide(views, {"0": (0, 1)}) is None


def test_a_receive_whose_sender_returned_after_sending_is_in_progress():
    recv = Op(Kind.RECV, "0", "recv", 1, peer=1, tag=0)
    views = [waiting(0, recv), returned(1, sends={("0", 0, 0): 1})]
    assert decide(views, {"0": (0, 1)}) is None


def test_two_point_to_point_waits_whose_counts_are_unknown_prove_nothing():
    views = [
        waiting(0, Op(Kind.RECV, "0", "recv", 1, peer=1)),
        waiting(1, Op(Kind.RECV, "0", "recv", 1, peer=0)),
    ]
    assert decide(views, {"0": (0, 1)}) is None  # each may have sent first (isend)


def test_all_to_all_with_different_split_sizes_is_not_a_mismatch():
    ops = [
        Op(Kind.COLLECTIVE, "0", "all_to_all_single", 1, numel=n, dtype="float32")
        for n in (3, 5, 7, 9)
    ]
    assert decide([waiting(r, op) for r, op in enumerate(ops)], W) is None


def test_a_blocked_rank_whose_collectives_a_finished_peer_matched_proves_nothing():
    blocked = RankView(0, Status.BLOCKED, counts=Counts(collectives={"0": 4}), where="x")
    views = [blocked, returned(1, collectives={"0": 4})]
    assert decide(views, {"0": (0, 1)}) is None  # idle in torch for another reason


def test_a_waiting_rank_on_a_group_without_the_returned_rank_is_not_stuck():
    groups = {"0": (0, 1, 2, 3), "1": (0, 1)}
    views = [
        waiting(0, allreduce(1, group="1")),
        running(1),
        returned(2, collectives={"0": 0}),
        returned(3, collectives={"0": 0}),
    ]
    assert decide(views, groups) is None


# ---------------------------------------------------------------- hangs: one verdict each


def test_a_skipped_collective_names_who_waits_and_the_rank_that_returned():
    views = [waiting(r, allreduce(3), since=0.42) for r in range(3)]
    views.append(returned(3, collectives={"0": 2}))
    verdict = decide(views, W)
    assert verdict is not None
    assert (verdict.kind, verdict.ranks, verdict.culprits) == ("missing", [0, 1, 2], (3,))
    assert verdict.reason(0) == (
        "waits in all_reduce #3 on group 0 (1 element float32) at m.py:9 in f since 0.42s; "
        "rank 3 never entered it: it returned after 2 collectives on group 0"
    )
    assert all(s.waits_for == (3,) for s in verdict.stuck)


def test_a_dead_rank_is_said_to_have_died():
    views = [
        waiting(0, allreduce(1)),
        RankView(1, Status.DEAD, counts=Counts(collectives={"0": 0})),
    ]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None
    assert verdict.reason(0).endswith(
        "rank 1 never entered it: it died after 0 collectives on group 0"
    )


def test_different_operations_at_the_same_point_are_a_mismatch():
    bcast = Op(Kind.COLLECTIVE, "0", "broadcast", 1, numel=3, dtype="float32", site="m.py:12")
    views = [waiting(0, allreduce(1, numel=3)), *[waiting(r, bcast) for r in (1, 2, 3)]]
    verdict = decide(views, W)
    assert verdict is not None and verdict.kind == "mismatch" and verdict.ranks == [0, 1, 2, 3]
    assert verdict.culprits == ()
    assert verdict.reason(0) == (
        "waits in all_reduce #1 on group 0 (3 elements float32) at m.py:9 in f since 0.50s; "
        "rank 1 waits in that collective as broadcast 3 elements float32 at m.py:12: the "
        "ranks called different collectives (or sizes) at the same point"
    )


def test_a_returned_rank_that_did_the_collective_with_another_size_is_a_mismatch():
    done = allreduce(1, numel=3)
    views = [waiting(r, allreduce(1, numel=3 + r)) for r in (1, 2, 3)]
    views.insert(0, returned(0, collectives={"0": 1}, issued={("0", 1): done}))
    verdict = decide(views, W)
    assert verdict is not None and verdict.kind == "mismatch"
    assert verdict.ranks == [1, 2, 3] and verdict.culprits == (0,)
    assert "rank 0 did that collective as all_reduce 3 elements float32" in verdict.reason(1)


def test_a_receive_whose_sender_returned_without_sending_is_stuck():
    recv = Op(Kind.RECV, "0", "recv", 2, peer=1, tag=7)
    views = [waiting(0, recv), returned(1, sends={("0", 0, 7): 1})]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None and verdict.culprits == (1,)
    assert verdict.reason(0).endswith("rank 1 returned having sent it 1 with tag 7")


def test_a_send_whose_receiver_returned_without_receiving_is_stuck():
    send = Op(Kind.SEND, "0", "send", 1, peer=1, tag=0)
    views = [waiting(0, send), returned(1)]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None and verdict.culprits == (1,)
    assert verdict.reason(0).endswith("rank 1 returned having received 0 from it with tag 0")


def test_a_receive_from_any_source_may_take_the_send():
    send = Op(Kind.SEND, "0", "send", 1, peer=1, tag=0)
    views = [waiting(0, send), returned(1, recvs={("0", ANY_SOURCE, 0): 1})]
    assert decide(views, {"0": (0, 1)}) is None


def test_two_blocking_receives_from_each_other_are_a_cycle_once_both_counts_are_seen():
    nothing = Counts()
    views = [
        waiting(0, Op(Kind.RECV, "0", "recv", 1, peer=1), counts=nothing),
        waiting(1, Op(Kind.RECV, "0", "recv", 1, peer=0), counts=nothing),
    ]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("cycle", [0, 1])
    assert verdict.culprits == ()
    assert "rank 1 has not done its part and waits itself, in recv from rank 0" in (
        verdict.reason(0)
    )


def test_collectives_entered_in_opposite_orders_on_two_groups_are_a_cycle():
    groups = {"1": (0, 1), "2": (0, 1)}
    views = [
        waiting(0, allreduce(1, group="1"), counts=Counts(collectives={"1": 1, "2": 0})),
        waiting(1, allreduce(1, group="2"), counts=Counts(collectives={"1": 0, "2": 1})),
    ]
    verdict = decide(views, groups)
    assert verdict is not None and verdict.kind == "cycle" and verdict.ranks == [0, 1]


def test_a_cycle_with_one_member_still_running_is_no_deadlock():
    groups = {"1": (0, 1, 2)}
    views = [
        waiting(0, allreduce(1, group="1"), counts=Counts(collectives={"1": 1})),
        waiting(1, allreduce(1, group="1"), counts=Counts(collectives={"1": 1})),
        running(2),
    ]
    assert decide(views, groups) is None


def test_a_rank_blocked_in_ddps_backward_with_a_collective_a_returned_peer_never_issued():
    blocked = RankView(
        0,
        Status.BLOCKED,
        since=0.3,
        counts=Counts(collectives={"0": 4}),
        where="torch/autograd/graph.py:979 in _engine_run_backward",
    )
    views = [blocked, returned(1, collectives={"0": 3})]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None and verdict.culprits == (1,) and verdict.ranks == [0]
    assert verdict.reason(0) == (
        "is blocked inside torch (torch/autograd/graph.py:979 in _engine_run_backward) having "
        "issued 4 collectives on group 0 (from Python or C++, e.g. DDP's gradient all-reduce); "
        "rank 1 returned after 3: the collective #4 can never complete"
    )


def test_ranks_waiting_on_a_stuck_rank_are_stuck_too():
    # 0 and 1 wait in a subgroup collective that rank 2 never entered: rank 2 waits on
    # a world collective that rank 3 (returned) never entered
    groups = {"0": (0, 1, 2, 3), "1": (0, 1, 2)}
    views = [
        waiting(0, allreduce(1, group="1")),
        waiting(1, allreduce(1, group="1")),
        waiting(2, allreduce(1, group="0"), counts=Counts(collectives={"0": 1, "1": 0})),
        returned(3, collectives={"0": 0}),
    ]
    verdict = decide(views, groups)
    assert verdict is not None and verdict.ranks == [0, 1, 2] and verdict.culprits == (3,)
    assert verdict.stuck[0].waits_for == (2,)


# ---------------------------------------------------------------- after the run


def test_a_collective_some_member_never_entered_is_unmatched():
    left = {2: [allreduce(1)]}
    counts = {0: Counts(), 1: Counts(), 2: Counts(collectives={"0": 1}), 3: Counts()}
    assert unmatched(left, counts, W) == {2: [(allreduce(1), "rank 0, 1, 3 never entered it")]}


def test_a_collective_every_member_entered_is_matched_and_completes_by_itself():
    counts = {r: Counts(collectives={"0": 1}) for r in range(4)}
    assert unmatched({r: [allreduce(1)] for r in range(4)}, counts, W) == {}


def test_sends_and_receives_are_matched_by_peer_tag_and_number():
    isend = Op(Kind.SEND, "0", "isend", 2, peer=1, tag=5)
    irecv = Op(Kind.RECV, "0", "irecv", 1, peer=0, tag=5)
    once = {0: Counts(sends={("0", 1, 5): 2}), 1: Counts(recvs={("0", 0, 5): 1})}
    assert unmatched({0: [isend]}, once, {"0": (0, 1)}) == {
        0: [(isend, "rank 1 never received it")]
    }
    twice = {0: Counts(sends={("0", 1, 5): 2}), 1: Counts(recvs={("0", 0, 5): 2})}
    assert unmatched({0: [isend], 1: [irecv]}, twice, {"0": (0, 1)}) == {}
    unsent = {0: Counts(), 1: Counts(recvs={("0", 0, 5): 1})}
    assert unmatched({1: [irecv]}, unsent, {"0": (0, 1)}) == {1: [(irecv, "rank 0 never sent it")]}


def test_groups_are_in_step_only_with_equal_collectives_and_matched_sends():
    same = {r: Counts(collectives={"0": 3}) for r in range(4)}
    assert consistent(same, W)
    apart = {**same, 3: Counts(collectives={"0": 2})}
    assert not consistent(apart, W)
    halo = {
        0: Counts(collectives={"0": 3}, sends={("0", 1, 0): 1}),
        1: Counts(collectives={"0": 3}, recvs={("0", 0, 0): 1}),
    }
    assert consistent(halo, {"0": (0, 1)})  # uneven but matched: an edge of a halo
    lost = {0: halo[0], 1: Counts(collectives={"0": 3})}
    assert not consistent(lost, {"0": (0, 1)})
    anyone = {0: halo[0], 1: Counts(collectives={"0": 3}, recvs={("0", ANY_SOURCE, 0): 1})}
    assert not consistent(anyone, {"0": (0, 1)})  # which sender it took is not known


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (allreduce(1, numel=3), allreduce(1, numel=3), True),
        (allreduce(1, numel=3), allreduce(1, numel=4), False),
        (allreduce(1, numel=3), allreduce(1, numel=None), True),  # size not known: no claim
        (allreduce(1), Op(Kind.COLLECTIVE, "0", "broadcast", 1, numel=1, dtype="float32"), False),
        (allreduce(1), Op(Kind.COLLECTIVE, "0", "all_reduce", 1, numel=1, dtype="float64"), False),
    ],
    ids=["same", "size", "unknown-size", "operation", "dtype"],
)
def test_two_sides_of_a_collective_are_compatible_only_when_they_can_pair(a, b, same):
    assert compatible(a, b) is same


# ---------------------------------------------------------------- every line of the rule


@pytest.mark.parametrize(
    ("op", "text"),
    [
        (
            Op(Kind.SEND, "2", "isend", 3, peer=1, tag=4, numel=2, dtype="float64", site="a:1"),
            "isend to rank 1 (tag 4, #3) (2 elements float64) at a:1",
        ),
        (Op(Kind.RECV, "0", "irecv", 1, peer=0), "irecv from rank 0 (tag 0, #1)"),
        (Op(Kind.RECV, "0", "recv", 2, peer=ANY_SOURCE), "recv from any rank (tag 0, #2)"),
        (Op(Kind.COLLECTIVE, "0", "barrier", 5), "barrier #5 on group 0"),
    ],
    ids=["isend", "irecv", "any-source", "no-size"],
)
def test_an_operation_describes_itself_whole(op, text):
    assert op.describe() == text


def test_a_rank_that_is_not_stuck_has_no_reason():
    verdict = decide([waiting(0, allreduce(1)), returned(1)], {"0": (0, 1)})
    assert verdict is not None and verdict.reason(0) and verdict.reason(1) == ""


def test_a_waiting_rank_without_a_known_operation_proves_nothing():
    views = [RankView(0, Status.WAITING, wait=None), returned(1)]
    assert decide(views, {"0": (0, 1)}) is None


def test_a_wait_on_a_group_nobody_described_proves_nothing():
    assert decide([waiting(0, allreduce(1, group="9")), returned(1)], W) is None


def test_an_unseen_peer_is_skipped_and_the_next_one_still_proves_it():
    # rank 1 is running (no counts: possibly done), rank 2 returned without entering
    group = {"0": (0, 1, 2)}
    views = [waiting(0, allreduce(1)), running(1), returned(2)]
    verdict = decide(views, group)
    assert verdict is not None and verdict.stuck[0].waits_for == (2,)


def test_stuck_ranks_are_released_in_a_chain_when_its_end_can_still_move():
    # 0 waits on 1, 1 waits on 2 (each seen not done); 2 is running: nobody is proven stuck,
    # though 0 is only released once 1 is (a second round of the fixed point)
    group = {"0": (0, 1), "1": (1, 2)}
    nothing = Counts()
    views = [
        waiting(0, Op(Kind.RECV, "0", "recv", 1, peer=1), counts=nothing),
        waiting(1, Op(Kind.RECV, "1", "recv", 1, peer=2), counts=nothing),
        running(2),
    ]
    assert decide(views, group) is None


def test_a_receive_needs_the_send_on_its_own_group_tag_and_peer():
    recv = Op(Kind.RECV, "0", "recv", 1, peer=1, tag=3)
    elsewhere = Counts(sends={("1", 0, 3): 1, ("0", 0, 4): 1, ("0", 2, 3): 1})
    verdict = decide([waiting(0, recv), RankView(1, Status.RETURNED, counts=elsewhere)], W)
    assert verdict is not None
    assert verdict.reason(0).endswith("rank 1 returned having sent it 0 with tag 3")


def test_a_send_needs_the_receive_from_itself():
    send = Op(Kind.SEND, "0", "send", 1, peer=1, tag=0)
    from_others = Counts(recvs={("0", 5, 0): 1, ("1", 0, 0): 1})
    verdict = decide([waiting(0, send), RankView(1, Status.RETURNED, counts=from_others)], W)
    assert verdict is not None
    assert verdict.reason(0).endswith("rank 1 returned having received 0 from it with tag 0")


def test_one_collective_is_said_in_the_singular():
    views = [waiting(0, allreduce(2)), returned(1, collectives={"0": 1})]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None
    assert verdict.reason(0).endswith("it returned after 1 collective on group 0")


def test_a_peer_stuck_without_a_known_wait_is_named_by_where_it_is():
    blocked = RankView(1, Status.BLOCKED, counts=Counts(collectives={"0": 2}), where="ddp.py:9")
    views = [
        waiting(0, Op(Kind.RECV, "0", "recv", 1, peer=1)),
        blocked,
        returned(2, collectives={"0": 1}),
    ]
    verdict = decide(views, {"0": (0, 1, 2)})
    assert verdict is not None and verdict.ranks == [0, 1]
    assert verdict.reason(0).endswith("rank 1 has not done its part and waits itself, at ddp.py:9")


@pytest.mark.parametrize(
    ("peer", "says"),
    [
        (RankView(1, Status.DEAD, counts=Counts(collectives={"0": 0})), "rank 1 died after 0"),
        (returned(1, collectives={"0": 0}), "rank 1 returned after 0"),
    ],
    ids=["dead", "returned"],
)
def test_a_blocked_rank_names_how_its_peer_left(peer, says):
    blocked = RankView(0, Status.BLOCKED, counts=Counts(collectives={"0": 1}), where="x.py:1")
    verdict = decide([blocked, peer], {"0": (0, 1)})
    assert verdict is not None
    assert verdict.reason(0) == (
        "is blocked inside torch (x.py:1) having issued 1 collective on group 0 (from Python "
        f"or C++, e.g. DDP's gradient all-reduce); {says}: the collective #1 can never complete"
    )


@pytest.mark.parametrize(
    "peer",
    [
        RankView(1, Status.RETURNED, counts=None),  # counts not known
        running(1),  # may still issue it
        returned(1, collectives={"0": 2}),  # issued as many
    ],
    ids=["unknown", "running", "as-many"],
)
def test_a_blocked_rank_needs_a_finished_peer_with_fewer_collectives(peer):
    blocked = RankView(0, Status.BLOCKED, counts=Counts(collectives={"0": 2}), where="x.py:1")
    assert decide([blocked, peer], {"0": (0, 1)}) is None


def test_a_blocked_rank_without_counts_proves_nothing():
    blocked = RankView(0, Status.BLOCKED, counts=None, where="x.py:1")
    assert decide([blocked, returned(1)], {"0": (0, 1)}) is None


def test_a_mismatch_with_a_returned_rank_whose_line_is_unknown():
    done = Op(Kind.COLLECTIVE, "0", "all_reduce", 1, numel=3, dtype="float32")  # no site
    views = [
        returned(0, collectives={"0": 1}, issued={("0", 1): done}),
        waiting(1, allreduce(1, numel=4)),
    ]
    verdict = decide(views, {"0": (0, 1)})
    assert verdict is not None
    assert "rank 0 did that collective as all_reduce 3 elements float32: the ranks" in (
        verdict.reason(1)
    )


def test_point_to_point_waits_and_absent_peers_make_no_mismatch():
    send = Op(Kind.SEND, "0", "send", 1, peer=1)
    assert decide([waiting(0, send), waiting(1, Op(Kind.RECV, "0", "recv", 1, peer=0))],
                  {"0": (0, 1)}) is None  # fmt: skip
    assert decide([waiting(0, allreduce(1))], {"0": (0, 1)}) is None  # rank 1 never seen


def test_leftovers_whose_peer_is_unknown_or_any_are_not_called_unmatched():
    recv_any = Op(Kind.RECV, "0", "recv", 1, peer=ANY_SOURCE)
    recv_gone = Op(Kind.RECV, "0", "irecv", 1, peer=7)
    assert unmatched({0: [recv_any, recv_gone]}, {0: Counts()}, {"0": (0, 1)}) == {}


def test_a_receive_matched_by_exactly_as_many_sends_is_matched():
    irecv = Op(Kind.RECV, "0", "irecv", 2, peer=1)
    counts = {0: Counts(recvs={("0", 1, 0): 2}), 1: Counts(sends={("0", 0, 0): 2})}
    assert unmatched({0: [irecv]}, counts, {"0": (0, 1)}) == {}


def test_a_send_whose_receiver_took_it_is_in_progress():
    send = Op(Kind.SEND, "0", "send", 1, peer=1, tag=0)
    took = Counts(recvs={("0", 0, 0): 1})
    assert decide([waiting(0, send), RankView(1, Status.RETURNED, counts=took)], W) is None


def test_the_second_send_is_stuck_when_only_the_first_was_received():
    send = Op(Kind.SEND, "0", "send", 2, peer=1, tag=0)
    once = Counts(recvs={("0", 0, 0): 1, ("0", 3, 0): 4})
    verdict = decide([waiting(0, send), RankView(1, Status.RETURNED, counts=once)], W)
    assert verdict is not None
    assert verdict.reason(0).endswith("rank 1 returned having received 1 from it with tag 0")


def test_every_missing_peer_is_named():
    group = {"0": (0, 1, 2)}
    views = [waiting(0, allreduce(1)), returned(1), returned(2)]
    verdict = decide(views, group)
    assert verdict is not None and verdict.stuck[0].waits_for == (1, 2)
    assert verdict.reason(0).endswith(
        "rank 1 never entered it: it returned after 0 collectives on group 0; "
        "rank 2 never entered it: it returned after 0 collectives on group 0"
    )


def test_a_peer_that_waits_on_something_in_progress_is_passed_over_for_the_next():
    # rank 1 waits in a collective with rank 3 (running): it is not stuck; rank 2 returned
    groups = {"0": (0, 1, 2), "1": (1, 3)}
    views = [
        waiting(0, allreduce(1)),
        waiting(1, allreduce(1, group="1"), counts=Counts(collectives={"0": 0, "1": 1})),
        returned(2),
        running(3),
    ]
    verdict = decide(views, groups)
    assert verdict is not None and verdict.ranks == [0] and verdict.culprits == (2,)


def test_a_point_to_point_wait_is_never_a_mismatch_with_a_collective_of_the_same_number():
    send = Op(Kind.SEND, "0", "send", 1, peer=1)
    peer = returned(1, recvs={("0", 0, 0): 1}, issued={("0", 1): allreduce(1)})
    assert decide([waiting(0, send), peer], {"0": (0, 1)}) is None


def test_groups_nobody_described_and_ranks_nobody_saw_are_passed_over():
    blocked = RankView(0, Status.BLOCKED, counts=Counts(collectives={"7": 3}), where="x.py:1")
    assert decide([blocked, returned(1)], {"0": (0, 1)}) is None  # group 7: no members known
    lonely = RankView(0, Status.BLOCKED, counts=Counts(collectives={"0": 3}), where="x.py:1")
    assert decide([lonely], {"0": (0, 5)}) is None  # rank 5 never seen
    assert unmatched({0: [allreduce(1, group="7")]}, {0: Counts()}, {"0": (0,)}) == {}


def test_two_quantities_show_as_the_first_and_one_more():
    from harness._mutation.catalogue import Mutant, Outcome, table_rows

    o = Outcome(Mutant("s", "skip"), "m.py:1", "t::a", "grad, loss")
    assert table_rows([o])[0][2] == "killed by t::a (grad +1)"


# ---------------------------------------------------------------- a collective gloo aborted


def _a2a(index: int, site: str, numel: int = 8) -> Op:
    return Op(Kind.COLLECTIVE, "0", "all_to_all_single", index, numel=numel, site=site)


DIED_IN = _a2a(1, "model.py:7 in layer")


def test_a_rank_that_returned_before_the_collective_a_peer_died_in_skipped_it():
    members = [
        RankView(0, Status.DEAD, wait=DIED_IN),
        RankView(1, Status.RETURNED, counts=Counts(collectives={"0": 0})),
        RankView(
            2, Status.RETURNED, counts=Counts(collectives={"0": 1}, issued={("0", 1): DIED_IN})
        ),
    ]
    assert skipped_by(0, DIED_IN, members) == [
        (1, "rank 1 never entered it: it returned after 0 collectives on group 0")
    ]


def test_a_rank_that_did_that_collective_from_another_line_is_named_with_its_line():
    back = _a2a(1, "model.py:8 in layer", numel=16)  # the transpose back, as #1
    members = [
        RankView(0, Status.DEAD, wait=DIED_IN),
        RankView(1, Status.RUNNING, wait=back),  # its wait ended: it did it
        RankView(2, Status.WAITING, wait=DIED_IN),  # the same collective: innocent
        RankView(3, Status.WAITING, wait=Op(Kind.COLLECTIVE, "0", "all_reduce", 1)),
    ]
    found = dict(skipped_by(0, DIED_IN, members))
    assert sorted(found) == [1, 3]
    assert found[1] == (
        "rank 1 did that collective as all_to_all_single 16 elements at model.py:8 in layer: the "
        "ranks disagree on which collective #1 on group 0 is (rank 1 skipped one, or added one, "
        "before it)"
    )
    assert found[3].startswith("rank 3 was in that collective as all_reduce: the ranks")


def test_members_at_another_number_or_without_evidence_are_not_named():
    members = [
        RankView(1, Status.WAITING, wait=_a2a(2, "model.py:8 in layer")),  # behind or ahead
        RankView(2, Status.RUNNING),  # nothing known
        RankView(3, Status.RETURNED),  # no counts
        RankView(0, Status.WAITING, wait=Op(Kind.SEND, "0", "send", 1, peer=1)),
    ]
    assert skipped_by(0, DIED_IN, members) == []
    assert skipped_by(0, Op(Kind.RECV, "0", "recv", 1, peer=1), members) == []


def test_torch_2_13s_single_names_match_the_names_they_replace():
    gather = Op(Kind.COLLECTIVE, "0", "all_gather_into_tensor", 1, numel=4, dtype="float32")
    single = Op(Kind.COLLECTIVE, "0", "all_gather_single", 1, numel=4, dtype="float32")
    assert compatible(gather, single) and compatible(single, gather)
    assert not compatible(gather, Op(Kind.COLLECTIVE, "0", "all_gather_single", 1, numel=5))
    scatter = Op(Kind.COLLECTIVE, "0", "reduce_scatter_single", 1, numel=2)
    assert compatible(scatter, Op(Kind.COLLECTIVE, "0", "reduce_scatter_tensor", 1, numel=2))
    assert not compatible(scatter, single)


@pytest.mark.parametrize(
    ("op", "same_size"),
    [
        ("all_reduce", True),
        ("broadcast", True),
        ("reduce", True),
        ("all_gather_into_tensor", True),
        ("all_gather_single", True),  # torch 2.13's name of the one above
        ("reduce_scatter_tensor", True),
        ("all_to_all_single", False),  # uneven split sizes are legitimate
        ("gather", False),
        ("scatter", False),
    ],
)
def test_collectives_whose_members_pass_one_size_pair_only_at_equal_sizes(op, same_size):
    three = Op(Kind.COLLECTIVE, "0", op, 1, numel=3, dtype="float32")
    assert compatible(three, Op(Kind.COLLECTIVE, "0", op, 1, numel=3, dtype="float32"))
    assert compatible(three, Op(Kind.COLLECTIVE, "0", op, 1, numel=4, dtype="float32")) is (
        not same_size
    )


def test_a_broadcast_of_three_elements_against_one_of_four_is_a_proven_mismatch():
    def bcast(numel: int) -> Op:
        return Op(Kind.COLLECTIVE, "0", "broadcast", 1, numel=numel, dtype="float32")

    views = [waiting(0, bcast(3)), *[waiting(r, bcast(4)) for r in (1, 2, 3)]]
    verdict = decide(views, W)
    assert verdict is not None and verdict.kind == "mismatch" and verdict.ranks == [0, 1, 2, 3]
    assert decide([waiting(r, bcast(4)) for r in range(4)], W) is None  # the control


def test_a_dead_rank_every_other_member_disagrees_with_alike_is_the_one_that_skipped():
    # an empty rank returned early past all_reduce #1 and made the next one; gloo aborted
    # it when the others' data came: they agree, it is the odd one out (issue #36)
    skipped = Op(Kind.COLLECTIVE, "0", "all_reduce", 1, numel=100, site="m.py:6 in f")
    own = Op(Kind.COLLECTIVE, "0", "all_reduce", 1, numel=1, site="m.py:7 in f")
    members = [
        RankView(0, Status.RUNNING, wait=skipped),  # its wait ended (gloo failed it): did it
        RankView(1, Status.WAITING, wait=skipped),
        RankView(2, Status.WAITING, wait=skipped),
        RankView(3, Status.DEAD, wait=own),
    ]
    assert skipped_by(3, own, members) == [
        (
            3,
            "rank 3 is the odd one out: ranks 0, 1, 2 all did that collective as all_reduce 100 "
            "elements at m.py:6 in f (rank 3 skipped one, or added one, before it)",
        )
    ]
    # one member without evidence, or two that disagree among themselves: no proof of who
    assert [
        r for r, _ in skipped_by(3, own, [*members[:2], RankView(2, Status.RUNNING), members[3]])
    ] == [0, 1]
    other = Op(Kind.COLLECTIVE, "0", "all_reduce", 1, numel=100, site="m.py:9 in g")
    mixed = [*members[:2], RankView(2, Status.WAITING, wait=other), members[3]]
    assert [r for r, _ in skipped_by(3, own, mixed)] == [0, 1, 2]


PAIR = "the group of ranks [1, 2] (new_group at model.py:42)"


def test_a_group_with_a_label_is_named_by_it_where_torch_s_id_would_be():
    wait = Op(Kind.COLLECTIVE, "4", "all_reduce", 2, numel=1, dtype="float32", label=PAIR)
    verdict = decide([waiting(1, wait), returned(2, collectives={"4": 1})], {"4": (1, 2)})
    assert verdict is not None
    assert verdict.reason(1) == (
        f"waits in all_reduce #2 on {PAIR} (1 element float32) since 0.50s; "
        f"rank 2 never entered it: it returned after 1 collective on {PAIR}"
    )
    # without one (evidence from a rank that could not name it): torch's id
    assert Op(Kind.COLLECTIVE, "4", "barrier", 1).describe() == "barrier #1 on group 4"


def test_a_blocked_rank_names_the_group_by_a_label_among_what_it_issued_there():
    issued = {("4", 1): Op(Kind.COLLECTIVE, "4", "all_reduce", 1, label=PAIR)}
    blocked = RankView(
        1, Status.BLOCKED, counts=Counts(collectives={"4": 1}, issued=issued), where="x.py:1"
    )
    verdict = decide([blocked, returned(2, collectives={"4": 0})], {"4": (1, 2)})
    assert verdict is not None
    assert f"having issued 1 collective on {PAIR} (from Python" in verdict.reason(1)


def test_members_that_skipped_are_named_with_the_group_s_label():
    wait = Op(Kind.COLLECTIVE, "4", "all_to_all_single", 1, label=PAIR)
    found = skipped_by(1, wait, [returned(2, collectives={"4": 0})])
    assert found == [(2, f"rank 2 never entered it: it returned after 0 collectives on {PAIR}")]
