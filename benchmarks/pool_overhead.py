"""Per-job overhead: a warm rank pool against spawning ranks for every job.

    python benchmarks/pool_overhead.py [--ranks 2 4 8] [--jobs 50] [--cold 3]

For each world size, K trivial jobs (one all-reduce) run through one warm pool, and a few run
the way torch's MultiProcessTestCase does it: fresh spawned processes per job (start, init
the process group, run, exit). Both are measured in this one run and printed as ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from harness import RankPool


def trivial_job() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)  # the smallest real collective: every rank takes part
    return t.item()


def _stats(xs: list[float]) -> str:
    return (
        f"median {statistics.median(xs) * 1e3:8.1f} ms  min {min(xs) * 1e3:8.1f} ms  "
        f"max {max(xs) * 1e3:8.1f} ms"
    )


def _cold(ranks: int, start_method: str, jobs: int) -> list[float]:
    """Seconds per job with a pool started for that job alone (start, run, close)."""
    times = []
    for _ in range(jobs):
        t0 = time.perf_counter()
        with RankPool(ranks, start_method=start_method) as pool:
            pool.run(trivial_job)
        times.append(time.perf_counter() - t0)
    return times


def measure(ranks: int, jobs: int, cold: int) -> dict[str, float]:
    warm = []
    with RankPool(ranks, start_method="forkserver") as pool:
        pool.run(trivial_job)  # first run: not counted, as a test session pays it once
        for _ in range(jobs):
            t0 = time.perf_counter()
            assert pool.run(trivial_job) == [float(ranks)] * ranks
            warm.append(time.perf_counter() - t0)
    spawn = _cold(ranks, "spawn", cold)
    fork = _cold(ranks, "forkserver", cold)
    print(f"{ranks} ranks")
    print(f"  warm pool, {jobs} jobs:            {_stats(warm)}")
    print(f"  spawn per job, {cold} jobs:          {_stats(spawn)}")
    print(f"  forkserver pool per job, {cold} jobs: {_stats(fork)}")
    ratio = statistics.median(spawn) / statistics.median(warm)
    print(f"  spawn-per-job / warm pool: {ratio:.0f}x")
    return {"warm": statistics.median(warm), "spawn": statistics.median(spawn), "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--cold", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}; {args.jobs} warm jobs, {args.cold} cold jobs per size\n")
    results = {n: measure(n, args.jobs, args.cold) for n in args.ranks}
    print("\nsummary: ranks, warm median, spawn-per-job median, ratio")
    for n, r in results.items():
        print(f"  {n}: {r['warm'] * 1e3:.1f} ms, {r['spawn']:.2f} s, {r['ratio']:.0f}x")


if __name__ == "__main__":
    main()
