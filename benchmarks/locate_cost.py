"""What locating the first divergence costs, as a ratio to the check it explains.

    python benchmarks/locate_cost.py [--repeats 3] [--nlat 32]

A failing SFNO check (faults: ``coupling-identity-backward``, a backward bug deep in the
model, so every module's forward and backward is compared before it is found) on 4 ranks,
2x2 process grid, float64: the check itself (reference + partitioned run + compare, with
``locate=False``) against the locating that a failing check runs (the failing step rerun
hooked: reference, nudged reference, every rank, then the judgement). Both are measured in
this one run through one warm pool; the median of ``--repeats`` of each is printed with
their ratio (the target: at most 3x). A passing check with ``locate=True`` is measured too.
Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import PoolRegistry, check_equivalence

RANKS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nlat", type=int, default=32)
    args = parser.parse_args()
    from harness.steppers.sfno import SFNOCase

    registry = PoolRegistry()
    try:
        pool = registry.get(RANKS)
        size = {"nlat": args.nlat, "nlon": 2 * args.nlat, "h": 2, "w": 2}
        faulty = SFNOCase(**size, faults=("coupling-identity-backward",))
        check_equivalence(faulty, ranks=RANKS, pool=pool, locate=False)  # warm: imports, groups
        checks, locates, passing = [], [], []
        line = ""
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            report = check_equivalence(faulty, ranks=RANKS, pool=pool, locate=False)
            checks.append(time.perf_counter() - t0)
            assert not report.ok
            located = check_equivalence(faulty, ranks=RANKS, pool=pool)
            assert located.location is not None and located.first_divergence is not None
            locates.append(located.location.seconds)
            line = located.first_divergence.line()
            clean = check_equivalence(SFNOCase(**size), ranks=RANKS, pool=pool, locate=True)
            assert clean.ok and clean.location is not None and clean.first_divergence is None
            passing.append(clean.location.seconds / clean.seconds)
        check, locate = statistics.median(checks), statistics.median(locates)
        print(f"SFNO {args.nlat}x{2 * args.nlat} on 2x2 ranks, float64, median of {args.repeats}")
        print(f"  failing check (locate=False): {check:.2f} s")
        print(f"  locating it:                  {locate:.2f} s  -> {locate / check:.2f}x the check")
        print(f"  locating a passing check:     {statistics.median(passing):.2f}x the check")
        print(f"  {line}")
    finally:
        registry.close()


if __name__ == "__main__":
    main()
