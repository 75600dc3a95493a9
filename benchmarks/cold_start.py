"""Cold first check against warm checks, for a model with heavy imports, with and without
preloading it into the fork server.

    python benchmarks/cold_start.py [--ranks 4]

Each scenario runs in a fresh interpreter (the fork server is one per process, and its
preload list is fixed when it starts): a ``PoolRegistry`` like the plugin's, its pool
started (timed apart: a session pays it once), then three ``check_equivalence`` calls of
``benchmarks.heavy_model.HeavyModelCase``, timing each. Without preload the first check
pays for every rank importing the model's dependencies; with ``preload``
(``--spatial-preload`` / ``spatial_preload``) the fork server imports them once, before
forking the ranks. Printed as ratios of the first check to the warm ones, in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def scenario(preload: bool, ranks: int) -> list[float]:
    sys.path.insert(0, os.path.dirname(HERE))
    from harness import PoolRegistry, check_equivalence

    registry = PoolRegistry(
        default_ranks=ranks,
        start_method="forkserver",
        preload=["benchmarks.heavy_model"] if preload else [],
    )
    times = []
    t0 = time.perf_counter()
    from benchmarks.heavy_model import HeavyModelCase  # the test module imports it too

    imported = time.perf_counter() - t0
    t0 = time.perf_counter()
    registry.get(ranks).start()  # once per session: the fork server, then the ranks
    started = time.perf_counter() - t0
    for _ in range(3):
        t0 = time.perf_counter()
        report = check_equivalence(HeavyModelCase(npos=12), ranks=ranks, pool=registry.get(ranks))
        assert report.ok, report
        times.append(time.perf_counter() - t0)
    registry.close()
    return [imported, started, *times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--scenario", choices=["plain", "preload"])
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(scenario(args.scenario == "preload", args.ranks)))
        return
    results = {}
    for name in ("plain", "preload"):
        out = subprocess.run(
            [sys.executable, __file__, "--scenario", name, "--ranks", str(args.ranks)],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(HERE),
        ).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    print(
        f"{args.ranks} ranks, forkserver; seconds (the parent imports the model first; "
        "the pool starts once per session)"
    )
    for name, (imported, started, first, *warm) in results.items():
        w = min(warm)
        print(
            f"  {name:<8} model import {imported:4.1f}  pool start {started:4.1f}  first check "
            f"{first:5.2f}  warm {', '.join(f'{t:.2f}' for t in warm)}  "
            f"first/warm {first / w:4.1f}x"
        )
    plain, pre = results["plain"][2], results["preload"][2]
    print(f"preload cuts the first check from {plain:.1f} s to {pre:.1f} s ({plain / pre:.1f}x)")


if __name__ == "__main__":
    main()
