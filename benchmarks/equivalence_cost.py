"""What one equivalence check costs, and how it grows with the grid.

    python benchmarks/equivalence_cost.py [--examples 10]

1. Hypothesis examples per second at 4 ranks for each built-in stepper: each example draws
   a layout and runs a full ``check_equivalence`` (reference + partitioned run + compare)
   through one warm pool.
2. Scaling: one check of the SFNO stepper at nlat 16 -> 128 (nlon = 2 nlat) and of the
   HEALPix stepper at nside 2 -> 16, printed as ratios to the smallest size.

Everything is measured in this one run; nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from harness import PoolRegistry, SpatialCase, check_equivalence

RANKS = 4


def _sfno(**kw) -> SpatialCase:
    from harness.steppers.sfno import SFNOCase

    return SFNOCase(**kw)


def _healpix(**kw) -> SpatialCase:
    from harness.steppers.healpix import HealpixCase

    return HealpixCase(**kw)


def _mlp(**kw) -> SpatialCase:
    from harness.steppers.mlp import CoupledMLPCase

    return CoupledMLPCase(**kw)


DRAWS: dict[str, tuple[Callable[..., SpatialCase], st.SearchStrategy[dict]]] = {
    "coupled-mlp": (_mlp, st.fixed_dictionaries({"npos": st.integers(1, 40)})),
    "sfno": (
        _sfno,
        st.fixed_dictionaries(
            {
                "nlat": st.integers(8, 24),
                "nlon": st.integers(8, 40),
                "h": st.just(2),
                "w": st.just(2),
            }
        ),
    ),
    "healpix": (_healpix, st.fixed_dictionaries({"nside": st.sampled_from([1, 2, 4])})),
}


def examples_per_second(pool, make, strategy, n: int) -> float:
    times: list[float] = []

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(kwargs=strategy)
    def run(kwargs):
        t0 = time.perf_counter()
        report = check_equivalence(make(**kwargs), ranks=RANKS, pool=pool)
        assert report.ok, report
        times.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    run()
    return len(times) / (time.perf_counter() - t0)


def one_check(pool, make, **kwargs) -> float:
    check_equivalence(make(**kwargs), ranks=RANKS, pool=pool)  # warm caches (SHT tables)
    t0 = time.perf_counter()
    report = check_equivalence(make(**kwargs), ranks=RANKS, pool=pool)
    assert report.ok, report
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10)
    args = parser.parse_args()
    registry = PoolRegistry(start_method="forkserver")
    pool = registry.get(RANKS)
    try:
        pool.run(torch.get_num_threads)  # start the pool outside the measurements
        print(f"torch {torch.__version__}, {RANKS} ranks, warm forkserver pool\n")
        print("Hypothesis examples per second (full check_equivalence per example):")
        base = None
        for name, (make, strategy) in DRAWS.items():
            try:
                rate = examples_per_second(pool, make, strategy, args.examples)
            except ImportError as exc:
                print(f"  {name:<12} skipped ({exc})")
                continue
            base = base or rate
            print(
                f"  {name:<12} {rate:6.2f} examples/s   ({base / rate:4.1f}x the time of "
                "coupled-mlp)"
            )
        print("\nScaling of one check with grid size (ratio to the smallest):")
        for name, make, sizes in (
            ("sfno nlat", _sfno, [16, 32, 64, 128]),
            ("healpix nside", _healpix, [2, 4, 8, 16]),
        ):
            first = None
            for size in sizes:
                kw = (
                    {"nlat": size, "nlon": 2 * size, "h": 2, "w": 2}
                    if name.startswith("sfno")
                    else {"nside": size}
                )
                try:
                    seconds = one_check(pool, make, **kw)
                except ImportError as exc:
                    print(f"  {name} skipped ({exc})")
                    break
                first = first or seconds
                print(f"  {name} {size:>4}: {seconds:7.2f} s   {seconds / first:6.1f}x")
    finally:
        registry.close()


if __name__ == "__main__":
    main()
