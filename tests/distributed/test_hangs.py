"""Hangs are proven, and named, long before the timeout; correct programs never are.

Each hang below is a real one (it would wait out any timeout); each is reported as a
``RankDeadlock`` with the evidence: who waits in what, and which rank never did its part.
Each correct program below makes some rank wait longer than the deadlock window (a long
collective, a late rank, async work finishing after the function returned), and passes.

The seconds in the assertions are a logic check with room for a loaded machine (a
deadlock is found in about a second, the timeout is 100 s); the seconds themselves are
measured in ``benchmarks/hangs.py``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankDeadlock, RankFailure, RankPending, RankPool, RankTimeout, UnwaitedWork
from harness.pool import DEADLOCK_WINDOW

LATE = 2 * DEADLOCK_WINDOW + 1.0  # longer than the window, with room: the point of each test

# ---------------------------------------------------------------- hangs


def mismatched_operations() -> None:
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, 0)


def mismatched_sizes() -> None:
    dist.all_reduce(torch.ones(3 + (dist.get_rank() > 0)))


def gone_while_others_wait_in_work_wait() -> None:
    if dist.get_rank() != 1:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        time.sleep(0.05)  # some work between issuing and waiting, as real code does
        work.wait()


def gone_while_others_wait_in_ddp_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    loss = model(torch.ones(2, 4)).sum()
    if dist.get_rank() != 2:  # rank 2 skips backward: DDP's reducer all-reduce never matches
        loss.backward()


def receive_from_each_other() -> None:
    if dist.get_rank() < 2:
        dist.recv(torch.zeros(2), 1 - dist.get_rank())


def opposite_orders_on_two_groups() -> None:
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), group=a)
        dist.all_reduce(torch.ones(1), group=b)
    elif dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1), group=b)
        dist.all_reduce(torch.ones(1), group=a)


def empty_rank_skips_then_goes_on() -> None:
    if dist.get_rank() != 3:  # rank 3 owns nothing: it returns early past the reduction
        dist.all_reduce(torch.ones(100))
    dist.all_reduce(torch.ones(1))  # the next collective every rank makes (a loss)


def hang_on_a_subgroup() -> None:
    pair = dist.new_group([1, 2])  # the line the messages name as the group's maker
    if dist.get_rank() == 1:  # rank 2 returns without its part
        dist.all_reduce(torch.ones(1), group=pair)


def _deadlock(spatial, fn) -> RankDeadlock:
    # a RankDeadlock is raised from the board's evidence only (the timeout raises
    # RankTimeout): proven, not waited out
    with pytest.raises(RankDeadlock) as info:
        spatial.run(fn, timeout=100)
    return info.value


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_different_collectives_at_the_same_point_are_a_deadlock_naming_both(spatial):
    err = _deadlock(spatial, mismatched_operations)
    assert [p.rank for p in err.problems if p.kind == "deadlock"] == [0, 1, 2, 3]
    assert "they wait in a collective that members of its group entered as another one" in str(err)
    rank0 = next(p for p in err.problems if p.rank == 0)
    assert rank0.summary.startswith(
        "waits in all_reduce #1 on the world group (3 elements float32)"
    )
    assert "as broadcast 3 elements float32 at " in rank0.summary
    assert "in mismatched_operations" in rank0.summary  # both lines are named
    assert spatial.run(dist.get_rank) == [0, 1, 2, 3]  # only that run failed


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_one_collective_with_different_sizes_is_a_deadlock_naming_the_sizes(spatial):
    err = _deadlock(spatial, mismatched_sizes)
    stuck = [p for p in err.problems if p.kind == "deadlock"]
    assert [p.rank for p in stuck] == [1, 2, 3]  # rank 0 finished its smaller all_reduce
    assert all("(4 elements float32)" in p.summary for p in stuck)
    assert all(
        "rank 0 did that collective as all_reduce 3 elements float32" in p.summary for p in stuck
    )
    culprit = err.problems[0]
    assert (culprit.rank, culprit.kind) == (0, "returned")
    assert "entered as a different operation or size" in culprit.summary


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_rank_gone_while_the_others_wait_in_work_wait_is_a_deadlock(spatial):
    err = _deadlock(spatial, gone_while_others_wait_in_work_wait)
    assert err.returned == [1] and err.ranks == [0, 2, 3]
    stuck = [p for p in err.problems if p.kind == "deadlock"]
    assert all("in gone_while_others_wait_in_work_wait" in p.summary for p in stuck)
    gone = "rank 1 never entered it: it returned after 0 collectives on the world group"
    assert all(p.summary.endswith(gone) for p in stuck)


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_rank_gone_while_the_others_wait_in_ddps_backward_is_a_deadlock(spatial):
    err = _deadlock(spatial, gone_while_others_wait_in_ddp_backward)
    # a rank idle inside torch is seen through its probe: on a loaded machine a peer's answer
    # may come after the proof, which then names the ranks it saw (never one outside 0, 1, 3)
    # and says of the others that they were not proven part of it
    assert err.returned == [2] and err.ranks and set(err.ranks) <= {0, 1, 3}
    unseen = [p for p in err.problems if p.kind == "stopped"]
    assert {p.rank for p in unseen} == {0, 1, 3} - set(err.ranks)
    assert all("not proven part of the deadlock" in p.summary for p in unseen)
    stuck = [p for p in err.problems if p.kind == "deadlock"]
    assert all(p.summary.startswith("is blocked inside torch (") for p in stuck)
    assert all("rank 2 returned after" in p.summary for p in stuck)
    assert all("can never complete" in p.summary for p in stuck)
    assert all("backward" in p.detail for p in stuck)  # each stack shows where


@pytest.mark.spatial_pool
def test_two_ranks_receiving_from_each_other_are_a_deadlock_cycle(spatial):
    err = _deadlock(spatial, receive_from_each_other)
    assert err.ranks == [0, 1] and err.returned == []  # no culprit: each waits on the other
    assert "they wait for each other in a cycle" in str(err)
    stopped = [p for p in err.problems if p.kind == "stopped"]
    assert stopped == []  # ranks 2 and 3 returned: they are no part of it


@pytest.mark.spatial_pool
def test_collectives_in_opposite_orders_on_two_groups_are_a_deadlock_cycle(spatial):
    err = _deadlock(spatial, opposite_orders_on_two_groups)
    assert err.ranks == [0, 1]
    assert "they wait for each other in a cycle" in str(err)


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_timeout_without_proof_blames_nobody(spatial):
    # rank 0 is only late for a collective of ranks 0-2; rank 3, no member, returned at once
    with pytest.raises(RankTimeout) as info:
        spatial.run(_late_in_a_subgroup, 60.0, timeout=3 * DEADLOCK_WINDOW + 2)
    err = info.value
    assert not isinstance(err, RankDeadlock)
    assert err.returned == [] and err.ranks == [0, 1, 2]
    assert "rank 3/4 (after " in str(err) and "Nothing proves a deadlock" in str(err)
    waiting = [p for p in err.problems if p.rank in (1, 2)]
    lines, first = inspect.getsourcelines(_late_in_a_subgroup)
    made = next(first + i for i, line in enumerate(lines) if "new_group" in line)
    group = f"the group of ranks [0, 1, 2] (new_group at test_hangs.py:{made})"
    assert all(
        "waiting since" in p.summary and f"in all_reduce on {group}" in p.summary for p in waiting
    )


def _late_in_a_subgroup(seconds: float) -> float:
    group = dist.new_group([0, 1, 2])
    if dist.get_rank() == 3:
        return 0.0
    if dist.get_rank() == 0:
        time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


# ---------------------------------------------------------------- correct programs


def collective_longer_than(target: float, cap: int) -> tuple[float, int]:
    """One all_reduce, made larger until it alone takes ``target`` seconds on the slowest
    rank (or its size reaches ``cap`` elements)."""
    n, took = 1 << 20, 0.0
    while True:
        t = torch.ones(n)
        t0 = time.monotonic()
        dist.all_reduce(t)
        slowest = torch.tensor([time.monotonic() - t0])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank decides together
        took = slowest.item()
        if took >= target or n >= cap:
            return took, n
        n *= 2


@pytest.mark.spatial_pool
def test_a_collective_longer_than_the_window_is_in_progress_not_a_deadlock():
    # A window of 0.05 s and one all_reduce of up to 128 M floats (512 MB a rank; 64 M took
    # only 0.46 s on a quiet machine) that lasts 0.5 s or more: the watch (reading the board
    # every 0.1 s) sees every rank inside it for ten windows, and must let it finish.
    window = 0.05
    with RankPool(4, start_method="forkserver", deadlock_window=window, timeout=300) as pool:
        took = pool.run(collective_longer_than, 10 * window, 1 << 27)
    assert min(t for t, _ in took) >= 10 * window, "not long enough to prove anything"


def late_rank(how: str, seconds: float) -> float:
    """Rank 0 arrives late at a collective, the others wait for it there."""
    if dist.get_rank() == 0:
        if how == "sleep":
            time.sleep(seconds)
        elif how == "subprocess":
            subprocess.run(
                [sys.executable, "-c", f"import time; time.sleep({seconds})"], check=True
            )
        elif how == "lock":
            lock = threading.Lock()
            lock.acquire()
            threading.Timer(seconds, lock.release).start()
            lock.acquire()  # held by another thread for `seconds`
        elif how == "file":
            t0, path = time.monotonic(), f"{tempfile.gettempdir()}/harness-late-{os.getpid()}"
            with open(path, "wb") as f:
                while time.monotonic() - t0 < seconds:
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    os.fsync(f.fileno())
            os.unlink(path)
        elif how == "compute":
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                torch.randn(64, 64) @ torch.randn(64, 64)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("how", ["sleep", "subprocess", "lock", "file", "compute"])
@pytest.mark.spatial(timeout=120)
@pytest.mark.assumes_ranks(4)
def test_a_late_rank_is_waited_for_and_never_blamed(spatial, how):
    assert spatial.run(late_rank, how, LATE) == [4.0] * 4


def late_between_many_collectives(seconds: float) -> int:
    for i in range(20):
        if i == 10 and dist.get_rank() == 3:
            time.sleep(seconds)
        dist.all_reduce(torch.ones(1))
    return 20


@pytest.mark.spatial(timeout=120)
@pytest.mark.assumes_ranks(4)
def test_a_rank_late_in_the_middle_of_many_collectives_is_waited_for(spatial):
    assert spatial.run(late_between_many_collectives, LATE) == [20] * 4


def async_waited_late(seconds: float) -> float:
    t = torch.ones(1)
    work = dist.all_reduce(t, async_op=True)
    time.sleep(seconds if dist.get_rank() == 1 else 0.0)  # computing while it completes
    work.wait()
    return t.item()


@pytest.mark.spatial(timeout=120)
@pytest.mark.assumes_ranks(4)
def test_async_work_waited_on_late_passes_without_a_warning(spatial, recwarn):
    assert spatial.run(async_waited_late, LATE) == [4.0] * 4
    assert not [w for w in recwarn if issubclass(w.category, UnwaitedWork)]


def async_never_waited() -> int:
    dist.all_reduce(torch.ones(1), async_op=True)  # matched on every rank, never waited on
    return dist.get_rank()


def isend_received_late(seconds: float) -> list[float]:
    t = torch.zeros(3)
    if dist.get_rank() == 0:
        dist.isend(torch.ones(3), 1)  # returns at once, the receive comes later
    elif dist.get_rank() == 1:
        time.sleep(seconds)
        dist.recv(t, 0)
    return t.tolist()


# the post-run audit of work left in flight (and UnwaitedWork) is the pool's, not a launcher's
@pytest.mark.spatial_pool
@pytest.mark.spatial(timeout=120)
@pytest.mark.assumes_ranks(4)
def test_matched_async_work_that_completes_after_return_is_not_pending(spatial):
    never = r"rank 0, 1, 2, 3: all_reduce issued at .*test_hangs.py:\d+ in async_never_waited was"
    with pytest.warns(UnwaitedWork, match=never):
        assert spatial.run(async_never_waited) == [0, 1, 2, 3]
    with pytest.warns(UnwaitedWork, match=r"rank 0: isend issued at .* in isend_received_late"):
        assert spatial.run(isend_received_late, LATE)[1] == [1.0, 1.0, 1.0]
    assert spatial.run(dist.get_rank) == [0, 1, 2, 3]  # and the groups were left clean


def unmatched_isend() -> int:
    if dist.get_rank() == 0:
        dist.isend(torch.ones(3), 1)
    return 0


@pytest.mark.spatial_pool
def test_only_truly_unmatched_work_is_pending(spatial):
    with pytest.raises(RankPending) as info:
        spatial.run(unmatched_isend)
    assert info.value.problems[0].summary.endswith("can never complete: rank 1 never received it")


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_rank_that_skipped_a_collective_gloo_aborted_is_named_whichever_rank_died(spatial):
    # gloo aborts whichever side reads the other's data first (here nearly always rank 3,
    # the one that skipped); the report names rank 3 either way, and no innocent rank
    with pytest.raises(RankFailure) as info:
        spatial.run(empty_rank_skips_then_goes_on, timeout=100)
    text = str(info.value)
    assert "(rank 3 skipped one, or added one, before it)" in text, text
    assert not any(f"(rank {r} skipped one" in text for r in (0, 1, 2)), text


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_hang_on_a_subgroup_names_the_group_by_its_ranks_and_the_line_that_made_it(spatial):
    err = _deadlock(spatial, hang_on_a_subgroup)
    lines, first = inspect.getsourcelines(hang_on_a_subgroup)
    made = next(first + i for i, line in enumerate(lines) if "new_group" in line)
    group = f"the group of ranks [1, 2] (new_group at test_hangs.py:{made})"
    (stuck,) = [p for p in err.problems if p.kind == "deadlock"]
    assert stuck.rank == 1
    assert stuck.summary.startswith(f"waits in all_reduce #1 on {group} (1 element float32)")
    assert stuck.summary.endswith(
        f"rank 2 never entered it: it returned after 0 collectives on {group}"
    )
    culprit = next(p for p in err.problems if p.rank == 2)
    assert f"having issued 0 collectives on {group}" in culprit.summary
    assert "group 1" not in str(err) and "group 2" not in str(err)  # torch's ids: never shown
