"""What a sweep of every layout costs against one check, what a pool start costs per world
size, what an idle rank holds, and what a trivial run costs.

    python benchmarks/layouts_cost.py [--max-ranks 8] [--repeat 3] [--steppers sfno healpix mlp]

Every number is measured in this one run, so its ratios hold on a loaded machine:

- pool start per world size 1..``--max-ranks`` (forkserver; the fork server already up, as
  it is after a session's first pool), and the first start with the fork server;
- a trivial run (one all-reduce) on a warm 4-rank pool: the floor of every test's cost;
- per built-in stepper: the median of one warm 4-rank ``check_equivalence``, then one
  ``check_layouts`` up to ``--max-ranks`` ranks on fresh pools (started inside it, as a CI
  job would), printed as a ratio, with the seconds of the largest world size's layouts and
  the layouts the case refused;
- the memory of the idle ranks the sweeps left alive (one ``PoolRegistry`` keeps a pool of
  every size within its budget): resident (RSS) and proportional (PSS: pages shared with the
  fork server and the other ranks counted once, split between them), per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from harness import SpatialCase, check_equivalence
from harness.layouts import LayoutResult, check_layouts
from harness.pool import PoolRegistry, RankPool


def trivial_job() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def steppers() -> dict[str, Callable[[], SpatialCase]]:
    from harness.steppers.healpix import HealpixCase
    from harness.steppers.mlp import CoupledMLPCase
    from harness.steppers.sfno import SFNOCase

    return {"sfno": SFNOCase, "healpix": HealpixCase, "mlp": CoupledMLPCase}


def pool_starts(max_ranks: int) -> None:
    t0 = time.perf_counter()
    with RankPool(1, start_method="forkserver") as pool:  # the fork server starts here
        first = time.perf_counter() - t0
        pool.run(trivial_job)
        print(f"pool start (forkserver), first pool with its fork server: {first:5.2f} s")
        line = []
        for size in range(1, max_ranks + 1):
            t0 = time.perf_counter()
            with RankPool(size, start_method="forkserver") as other:
                line.append(f"{size}: {time.perf_counter() - t0:4.2f}")
                other.run(trivial_job)
        print("  then per world size (s): " + "  ".join(line))


def trivial_runs(registry: PoolRegistry, runs: int = 200) -> float:
    pool = registry.get(4)
    for _ in range(20):
        pool.run(trivial_job)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        pool.run(trivial_job)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_check(case: SpatialCase, pool: RankPool, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        check_equivalence(case, ranks=4, pool=pool)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep(name: str, case: SpatialCase, max_ranks: int, repeat: int) -> None:
    # The 4-rank check on its own warm pool, measured before and after the sweep (the load
    # of a shared machine drifts within minutes; the ratio is against their mean). The
    # sweep's pools start inside it (cold), as in a CI job.
    check_pools = PoolRegistry(start_method="forkserver", max_processes=4)
    registry = PoolRegistry(start_method="forkserver", max_processes=64)
    took: dict[int, float] = {}
    last = [time.perf_counter()]

    def tell(result: LayoutResult) -> None:
        now = time.perf_counter()
        took[result.layout.world_size] = took.get(result.layout.world_size, 0.0) + now - last[0]
        last[0] = now

    try:
        four = check_pools.get(4)
        check_equivalence(case, ranks=4, pool=four)  # warm: a session pays this once
        before = median_check(case, four, repeat)
        t0 = last[0] = time.perf_counter()
        report = check_layouts(case, max_ranks=max_ranks, pools=registry.get, progress=tell)
        seconds = time.perf_counter() - t0
        after = median_check(case, four, repeat)
        check = (before + after) / 2
        print(
            f"  {name:<8} one 4-rank check {check:5.2f} s ({before:.2f} before, {after:.2f} "
            f"after); every layout up to {max_ranks} ranks {seconds:6.1f} s = "
            f"{seconds / check:5.1f}x ({len(report.passed)} run, {len(report.refused)} "
            f"refused, {len(report.failing)} failed)"
        )
        share = "  ".join(f"W={w}: {s:4.1f}" for w, s in sorted(took.items()))
        print(f"           seconds per world size: {share}")
        mem = registry.memory_kib()
        rss = [r for ranks in mem.values() for r, _ in ranks]
        pss = [p for ranks in mem.values() for _, p in ranks]
        if pss:
            print(
                f"           idle ranks left alive: {len(pss)} (sizes {sorted(mem)}); per rank "
                f"RSS {statistics.median(rss) / 1024:5.0f} MiB, PSS "
                f"{statistics.median(pss) / 1024:5.1f} MiB (median); all: PSS "
                f"{sum(pss) / 1024:6.0f} MiB"
            )
    finally:
        registry.close()
        check_pools.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steppers", nargs="+", default=list(steppers()))
    args = parser.parse_args()
    print(f"torch {torch.__version__}")
    pool_starts(args.max_ranks)
    registry = PoolRegistry(start_method="forkserver")
    try:
        ms = trivial_runs(registry) * 1e3
        print(f"trivial run (one all-reduce) on a warm 4-rank pool: {ms:.2f} ms (median)")
    finally:
        registry.close()
    print("sweeps (fresh pools of every size, started inside the sweep):")
    makers = steppers()
    for name in args.steppers:
        sweep(name, makers[name](), args.max_ranks, args.repeat)


if __name__ == "__main__":
    main()
