"""What a check costs over the bare partitioned run of the same case.

    python benchmarks/check_overhead.py [--repeat 5]

For each built-in stepper: the median seconds of ``check_equivalence`` (reference run,
partitioned run on a warm pool, fence, comparison) against the median of the partitioned
run alone (``pool.run`` of the same rank entry), both measured here, printed as a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from harness import RankPool, SpatialCase, check_equivalence
from harness._rank.run import rank_entry

RANKS = 4


def cases() -> dict[str, Callable[[], SpatialCase]]:
    from harness.steppers.healpix import HealpixCase
    from harness.steppers.mlp import CoupledMLPCase
    from harness.steppers.sfno import SFNOCase

    return {
        "coupled-mlp": lambda: CoupledMLPCase(npos=37, batch_size=4),
        "sfno 16x32 h2w2": lambda: SFNOCase(nlat=16, nlon=32, h=2, w=2),
        "healpix nside 4": lambda: HealpixCase(nside=4),
    }


def median_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm: first-call costs are a session's, not a check's
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {RANKS} ranks, median of {args.repeat}\n")
    with RankPool(RANKS, start_method="forkserver") as pool:
        for label, make in cases().items():
            case = make()
            bare = median_of(lambda c=case: pool.run(rank_entry, c, None, 2, 0.1, 0), args.repeat)
            check = median_of(
                lambda c=case: check_equivalence(c, ranks=RANKS, pool=pool), args.repeat
            )
            print(
                f"  {label:<16} partitioned run {bare * 1e3:7.1f} ms   check "
                f"{check * 1e3:7.1f} ms   check/bare {check / bare:4.2f}x"
            )


if __name__ == "__main__":
    main()
