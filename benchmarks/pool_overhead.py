"""Per-job overhead: a warm rank pool against spawning ranks for every job, and the cost
of a trivial test through the plugin.

    python benchmarks/pool_overhead.py [--ranks 2 4 8] [--jobs 50] [--cold 3]
                                       [--tests 200] [--burners 2]

For each world size, K trivial jobs (one all-reduce) run through one warm pool, and a few run
the way torch's MultiProcessTestCase does it: fresh spawned processes per job (start, init
the process group, run, exit). Both are measured in this one run and printed as ratios.

Then one pytest session of ``--tests`` trivial 4-rank tests (``spatial.run`` of one
all-reduce) and one of as many plain tests, each timed from test to test inside the session
(start-up excluded): the per-test cost through the plugin, quiet and with ``--burners``
CPU-burning processes beside it (a loaded CI runner).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


TIMING = """
import statistics, time
T = []
def pytest_runtest_logfinish(nodeid, location):
    T.append(time.perf_counter())
def pytest_sessionfinish(session):
    d = [b - a for a, b in zip(T[1:], T[2:])]  # from the end of one test to the next
    if d:
        print(f"PER-TEST {statistics.median(d) * 1e3:.3f}")
"""

SPATIAL = """
import torch, torch.distributed as dist

def trivial():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
"""


def _burn() -> None:
    while True:
        pass


def _session(folder: Path, name: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--spatial-ranks", "4", name],
        cwd=folder, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = re.search(r"PER-TEST ([0-9.]+)", out)
    assert found, out
    return float(found.group(1))


def through_the_plugin(tests: int, burners: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(TIMING)
        body = "".join(
            f"\ndef test_{i}(spatial):\n    assert spatial.run(trivial) == [4.0] * 4\n"
            for i in range(tests)
        )
        (folder / "test_spatial.py").write_text(SPATIAL + body)
        plain = "".join(f"\ndef test_{i}():\n    assert True\n" for i in range(tests))
        (folder / "test_plain.py").write_text(plain)
        for label, n in (("quiet", 0), (f"{burners} CPU burners", burners)):
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_burn, daemon=True) for _ in range(n)]
            for p in procs:
                p.start()
            try:
                spatial = _session(folder, "test_spatial.py")
                bare = _session(folder, "test_plain.py")
            finally:
                for p in procs:
                    p.kill()
            print(
                f"  {label:<16} trivial 4-rank test {spatial:6.2f} ms, plain test {bare:5.2f} ms"
                f" ({spatial / bare:.0f}x a plain test)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--tests", type=int, default=200, help="tests per plugin session")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(f"torch {torch.__version__}; {args.jobs} warm jobs, {args.cold} cold jobs per size\n")
    results = {n: measure(n, args.jobs, args.cold) for n in args.ranks}
    print("\nsummary: ranks, warm median, spawn-per-job median, ratio")
    for n, r in results.items():
        print(f"  {n}: {r['warm'] * 1e3:.1f} ms, {r['spawn']:.2f} s, {r['ratio']:.0f}x")
    print(f"\nthrough the plugin, {args.tests} tests a session (median, test to test)")
    through_the_plugin(args.tests, args.burners)


if __name__ == "__main__":
    main()
