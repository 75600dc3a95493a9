"""A pool's ranks run where the pool chose (``harness.pool._cpus``), gloo's threads too."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness.pool import RankPool
from harness.pool._cpus import rank_cpus


def _where() -> dict[str, list[int]]:
    """Every thread of this rank -> the CPUs it may run on (gloo's threads included: a
    collective first, so they exist)."""
    dist.all_reduce(torch.ones(1))
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        threads[f"{name}:{tid}"] = sorted(os.sched_getaffinity(int(tid)))
    return threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing is pinned")
@pytest.mark.parametrize("pin", ["on", "off"])
def test_every_thread_of_a_rank_runs_on_the_cpu_the_pool_chose(pin):
    allowed = sorted(os.sched_getaffinity(0))
    with RankPool(3, pin_ranks=pin, timeout=60) as pool:
        answers = pool.run(_where)
    for rank, threads in enumerate(answers):
        cpu = rank_cpus(3, pin)[rank]
        assert any(name.startswith("gloo_tcp_loop") for name in threads)
        assert set(map(tuple, threads.values())) == {(cpu,) if cpu is not None else tuple(allowed)}
