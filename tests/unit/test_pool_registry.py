"""``PoolRegistry``: pools of several world sizes alive at once, within a cap on processes
and a memory budget, least recently used closed first. Without rank processes: each pool's
ranks are stand-in pids whose memory the test says."""

from __future__ import annotations

import pytest

import harness.pool as pool_module
from harness import ConfigError
from harness.pool import PoolRegistry, RankPool, rank_memory

#: what each stand-in rank holds, in KiB: (RSS, PSS)
RANK_KIB = (250 * 1024, 40 * 1024)


@pytest.fixture
def stand_in_ranks(monkeypatch):
    """Every pool has ranks (pids = its world size's ranks, never real processes), each
    holding ``RANK_KIB``; closing a pool is recorded instead of stopping processes."""
    closed: list[int] = []
    monkeypatch.setattr(
        RankPool,
        "pids",
        property(lambda self: [1000 * self.world_size + r for r in range(self.world_size)]),
    )
    monkeypatch.setattr(pool_module, "rank_memory", lambda pid: RANK_KIB)
    monkeypatch.setattr(RankPool, "close", lambda self: closed.append(self.world_size))
    return closed


def test_pools_of_several_sizes_stay_alive_while_they_fit_the_process_cap(stand_in_ranks):
    registry = PoolRegistry(max_processes=6)
    pools = {w: registry.get(w) for w in (1, 2, 3)}
    assert registry.live == [1, 2, 3] and stand_in_ranks == []
    assert registry.get(2) is pools[2], "a warm get returns the same pool"
    assert registry.live == [1, 3, 2], "most recently used last"
    registry.get(4)  # 1 + 3 + 2 + 4 ranks: the least recently used go until 6 fit
    assert stand_in_ranks == [1, 3]
    assert registry.live == [2, 4]


def test_a_memory_budget_closes_the_least_recently_used_pools_until_the_new_one_fits(
    stand_in_ranks,
):
    # 40 MiB of PSS a rank: 1 + 2 + 3 ranks hold 240 MiB; a 4-rank pool adds 160 MiB
    registry = PoolRegistry(max_processes=64, memory_budget_mib=300)
    for w in (1, 2, 3):
        registry.get(w)
    assert registry.live == [1, 2, 3] and stand_in_ranks == [], "240 MiB fit 300"
    registry.get(4)  # 240 + 160 > 300: close 1 (200 + 160 > 300), then 2 (120 + 160 <= 300)
    assert stand_in_ranks == [1, 2]
    assert registry.live == [3, 4]
    registry.get(3)  # a warm get measures nothing and closes nothing
    assert stand_in_ranks == [1, 2]


def test_without_a_memory_budget_only_the_process_cap_applies(stand_in_ranks):
    registry = PoolRegistry(max_processes=64)
    for w in range(1, 9):
        registry.get(w)
    assert registry.live == list(range(1, 9)) and stand_in_ranks == []
    assert registry.memory_kib()[8] == [RANK_KIB] * 8


def test_where_memory_cannot_be_read_the_budget_closes_nothing(stand_in_ranks, monkeypatch):
    monkeypatch.setattr(pool_module, "rank_memory", lambda pid: None)
    registry = PoolRegistry(max_processes=64, memory_budget_mib=1)
    for w in (1, 2, 3):
        registry.get(w)
    assert registry.live == [1, 2, 3] and stand_in_ranks == []


def test_a_pool_running_is_never_closed_to_make_room(stand_in_ranks):
    # a sweep runs its 1-, 2- and 3-rank layouts beside each other (harness.layouts._lanes):
    # a pool made for the next layout must not close one whose run is under way
    registry = PoolRegistry(max_processes=6)
    pools = {w: registry.get(w) for w in (1, 2, 3)}
    with pools[1]._lock, pools[3]._lock:  # runs under way on the 1- and 3-rank pools
        assert pools[1].busy and pools[3].busy and not pools[2].busy
        registry.get(4)  # 1 + 2 + 3 + 4 ranks: only the idle 2-rank pool may go
    assert stand_in_ranks == [2]
    assert registry.live == [1, 3, 4]  # over the cap while they run: closed once idle
    registry.get(5)
    assert stand_in_ranks == [2, 1, 3, 4]


def test_a_memory_budget_closes_no_running_pool_either(stand_in_ranks):
    registry = PoolRegistry(max_processes=64, memory_budget_mib=300)
    pools = {w: registry.get(w) for w in (1, 2, 3)}
    with pools[1]._lock, pools[2]._lock:
        registry.get(4)  # 240 + 160 > 300: 1 and 2 run; 3 goes, then nothing may
    assert stand_in_ranks == [3]
    assert registry.live == [1, 2, 4]


@pytest.mark.parametrize("bad", [0, -5.0])
def test_a_memory_budget_that_is_not_positive_is_refused(bad):
    with pytest.raises(ConfigError, match="memory_budget_mib must be a positive number"):
        PoolRegistry(memory_budget_mib=bad)


def test_rank_memory_reads_this_processs_rss_and_pss():
    import os

    found = rank_memory(os.getpid())
    if found is None:
        pytest.skip("no /proc/PID/smaps_rollup on this system (Linux 4.14+): nothing to read")
    rss, pss = found
    # this interpreter has torch loaded: tens of MiB at least; PSS never exceeds RSS
    assert rss > 10 * 1024 and 0 < pss <= rss
    assert rank_memory(2**22 + 12345) is None, "a pid that does not exist reads as unknown"


def test_the_shared_pools_keep_every_size_of_a_sweep_within_a_quarter_of_free_memory(
    stand_in_ranks, monkeypatch
):
    monkeypatch.setattr(pool_module, "_SHARED", None)
    monkeypatch.setattr(pool_module, "default_memory_budget_mib", lambda: 1000.0)
    registry = pool_module.shared_registry()
    try:
        assert registry.memory_budget_mib == 1000.0
        for w in range(1, 9):  # 36 ranks of 40 MiB: 1440 MiB > 1000
            registry.get(w)
        # with 8 ranks (320 MiB) coming, 3 to 7 (1000 MiB) do not fit: 3, 4 and 5 close
        assert registry.live == [6, 7, 8]
        assert registry.max_processes == pool_module.SHARED_MAX_PROCESSES
    finally:
        monkeypatch.setattr(pool_module, "_SHARED", None)


def test_without_a_readable_memory_the_shared_pools_keep_at_most_8_ranks(
    stand_in_ranks, monkeypatch
):
    monkeypatch.setattr(pool_module, "_SHARED", None)
    monkeypatch.setattr(pool_module, "default_memory_budget_mib", lambda: None)
    registry = pool_module.shared_registry()
    try:
        for w in range(1, 9):
            registry.get(w)
        assert registry.live == [8]
    finally:
        monkeypatch.setattr(pool_module, "_SHARED", None)


def test_the_default_budget_is_a_quarter_of_the_available_memory():
    budget = pool_module.default_memory_budget_mib()
    if budget is None:
        pytest.skip("no /proc/meminfo on this system: no budget to read")
    with open("/proc/meminfo") as f:
        available = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable:"))
    # MemAvailable moves between the two reads: within 10 % of a quarter of it
    assert abs(budget - available / 1024 / 4) <= 0.1 * available / 1024 / 4


def test_a_pool_handed_to_a_background_run_is_busy_before_its_thread_takes_it(monkeypatch):
    # a sweep hands the next layout's pool to a thread, then makes another size's pool at
    # once: the registry must not close the first in the moment before its thread runs
    import threading

    from harness.pool.overlap import Background

    pool = RankPool(2)
    release = threading.Event()
    monkeypatch.setattr(pool, "_run_pickled", lambda payload, timeout: release.wait(5) and [])
    assert not pool.busy
    run = Background(pool, (print,), None)
    assert pool.busy  # the thread has not taken the pool's lock (the stand-in never does)
    release.set()
    run.join()
    assert not pool.busy
