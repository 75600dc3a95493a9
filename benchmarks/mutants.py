"""What mutants cost: N mutants against N times the checks' own time, on one warm pool.

    python benchmarks/mutants.py [--ranks 4] [-k coupled-mlp]

The built-in layouts (those whose label contains ``-k``) run once as they are, recording
their call sites; then every mutant reruns the checks that reached its site until one
fails (``harness.__main__.run_mutants``, what ``harness-check --mutants``
does). Printed: the checks' own time, the mutant phase's, their ratio per mutant, and how
often the pool had to start again (only after a mutant that hung or crashed a rank).
Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness
from harness import check_equivalence
from harness.__main__ import Config, configs, run_mutants
from harness.pool import RankPool


def _once(checks: list[Config], pool: RankPool) -> None:
    for check in checks:
        check_equivalence(
            check.case(), ranks=pool.world_size, spatial_size=check.spatial_size, pool=pool
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("-k", dest="select", default="")
    args = parser.parse_args()
    chosen = [c for c in configs(args.ranks) if args.select in c.label]
    checks = chosen
    with RankPool(args.ranks, start_method="forkserver", timeout=120) as pool:
        _once(checks, pool)  # warm every path once: not counted
        t0 = time.perf_counter()
        _once(checks, pool)
        own = time.perf_counter() - t0
        starts = pool.starts
        t0 = time.perf_counter()
        outcomes = run_mutants(
            checks, pool, include=[os.path.dirname(harness.__file__)], say=lambda _: None
        )
        took = time.perf_counter() - t0
        restarts = pool.starts - starts
    crashed = sum(o.quantity in ("deadlock", "crash", "timeout") for o in outcomes)
    run = [o for o in outcomes if not o.reason]  # those cannot_matter did not settle unrun
    per_check = own / len(checks)
    print(
        f"torch, {args.ranks} ranks, {len(checks)} layout(s): {', '.join(c.label for c in checks)}"
    )
    print(f"  the checks once, as they are: {own:.2f} s ({per_check:.2f} s a check)")
    print(f"  {len(outcomes)} mutants ({len(run)} run) in {took:.1f} s, recording run included")
    print(
        f"  per mutant run: {took / max(len(run), 1):.2f} s = "
        f"{took / max(len(run), 1) / per_check:.1f}x a check"
    )
    print(
        f"  pool starts during the mutants: {restarts} ({crashed} mutants hung or crashed a rank)"
    )


if __name__ == "__main__":
    main()
