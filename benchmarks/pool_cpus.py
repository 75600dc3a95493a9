"""Ranks pinned to CPUs against ranks left to the scheduler, alternated in one process.

    PYTHONPATH=. python benchmarks/pool_cpus.py [--rounds 3] [--burners 2] [--ranks 4]

Two warm pools of ``--ranks`` ranks (forkserver), one with ``pin_ranks="on"`` and one with
``"off"``, take turns: each round, 14 ``all_reduce`` calls of 8 floats (what the small
check's 2 training steps of the coupled MLP issue) 30 times, then 20 checks of that MLP
(``check_equivalence``, 37 positions, float64). Printed: the median per all_reduce and per
check of each, and the ratio pinned / unpinned, quiet and then beside ``--burners``
CPU-burning processes (0: quiet only). On a machine with at least as many CPUs as ranks,
``auto`` pins nothing (``harness.pool._cpus``); this script pins regardless, to show why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.peer import burners
from harness.equivalence import check_equivalence
from harness.pool import RankPool
from harness.steppers.mlp import CoupledMLPCase

CASE = CoupledMLPCase(npos=37, batch_size=4)


def all_reduces(n: int) -> float:
    t = torch.ones(8)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / n


def measure(pools: dict[str, RankPool], rounds: int) -> dict[str, dict[str, list[float]]]:
    got: dict[str, dict[str, list[float]]] = {k: {"all_reduce": [], "check": []} for k in pools}
    for r in range(rounds):
        order = list(pools) if r % 2 == 0 else list(pools)[::-1]
        for name in order:
            pool = pools[name]
            for _ in range(30):
                got[name]["all_reduce"].append(max(pool.run(all_reduces, 14)))
            for _ in range(20):
                start = time.perf_counter()
                assert check_equivalence(CASE, ranks=pool.world_size, pool=pool).ok
                got[name]["check"].append(time.perf_counter() - start)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    print(f"{len(os.sched_getaffinity(0))} CPUs, {args.ranks} ranks, torch {torch.__version__}")
    pools = {
        pin: RankPool(args.ranks, start_method="forkserver", pin_ranks=pin) for pin in ("on", "off")
    }
    try:
        for label, n in (("quiet", 0), (f"{args.burners} CPU burners beside", args.burners)):
            if label != "quiet" and not n:
                continue
            with burners(n):
                got = measure(pools, args.rounds)
            for what, unit in (("all_reduce", 1e3), ("check", 1e3)):
                on = statistics.median(got["on"][what]) * unit
                off = statistics.median(got["off"][what]) * unit
                print(
                    f"| {label} | {what} | pinned {on:.2f} ms | unpinned {off:.2f} ms | "
                    f"{on / off:.2f}x | load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
