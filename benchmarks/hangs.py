"""How long a hang takes to fail: deadlock detection against the timeout.

    python benchmarks/hangs.py [--timeout 120] [--skip-baseline]

1. One run where a rank skips a collective, 4 ranks: seconds to the failure with deadlock
   detection (default window) and without it (the run waits out ``--timeout``; default the
   plugin's 120 s).
2. Hypothesis shrinking an empty-rank hang: a case whose rank with no positions skips the
   loss reduction, positions split by drawn bounds. Total time until Hypothesis reports its
   minimal example, with detection at the default timeout; without detection each hanging
   example would wait the whole timeout, so that time is the hanging examples x timeout
   (printed, not run: 120 s each).
3. What torch.distributed's own tools cost on a clean run of 200 small all-reduces:
   ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (checks every collective's fingerprint across ranks
   before running it) and ``monitored_barrier`` against a plain ``barrier``.

Everything is measured in this one run and printed as ratios; nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from harness import RankFailure, RankPool, check_equivalence
from harness.pool import DEADLOCK_WINDOW, DEFAULT_TIMEOUT
from harness.steppers.mlp import CoupledMLPCase

RANKS = 4


def skip_collective_on(bad_rank: int) -> int:
    if dist.get_rank() != bad_rank:
        dist.all_reduce(torch.ones(1))  # the others wait here for a rank that never comes
    return 0


class EmptyRankSkips(CoupledMLPCase):
    """A rank whose range is empty returns its local loss without the reduction: a hang."""

    name = "empty-rank-skips"

    def __init__(self, bounds: tuple[int, ...]) -> None:
        super().__init__(npos=bounds[-1], batch_size=2)
        self.bounds = bounds

    def batch(self, topo, step):  # type: ignore[no-untyped-def]
        x = torch.randn(self.batch_size, self.npos, self.channels)
        target = torch.randn(self.batch_size, self.npos, self.channels)
        lo, hi = self._range(topo)
        return {"x": x[:, lo:hi], "target": target[:, lo:hi]}

    def forward(self, model, batch, topo):  # type: ignore[no-untyped-def]
        from harness import Outputs, Shard
        from harness.collectives import reduce_loss

        lo, hi = self._range(topo)
        h = torch.tanh(model.encoder(batch["x"]))
        out = batch["x"] + model.decoder(h)
        local = ((out - batch["target"]) ** 2).sum() / (self.batch_size * self.npos * 3)
        if topo.spatial_group is not None and hi == lo:
            return Outputs(local, {"out": Shard(out, torch.arange(lo, hi), dim=1)})  # the bug
        loss = reduce_loss(local, topo)
        if topo.spatial_group is None:
            return Outputs(loss, {"out": out})
        return Outputs(loss, {"out": Shard(out, torch.arange(lo, hi), dim=1)})

    def _range(self, topo):  # type: ignore[no-untyped-def]
        if topo.spatial_group is None:
            return 0, self.npos
        return self.bounds[topo.spatial_rank], self.bounds[topo.spatial_rank + 1]


def bounds(max_npos: int = 12) -> st.SearchStrategy[tuple[int, ...]]:
    """Non-decreasing bounds from 0 to npos over 4 ranks: empty ranges included."""
    return st.integers(1, max_npos).flatmap(
        lambda n: st.lists(st.integers(0, n), min_size=3, max_size=3).map(
            lambda cuts: (0, *sorted(cuts), n)
        )
    )


def one_hang(pool: RankPool, timeout: float) -> float:
    t0 = time.perf_counter()
    try:
        pool.run(skip_collective_on, 3, timeout=timeout)
    except RankFailure as failure:
        kind = type(failure).__name__
    else:
        raise AssertionError("the hang went unnoticed")
    took = time.perf_counter() - t0
    print(f"  {kind:<13} after {took:6.1f} s")
    return took


def shrink(pool: RankPool, timeout: float) -> tuple[float, int, int, tuple[int, ...] | None]:
    """Seconds until Hypothesis reports its minimal failing example; examples tried, hung."""
    tried, hung = [0], [0]
    minimal: list[tuple[int, ...]] = []

    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(b=bounds())
    def prop(b: tuple[int, ...]) -> None:
        tried[0] += 1
        report = check_equivalence(EmptyRankSkips(b), ranks=RANKS, pool=pool, timeout=timeout)
        if not report.ok:
            if os.environ.get("HANGS_DEBUG"):
                print(str(report)[:3000])
            hung[0] += report.quantities <= {"deadlock", "timeout"}
            minimal[:] = [b]
        assert report.ok, report.quantities

    t0 = time.perf_counter()
    try:
        prop()
    except AssertionError as exc:
        print(f"  Hypothesis: {str(exc).splitlines()[0][:200]}")
    return time.perf_counter() - t0, tried[0], hung[0], (minimal[0] if minimal else None)


def collectives(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(torch.ones(8))
    return time.perf_counter() - t0


def barriers(n: int, monitored: bool) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        if monitored:
            dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=30))
        else:
            dist.barrier()
    return time.perf_counter() - t0


def debug_costs() -> None:
    results = {}
    for level in ("OFF", "DETAIL"):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = level  # read when a rank makes its group
        with RankPool(RANKS, start_method="spawn", timeout=120) as pool:
            pool.run(collectives, 10)
            results[level] = max(pool.run(collectives, 200))
            if level == "OFF":
                results["barrier"] = max(pool.run(barriers, 100, False))
                results["monitored"] = max(pool.run(barriers, 100, True))
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
    print(
        f"  200 all-reduces: {results['OFF'] * 1e3:.0f} ms; with TORCH_DISTRIBUTED_DEBUG="
        f"DETAIL {results['DETAIL'] * 1e3:.0f} ms ({results['DETAIL'] / results['OFF']:.1f}x)"
    )
    print(
        f"  100 barriers: {results['barrier'] * 1e3:.0f} ms; monitored_barrier "
        f"{results['monitored'] * 1e3:.0f} ms ({results['monitored'] / results['barrier']:.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not wait out the timeout without detection"
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {RANKS} ranks, timeout {args.timeout:g} s, "
        f"deadlock window {DEADLOCK_WINDOW:g} s\n"
    )
    print("1. a rank skips a collective")
    with RankPool(RANKS, start_method="forkserver", timeout=args.timeout) as pool:
        pool.run(collectives, 1)
        detected = one_hang(pool, args.timeout)
    if not args.skip_baseline:
        with RankPool(
            RANKS, start_method="forkserver", timeout=args.timeout, deadlock_window=0
        ) as pool:
            pool.run(collectives, 1)
            waited = one_hang(pool, args.timeout)
        print(f"  detection is {waited / detected:.0f}x sooner than the timeout")

    print("\n2. Hypothesis shrinking an empty-rank hang (bounds over 4 ranks)")
    with RankPool(RANKS, start_method="forkserver", timeout=args.timeout) as pool:
        took, tried, hung, minimal = shrink(pool, args.timeout)
    print(
        f"  with detection: {took:.1f} s for {tried} examples ({hung} hung); minimal "
        f"bounds {minimal}"
    )
    print(
        f"  without detection each hanging example waits {args.timeout:g} s: "
        f">= {hung * args.timeout / 60:.0f} min ({hung * args.timeout / took:.0f}x longer)"
    )

    print("\n3. torch.distributed's own checks on a clean run")
    debug_costs()


if __name__ == "__main__":
    main()
