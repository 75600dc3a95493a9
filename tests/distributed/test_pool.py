"""The warm rank pool: results, failures of every kind, isolation between runs."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import PicklingProblem, RankCrash, RankError, RankPool, RankTimeout, Topology
from harness.errors import RankDeadlock, RankPending

# ---------------------------------------------------------------- rank functions


def rank_and_sum(offset: float) -> tuple[int, int, float]:
    t = torch.tensor([dist.get_rank() + offset], dtype=torch.float64)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def raise_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait here for the rank that raised
    return 0


def exit_on(bad_rank: int, how: str) -> int:
    if dist.get_rank() == bad_rank:
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), getattr(signal, how))
    t = torch.ones(1)
    dist.all_reduce(t)
    return 0


def skip_collective_on(bad_rank: int) -> int:
    if dist.get_rank() != bad_rank:
        t = torch.ones(1)
        dist.all_reduce(t)
    return 0


def spin_forever() -> None:
    while True:
        time.sleep(0.01)


def return_lambda() -> object:
    return lambda: 0


def print_and_return(text: str) -> str:
    print(f"{text} from rank {dist.get_rank()}")
    return text


def leave_state_behind() -> None:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)


def read_state() -> tuple[torch.dtype, bool, float]:
    return torch.get_default_dtype(), torch.is_grad_enabled(), torch.rand(1).item()


def leave_collective_pending(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited on; peers never enter it
    return 0


def leave_isend_unmatched() -> int:
    if dist.get_rank() == 0:
        dist.isend(torch.full((3,), 7.0), 1)  # rank 1 never receives it
    return 0


def send_and_receive() -> list[float]:
    """A send from rank 0 to rank 1: what the next test after an unmatched isend does."""
    t = torch.zeros(3)
    if dist.get_rank() == 0:
        dist.send(torch.ones(3), 1)
    elif dist.get_rank() == 1:
        dist.recv(t, 0)
    return t.tolist()


def uneven_point_to_point() -> int:
    """A legitimate exchange whose operation counts differ per rank (an edge of a halo)."""
    rank = dist.get_rank()
    reqs = []
    if rank == 0:
        reqs.append(dist.isend(torch.ones(2), 1))
    if rank == 1:
        reqs.append(dist.irecv(torch.zeros(2), 0))
    for req in reqs:
        req.wait()
    return rank


def set_environment() -> str | None:
    os.environ["HARNESS_TEST_LEAK"] = "from the previous test"
    return os.environ.pop("OMP_NUM_THREADS", None)


def read_environment() -> tuple[str | None, str | None]:
    return os.environ.get("HARNESS_TEST_LEAK"), os.environ.get("OMP_NUM_THREADS")


def set_module_global() -> int:
    global LEFT_BEHIND
    LEFT_BEHIND = os.getpid()  # type: ignore[name-defined]
    return os.getpid()


def read_module_global() -> int | None:
    return globals().get("LEFT_BEHIND")


def topology_of(spatial_size: int | None) -> dict[str, int]:
    topo = Topology.create(spatial_size)
    t = torch.tensor([float(topo.rank)])
    dist.all_reduce(t, group=topo.spatial_group)  # sums over this spatial group only
    return {
        "spatial_rank": topo.spatial_rank,
        "data_rank": topo.data_rank,
        "spatial_sum": int(t.item()),
    }


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_run_returns_every_ranks_result_in_rank_order(spatial, ranks):
    results = spatial.run(rank_and_sum, 0.5, ranks=ranks)
    expected_sum = sum(r + 0.5 for r in range(ranks))
    assert results == [(r, ranks, expected_sum) for r in range(ranks)]


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_rank_that_raises_is_named_with_its_traceback_and_the_pool_survives(spatial):
    with pytest.raises(RankError) as info:
        spatial.run(raise_on, 2)
    err = info.value
    assert err.ranks[0] == 2, "the rank that raised first is listed first"
    assert "rank 2/4 raised ValueError: deliberate failure on rank 2" in str(err)
    assert "raise ValueError" in err.problems[0].detail  # the rank's own traceback
    assert spatial.run(rank_and_sum, 0.0)[0][2] == 6.0


@pytest.mark.parametrize(
    ("how", "says"),
    [("exit", "exited with code 7"), ("SIGKILL", "killed by SIGKILL"), ("SIGSEGV", "SIGSEGV")],
)
@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_rank_that_dies_is_named_within_a_second_and_the_pool_restarts(spatial, how, says):
    pool = spatial.pool(4)
    spatial.run(rank_and_sum, 0.0)  # warm
    starts = pool.starts
    with pytest.raises(RankCrash) as info:
        spatial.run(exit_on, 1, how, timeout=60)
    # Noticed through the process sentinel, not by running into the timeout (that would be
    # a RankTimeout): evidence, where a stopwatch fails on a loaded runner.
    assert type(info.value) is RankCrash
    # the rank that died is named first; its peers may follow when gloo aborts them on the
    # lost connection (seen on a loaded machine: [1, 0, 2])
    first = info.value.problems[0]
    assert (first.rank, first.kind) == (1, "crash") and says in first.summary
    assert says in str(info.value)
    if how == "SIGSEGV":  # faulthandler's Python traceback of the crashing rank
        assert "exit_on" in info.value.problems[0].detail
    assert spatial.run(rank_and_sum, 0.0)[3] == (3, 4, 6.0)
    assert pool.starts == starts + 1


@pytest.mark.spatial(timeout=100)
@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_skipped_collective_is_a_deadlock_found_long_before_the_timeout(spatial):
    with pytest.raises(RankDeadlock) as info:
        spatial.run(skip_collective_on, 3)
    # found by the deadlock watch (about 2-3 s), not by the 100 s timeout: the message says
    # "before the 100s timeout" (checked below); the seconds are measured in benchmarks/hangs.py
    err = info.value
    assert isinstance(err, RankTimeout)  # code that handles hangs handles this too
    assert err.ranks == [0, 1, 2]
    # the rank that returned is the culprit, by evidence: it never entered what they wait in
    assert err.returned == [3] and err.problems[0].rank == 3
    assert err.problems[0].summary.startswith("returned after ")
    assert "having issued 0 collectives on the world group, while rank(s) 0, 1, 2 wait" in (
        err.problems[0].summary
    )
    assert str(err).startswith("run deadlocked on rank 0/4, 1/4, 2/4 (found ")
    assert "before the 100s timeout): they wait for rank 3/4, which returned without" in str(err)
    waiting = [p for p in err.problems if p.kind == "deadlock"]
    assert [p.rank for p in waiting] == [0, 1, 2]
    for problem in waiting:
        assert "skip_collective_on" in problem.detail  # each waiting rank's stack
        assert "all_reduce" in problem.detail
        assert problem.summary.startswith(
            "waits in all_reduce #1 on the world group (1 element float32)"
        )
        assert "test_pool.py:" in problem.summary  # the line that issued it
        assert problem.summary.endswith(
            "rank 3 never entered it: it returned after 0 collectives on the world group"
        )
    assert spatial.run(rank_and_sum, 0.0)[0][2] == 6.0  # only that run failed


def print_then_skip_collective_on(bad_rank: int) -> int:
    print(f"about to all_reduce on rank {dist.get_rank()}", flush=True)
    return skip_collective_on(bad_rank)


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_what_hung_ranks_printed_is_in_the_report_although_their_processes_are_gone(spatial):
    # the pool kills hung ranks and removes their directory, logs included: read first
    with pytest.raises(RankDeadlock) as info:
        spatial.run(print_then_skip_collective_on, 3)
    assert sorted(p.rank for p in info.value.problems) == [0, 1, 2, 3]
    for problem in info.value.problems:
        assert problem.output == f"about to all_reduce on rank {problem.rank}\n"


@pytest.mark.spatial_pool
def test_without_deadlock_detection_a_skipped_collective_waits_for_the_timeout():
    # 8 s: long enough for rank 3 to have returned even on a loaded runner, so the verdict
    # does not depend on a few seconds being enough; the wait itself is the point
    with RankPool(4, timeout=8, start_method="forkserver", deadlock_window=0) as pool:
        with pytest.raises(RankTimeout) as info:
            pool.run(skip_collective_on, 3)
        err = info.value
        assert not isinstance(err, RankDeadlock)
        assert str(err).startswith("run timed out after 8s on rank 0/4, 1/4, 2/4")
        assert [p.rank for p in err.problems if p.kind == "timeout"] == [0, 1, 2]
        assert err.returned == []  # no proof was sought: nobody is blamed
        assert "rank 3/4 (after " in str(err) and "Nothing proves a deadlock" in str(err)


def compute_then_reduce(seconds: float) -> float:
    """Slow but correct: rank 0 computes (here: sleeps) while the others wait for it."""
    if dist.get_rank() == 0:
        time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def many_small_collectives(seconds: float) -> int:
    """Slow but correct: a long loop of collectives, each completing."""
    n, t0 = 0, time.monotonic()
    while True:  # every rank decides together when to stop (MIN over the group)
        flag = torch.tensor([1.0 if time.monotonic() - t0 < seconds else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        n += 1
        if flag.item() == 0.0:
            return n


@pytest.mark.spatial(timeout=60)
@pytest.mark.assumes_ranks(4)
def test_a_rank_computing_longer_than_the_window_is_not_a_deadlock(spatial):
    assert spatial.run(compute_then_reduce, 5.0) == [4.0] * 4


@pytest.mark.spatial(timeout=60)
def test_a_long_loop_of_completing_collectives_is_not_a_deadlock(spatial):
    counts = spatial.run(many_small_collectives, 5.0)
    assert len(set(counts)) == 1 and counts[0] > 1


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_busy_loop_times_out_on_every_rank(spatial):
    with pytest.raises(RankTimeout) as info:
        spatial.run(spin_forever, timeout=1.5)
    assert info.value.ranks == [0, 1, 2, 3]
    assert all("spin_forever" in p.detail for p in info.value.problems)


def loader_fails() -> None:
    raise ValueError("the loader failed on its input")


def wait_for_a_failed_worker() -> object:
    inbox: queue.Queue[object] = queue.Queue()
    worker = threading.Thread(target=loader_fails, name="loader")
    worker.start()
    worker.join()  # it raised (and its hook ran) before the wait: no race with the timeout
    return inbox.get()  # waits for ever: the worker never puts anything


@pytest.mark.spatial_pool
def test_a_hung_rank_names_the_exception_its_worker_thread_raised(spatial):
    with pytest.raises(RankTimeout) as info:
        spatial.run(wait_for_a_failed_worker, ranks=2, timeout=3)
    assert [p.rank for p in info.value.problems] == [0, 1]
    for problem in info.value.problems:
        assert problem.summary.endswith(
            "; its thread 'loader' raised ValueError: the loader failed on its input"
        )
        assert "wait_for_a_failed_worker" in problem.detail  # the main thread's stack
        assert 'raise ValueError("the loader failed on its input")' in problem.detail


@pytest.mark.spatial_pool
def test_an_unpicklable_result_names_the_rank_and_type(spatial):
    with pytest.raises(RankError, match=r"rank 0 returned a builtins.function that cannot be"):
        spatial.run(return_lambda, ranks=2)


@pytest.mark.spatial_pool
def test_a_function_defined_inside_a_test_gets_advice_to_move_it(spatial):
    def local_fn() -> None:
        pass

    with pytest.raises(PicklingProblem, match="Move it to module level"):
        spatial.run(local_fn)


@pytest.mark.spatial_pool
def test_unpicklable_arguments_are_refused_before_any_rank_runs(spatial):
    with pytest.raises(PicklingProblem, match="arguments picklable"):
        spatial.run(print_and_return, lambda: 0)


@pytest.mark.spatial_pool
def test_a_run_cannot_leak_dtype_rng_or_grad_mode_into_the_next(spatial):
    before = spatial.run(read_state, ranks=2)
    spatial.run(leave_state_behind, ranks=2)
    after = spatial.run(read_state, ranks=2)
    assert [a[:2] for a in after] == [(torch.float32, True)] * 2
    assert after == before  # the RNG was put back too: the same draw again


@pytest.mark.spatial_pool
def test_what_ranks_print_is_kept_per_rank(spatial):
    spatial.run(print_and_return, "hello", ranks=3)
    outputs = spatial.pool(3).last_outputs
    assert outputs == [f"hello from rank {r}\n" for r in range(3)]


@pytest.mark.parametrize(
    ("spatial_size", "expected"),
    [
        (None, [(r, 0, 6) for r in range(4)]),
        (2, [(0, 0, 1), (1, 0, 1), (0, 1, 5), (1, 1, 5)]),
        (1, [(0, r, r) for r in range(4)]),
    ],
    ids=["s4d1", "s2d2", "s1d4"],
)
@pytest.mark.assumes_ranks(4)
def test_topology_groups_consecutive_ranks_into_spatial_groups(spatial, spatial_size, expected):
    got = spatial.run(topology_of, spatial_size)
    assert [(g["spatial_rank"], g["data_rank"], g["spatial_sum"]) for g in got] == expected


@pytest.mark.spatial_pool
def test_two_pools_run_side_by_side_without_colliding():
    # One of each start method: spawn is the portable default, forkserver the fast one.
    with RankPool(2, timeout=60) as a, RankPool(3, timeout=60, start_method="forkserver") as b:
        assert a.run(rank_and_sum, 1.0)[1] == (1, 2, 3.0)
        assert b.run(rank_and_sum, 1.0)[2] == (2, 3, 6.0)
        assert a.run(rank_and_sum, 0.0)[0] == (0, 2, 1.0)
        pids = a.pids + b.pids
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "closing a pool ends its rank processes"


@pytest.mark.spatial_pool
def test_pools_of_every_world_size_fork_from_one_fork_server():
    # torch is imported once, in the fork server; a pool of another size is cheap forks of
    # it, never a second server (which would import torch again, seconds and ~200 MiB)
    from harness.pool import PoolRegistry

    registry = PoolRegistry(start_method="forkserver", max_processes=16)
    try:
        for size in (1, 2, 3):
            assert [r[1] for r in registry.get(size).run(rank_and_sum, 0.0)] == [size] * size
        assert registry.live == [1, 2, 3], "every size stays alive within the process cap"
        parents = {_parent(pid) for size in (1, 2, 3) for pid in registry.get(size).pids}
        assert len(parents) == 1 and os.getpid() not in parents, parents
    finally:
        registry.close()


def modules_loaded(names: list[str]) -> list[bool]:
    import sys

    return [name in sys.modules for name in names]


@pytest.mark.spatial_pool
def test_a_fresh_forkserver_rank_has_the_heavy_imports_of_the_steppers_before_its_first_run():
    # healpy (astropy under it) imported in each rank of each pool cost a layout sweep 1-5 s
    # a pool; forked from the server that imported it once, a rank starts with it
    with RankPool(1, start_method="forkserver", timeout=60) as pool:
        assert pool.run(modules_loaded, ["healpy", "torch_harmonics.distributed"]) == [[True, True]]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # state, then the parent pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- a clean rank for every test


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
def test_a_collective_left_pending_fails_its_own_run_and_not_the_next(spatial):
    with pytest.raises(RankPending) as info:
        spatial.run(leave_collective_pending, 2)
    err = info.value
    assert err.ranks == [2]
    assert str(err).startswith(
        "rank 2/4 returned with communication still pending: all_reduce #1 on the world group "
        "(1 element float32) at "
    )
    assert "test_pool.py" in err.problems[0].summary  # where it was issued
    assert "in leave_collective_pending can never complete: rank 0, 1, 3 never entered it" in (
        err.problems[0].summary
    )
    assert spatial.run(rank_and_sum, 0.0)[0][2] == 6.0  # the next run is innocent and passes


def leave_work_in_flight_on(bad_ranks: tuple[int, ...], how: str) -> int:
    """Work in flight on ``bad_ranks`` that the other ranks never join."""
    if dist.get_rank() in bad_ranks:
        if how == "functional":  # issued from C++: the harness does not see it one by one
            import torch.distributed._functional_collectives as fc

            global IN_FLIGHT
            IN_FLIGHT = fc.all_reduce(torch.ones(1), "sum", dist.group.WORLD)  # type: ignore[name-defined]
        else:
            dist.all_reduce(torch.ones(1), async_op=True)  # never waited on
            if how == "raise":
                raise ValueError("raised with an all_reduce in flight")
    return 0


@pytest.mark.spatial_pool
@pytest.mark.assumes_ranks(4)
@pytest.mark.parametrize(
    ("how", "bad", "failure"),
    [
        ("pending", (0, 1), RankPending),  # the case: gloo pairs 0 and 1 in the ring
        ("pending", (0, 1, 2), RankPending),
        ("raise", (0, 1), RankError),
        ("functional", (0, 1), None),
    ],
)
def test_whatever_a_run_leaves_in_flight_the_next_innocent_run_passes(spatial, how, bad, failure):
    # Tearing a gloo group down waits for its worker threads; one inside an all_reduce that
    # can never complete waits there until gloo's timeout (twice the run's). A rank torn
    # down in place sat in destroy_process_group through the next run, whose ranks all hung
    # in init_process_group: that innocent run timed out. The pool replaces such ranks.
    if failure is None:  # a run that passes (the harness cannot see this work one by one)
        with contextlib.suppress(RankPending):
            spatial.run(leave_work_in_flight_on, bad, how)
    else:
        with pytest.raises(failure) as info:
            spatial.run(leave_work_in_flight_on, bad, how)
        # the failure itself, at once: not a timeout of ranks stuck tearing down
        assert type(info.value) is failure and sorted(info.value.ranks) == list(bad)
    assert spatial.run(rank_and_sum, 0.0)[0][2] == 6.0


@pytest.mark.spatial_pool
def test_an_unmatched_isend_fails_its_own_run_and_not_the_next(spatial):
    with pytest.raises(RankPending) as info:
        spatial.run(leave_isend_unmatched, timeout=20)
    assert info.value.ranks == [0]
    assert info.value.problems[0].summary.startswith("isend to rank 1 (tag 0, #1) (3 elements")
    assert info.value.problems[0].summary.endswith("can never complete: rank 1 never received it")
    # before the fence this next exchange hung (and was blamed for a skipped collective)
    assert spatial.run(send_and_receive, timeout=20)[1] == [1.0, 1.0, 1.0]


@pytest.mark.assumes_ranks(4)
def test_uneven_but_matched_point_to_point_passes_and_so_does_the_next_run(spatial):
    for _ in range(2):
        assert spatial.run(uneven_point_to_point) == [0, 1, 2, 3]
        assert spatial.run(send_and_receive)[1] == [1.0, 1.0, 1.0]


@pytest.mark.spatial_pool
def test_environment_variables_set_by_a_run_do_not_reach_the_next(spatial):
    before = spatial.run(read_environment, ranks=2)
    spatial.run(set_environment, ranks=2)
    assert spatial.run(read_environment, ranks=2) == before
    assert before[0] == (None, "1")  # the ranks' OMP_NUM_THREADS, which the run popped


@pytest.mark.spatial_pool
@pytest.mark.parametrize("victim", [0, 3])
@pytest.mark.assumes_ranks(4)
def test_a_rank_killed_while_idle_is_replaced_silently(spatial, victim):
    pool = spatial.pool(4)
    for _ in range(5):  # at once after the kill: the race that used to fail every time
        spatial.run(rank_and_sum, 0.0)
        starts = pool.starts
        os.kill(pool.pids[victim], signal.SIGKILL)
        assert spatial.run(rank_and_sum, 0.0)[3] == (3, 4, 6.0)
        assert pool.starts == starts + 1


@pytest.mark.spatial_pool
def test_warm_ranks_keep_module_globals_between_tests(spatial):
    spatial.run(set_module_global, ranks=2)
    assert spatial.run(read_module_global, ranks=2) == spatial.pool(2).pids


@pytest.mark.spatial(ranks=2, fresh=True)
@pytest.mark.spatial_pool
def test_a_fresh_test_gets_brand_new_rank_processes(spatial):
    assert spatial.run(read_module_global) == [None, None]
    pids = spatial.run(set_module_global)
    assert spatial.run(read_module_global) == pids  # fresh for the test, warm within it


@pytest.mark.spatial_pool
def test_the_processes_of_a_fresh_test_do_not_outlive_it(pytester):
    pytester.makepyfile(
        """
        import os
        import pytest

        def pid():
            return os.getpid()

        def test_warm(spatial):
            pytest.shared = spatial.run(pid, ranks=2)

        @pytest.mark.spatial(ranks=2, fresh=True)
        def test_fresh(spatial):
            pytest.fresh = spatial.run(pid)
            assert set(pytest.fresh).isdisjoint(pytest.shared)

        def test_after(spatial):
            after = spatial.run(pid, ranks=2)
            assert set(after).isdisjoint(pytest.fresh) and set(after).isdisjoint(pytest.shared)
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)


# ---------------------------------------------------------------- the fence, proven


def fence_with_own_run_id(run_id: int) -> tuple[bool, str]:
    """The pool's fence collective, as if each rank were in a different run."""
    from harness._rank.loop import _verify_group

    return _verify_group(run_id + dist.get_rank(), dist.get_world_size())


def test_a_fence_that_pairs_other_runs_is_refused_with_what_it_got(spatial):
    answers = spatial.run(fence_with_own_run_id, 10, ranks=2)
    # run ids 10 and 11 sum to 21, not the 2 x 10 (or 2 x 11) each rank expects
    assert answers == [
        (False, "fence collective gave [21.0, 2.0], expected [20.0, 2.0]"),
        (False, "fence collective gave [21.0, 2.0], expected [22.0, 2.0]"),
    ]


def sequence_at_start() -> int:
    return int(dist.group.WORLD._get_sequence_number_for_group())


def send_behind_the_watch() -> int:
    """A send and receive on gloo's backend object itself, which the harness does not see:
    rank 0 and 1 count one operation more than ranks 2 and 3 on the world group."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if dist.get_rank() == 0:
        backend.send([torch.ones(1)], 1, 0).wait()
    elif dist.get_rank() == 1:
        backend.recv([torch.zeros(1)], 0, 0).wait()
    return 0


@pytest.mark.spatial_pool  # group reuse between runs is the pool's; a launcher keeps its one group
@pytest.mark.assumes_ranks(4)
def test_a_group_whose_members_counts_differ_is_never_reused(spatial):
    spatial.run(rank_and_sum, 0.0)
    assert min(spatial.run(sequence_at_start)) > 0  # in step: the next run reuses the group
    spatial.run(send_behind_the_watch)
    assert spatial.run(sequence_at_start) == [0, 0, 0, 0]  # a brand-new group


def draw_from_every_rng() -> tuple[float, float, float]:
    import random

    import numpy as np

    return torch.rand(1).item(), float(np.random.rand()), random.random()


def test_numpy_and_python_rngs_are_put_back_like_torchs(spatial):
    first = spatial.run(draw_from_every_rng, ranks=2)
    spatial.run(draw_from_every_rng, ranks=2)  # moves every generator on
    assert spatial.run(draw_from_every_rng, ranks=2) == first


# ---------------------------------------------------------------- a start takes what it takes

#: a module a rank imports at start (``preload``): it burns CPU, or sleeps, for a while
AT_START = """
import multiprocessing, time

if not multiprocessing.current_process().name.startswith("harness-rank"):
    # the fork server skips a preload that raises ImportError: ranks import it afresh
    raise ImportError("only rank processes import this module")
t0 = time.monotonic()
while time.monotonic() - t0 < {seconds}:
    {body}
"""


def _start_module(tmp_path, monkeypatch, name: str, seconds: float, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(AT_START.format(seconds=seconds, body=body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.spatial_pool
def test_a_start_that_takes_long_but_makes_progress_is_waited_for(tmp_path, monkeypatch):
    import harness.pool

    # no progress for 1 s fails a start; this one (CPU busy at import) takes at least 3 s.
    # A fixed start deadline fails it, as the old 180 s would a loaded runner's spawn start
    # (122 s measured here at load 34)
    monkeypatch.setattr(harness.pool, "START_STALL", 1.0)
    monkeypatch.setattr(harness.pool, "START_TIMEOUT", 1.0)
    busy = _start_module(tmp_path, monkeypatch, "busy_at_start", 3.0, "pass")
    with RankPool(2, start_method="forkserver", preload=[busy]) as pool:
        assert pool.run(rank_and_sum, 0.0) == [(0, 2, 1.0), (1, 2, 1.0)]


@pytest.mark.spatial_pool
def test_a_start_that_makes_no_progress_fails_naming_the_rank(tmp_path, monkeypatch):
    import harness.pool

    monkeypatch.setattr(harness.pool, "START_STALL", 1.0)
    stuck = _start_module(tmp_path, monkeypatch, "stuck_at_start", 10**6, "time.sleep(1000)")
    pool = RankPool(2, start_method="forkserver", preload=[stuck])
    with pytest.raises(RankCrash) as info:
        pool.start()
    assert str(info.value).startswith(
        "rank 0/2 failed to start (no progress for 1s: no CPU time used, neither runnable nor "
        "in I/O); its output follows."
    )
    assert not pool.alive and pool.pids == []
