"""What a sweep of every layout costs against one check, and what an idle rank holds.

    python benchmarks/layouts_cost.py [--max-ranks 8] [--repeat 3]

For the SFNO stepper (16 x 32, float64, every grid of h x w): the median seconds of one
4-rank ``check_equivalence`` on a warm pool, then one ``check_layouts`` up to
``--max-ranks`` ranks (pools of each world size started inside it, as a CI job would, and
again warm), printed with their ratio and the layouts run. Then the memory of the idle ranks
of every pool the sweep left alive: resident (RSS) and proportional (PSS: pages shared
with the fork server and the other ranks counted once, split between them), per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from harness import check_equivalence
from harness.layouts import check_layouts
from harness.pool import PoolRegistry
from harness.steppers.sfno import SFNOCase


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB, from /proc (0, 0 where unreadable)."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:] if ":" in line}
    return fields.get("Rss", 0), fields.get("Pss", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    case = SFNOCase()
    registry = PoolRegistry(start_method="forkserver", max_processes=64)
    try:
        four = registry.get(4)
        check_equivalence(case, ranks=4, pool=four)  # warm
        one = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            check_equivalence(case, ranks=4, pool=four)
            one.append(time.perf_counter() - t0)
        check = statistics.median(one)
        t0 = time.perf_counter()
        cold = check_layouts(case, max_ranks=args.max_ranks, pools=registry.get)
        cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = check_layouts(case, max_ranks=args.max_ranks, pools=registry.get)
        warm_s = time.perf_counter() - t0
        print(f"torch {torch.__version__}; SFNO 16x32 float64, 2 steps")
        print(f"  one 4-rank check (warm, median of {args.repeat}): {check:6.2f} s")
        for name, report, took in (("cold", cold, cold_s), ("warm", warm, warm_s)):
            print(
                f"  every layout up to {args.max_ranks} ranks ({name} pools): {took:6.1f} s = "
                f"{took / check:5.1f}x one check; {len(report.passed)} run, "
                f"{len(report.refused)} refused, {len(report.failing)} failed"
            )
        print("  idle rank memory (pools left alive by the sweep):")
        rss, pss = [], []
        for size, pool in sorted(registry._pools.items()):
            mem = [memory_kib(pid) for pid in pool.pids]
            rss += [m[0] for m in mem]
            pss += [m[1] for m in mem]
            print(
                f"    {size} ranks: RSS {statistics.median(m[0] for m in mem) / 1024:6.1f} MiB, "
                f"PSS {statistics.median(m[1] for m in mem) / 1024:6.1f} MiB per rank (median)"
            )
        print(
            f"    all {len(rss)} ranks: RSS {sum(rss) / 1024:7.1f} MiB, "
            f"PSS {sum(pss) / 1024:7.1f} MiB in total"
        )
        print(warm.map())
    finally:
        registry.close()


if __name__ == "__main__":
    main()
