"""Distributed Hypothesis examples per second: one warm rank pool vs a fresh pool per example.

Each example draws a HEALPix cell partition of 4 ranks (empty ranks included) and runs an
uneven all-gather and a halo exchange, forward and backward, on small tensors. The warm pool
serves every example; the cold variant starts a pool for each (only a few: each costs a
start). Run from the repository root:

    python benchmarks/hypothesis_throughput.py [--examples 50] [--cold 3] [--ranks 4]

It prints examples/s for both and their ratio; nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import time

import torch
from hypothesis import HealthCheck, Phase, given, settings

from harness import RankPool, Topology
from harness.collectives import all_gather_uneven, halo_exchange, reduce_loss
from harness.partition import CellPartition
from harness.strategies import cell_partitions


def one_example(part: CellPartition) -> float:
    """Runs on every rank: gather + halo exchange, forward and backward."""
    topo = Topology.create()
    r = topo.spatial_rank
    x = torch.randn(4, part.sizes[r], dtype=torch.float64, requires_grad=True)
    full = all_gather_uneven(x, topo, dim=-1)
    halo = halo_exchange(x, part, topo)
    loss = reduce_loss(full.square().sum() + halo.sum(), topo)
    loss.backward()
    return float(loss)


def _examples(count: int, ranks: int, nside: int, body) -> tuple[int, float]:
    done = 0

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],  # no shrinking: only the examples themselves are timed
        suppress_health_check=list(HealthCheck),
    )
    @given(cell_partitions(nside=nside, ranks=ranks))
    def run(part: CellPartition) -> None:
        nonlocal done
        body(part)
        done += 1

    t0 = time.perf_counter()
    run()
    return done, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50, help="examples on the warm pool")
    parser.add_argument("--cold", type=int, default=3, help="examples with a fresh pool each")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nside", type=int, default=2)
    args = parser.parse_args()

    pool = RankPool(args.ranks, start_method="forkserver")
    t0 = time.perf_counter()
    pool.start()  # also starts the forkserver (imports torch once): not charged to either
    started = time.perf_counter() - t0
    try:
        pool.run(one_example, CellPartition.even(args.nside, args.ranks))  # first-run imports
        warm_n, warm_s = _examples(
            args.examples, args.ranks, args.nside, lambda p: pool.run(one_example, p)
        )
    finally:
        pool.close()

    def cold(part: CellPartition) -> None:
        with RankPool(args.ranks, start_method="forkserver") as fresh:
            fresh.run(one_example, part)

    cold_n, cold_s = _examples(args.cold, args.ranks, args.nside, cold)

    warm_rate, cold_rate = warm_n / warm_s, cold_n / cold_s
    print(f"ranks {args.ranks}, nside {args.nside}, torch {torch.__version__}, forkserver")
    print(f"first pool start (forkserver + ranks): {started:.2f} s")
    print(
        f"warm pool : {warm_n:3d} examples in {warm_s:6.2f} s = {warm_rate:7.2f} examples/s "
        f"({1000 * warm_s / warm_n:.0f} ms each)"
    )
    print(
        f"fresh pool: {cold_n:3d} examples in {cold_s:6.2f} s = {cold_rate:7.2f} examples/s "
        f"({1000 * cold_s / cold_n:.0f} ms each)"
    )
    print(f"ratio warm/fresh: {warm_rate / cold_rate:.1f}x")


if __name__ == "__main__":
    main()
