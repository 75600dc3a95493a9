"""How long a hang takes to fail, and how often a correct run is taken for one.

    python benchmarks/hangs.py [--timeout 120] [--runs 10] [--burners 20] [--skip-baseline]

1. Each kind of hang (a rank skips a collective; different collectives or sizes at one
   point; a rank gone while the others wait in ``Work.wait()`` or in DDP's backward;
   blocking receives from each other), 4 ranks: seconds to the ``RankDeadlock``, on a quiet
   machine and with ``--burners`` CPU-burning processes beside it (load >= 20 on 2 cores);
   then a skipped collective without detection, which waits out ``--timeout``.
1b. The false-alarm sweep: ``--runs`` runs of each correct program that makes ranks wait
   longer than the deadlock window (a long collective, a late rank that sleeps, runs a
   subprocess, waits on a lock, writes a file or computes; matched async work finishing
   after return; a batch_isend_irecv halo; a DDP step), quiet and loaded: how many fail,
   and how.
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
import multiprocessing
import os
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def _burn() -> None:
    while True:
        pass


class Load:
    """``n`` CPU-burning processes while the block runs (what a shared CI runner has)."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> Load:
        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=_burn, daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()

    @staticmethod
    def runnable() -> int:
        """Tasks runnable right now (the 4th field of /proc/loadavg), 0 where unknown."""
        try:
            with open("/proc/loadavg") as f:
                return int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0


LATE_KINDS = ("sleep", "subprocess", "lock", "file", "compute")


def _pool(timeout: float, window: float = DEADLOCK_WINDOW) -> RankPool:
    return RankPool(RANKS, start_method="forkserver", timeout=timeout, deadlock_window=window)


def _programs() -> tuple[list[tuple[str, object, tuple]], list[tuple[str, object, tuple]]]:
    from tests.distributed import test_hangs as h
    from tests.distributed import test_torch_apis as apis

    hangs = [
        ("skipped collective", skip_collective_on, (3,)),
        ("different collectives", h.mismatched_operations, ()),
        ("different sizes", h.mismatched_sizes, ()),
        ("gone while others wait in Work.wait()", h.gone_while_others_wait_in_work_wait, ()),
        ("gone while others wait in DDP's backward", h.gone_while_others_wait_in_ddp_backward, ()),
        ("blocking receives from each other", h.receive_from_each_other, ()),
        ("opposite orders on two groups", h.opposite_orders_on_two_groups, ()),
    ]
    late = DEADLOCK_WINDOW + 0.5
    correct = [
        ("long all_reduce", h.collective_longer_than, (2 * DEADLOCK_WINDOW, 1 << 26)),
        *[(f"late rank: {how}", h.late_rank, (how, late)) for how in LATE_KINDS],
        ("late in many collectives", h.late_between_many_collectives, (late,)),
        ("async waited late", h.async_waited_late, (late,)),
        ("async never waited", h.async_never_waited, ()),
        ("isend received late", h.isend_received_late, (late,)),
        ("batch_isend_irecv halo", apis.halo_ring_with_batch_isend_irecv, ()),
        ("DDP step", apis.ddp_step, ()),
    ]
    return hangs, correct


def detection(pool: RankPool, hangs: list, timeout: float) -> dict[str, tuple[str, float]]:
    out = {}
    for name, fn, args in hangs:
        pool.run(collectives, 1)  # the pool restarted after the last hang: not timed
        t0 = time.perf_counter()
        try:
            pool.run(fn, *args, timeout=timeout)  # type: ignore[operator]
            kind = "passed?!"
        except RankFailure as failure:
            kind = type(failure).__name__
        out[name] = (kind, time.perf_counter() - t0)
    return out


def sweep(pool: RankPool, correct: list, runs: int) -> Counter[str]:
    import warnings

    outcomes: Counter[str] = Counter()
    for name, fn, args in correct:
        for _ in range(runs):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # UnwaitedWork: expected for two of them
                    pool.run(fn, *args, timeout=300)  # type: ignore[operator]
                outcomes["passed"] += 1
            except RankFailure as failure:
                outcomes[f"{type(failure).__name__} ({name})"] += 1
    return outcomes


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
    parser.add_argument("--runs", type=int, default=10, help="runs of each correct program")
    parser.add_argument("--burners", type=int, default=10 * (os.cpu_count() or 1))
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not wait out the timeout without detection"
    )
    parser.add_argument("--only", choices=["hangs", "shrink", "debug"], default=None)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {RANKS} ranks, timeout {args.timeout:g} s, "
        f"deadlock window {DEADLOCK_WINDOW:g} s, {os.cpu_count()} cores\n"
    )
    hangs, correct = _programs()
    if args.only in (None, "hangs"):
        print("1. each kind of hang: seconds to the failure, quiet / with "
              f"{args.burners} CPU burners")  # fmt: skip
        results = {}
        for label, burners in (("quiet", 0), ("loaded", args.burners)):
            with Load(burners), _pool(args.timeout) as pool:
                pool.run(collectives, 1)
                load = Load.runnable()
                results[label] = (detection(pool, hangs, args.timeout), load)
        quiet, loaded = results["quiet"][0], results["loaded"][0]
        print(f"  (runnable tasks: quiet {results['quiet'][1]}, loaded {results['loaded'][1]})")
        for name, _, _ in hangs:
            print(
                f"  {name:<42} {quiet[name][0]:<12} {quiet[name][1]:5.1f} s   "
                f"loaded {loaded[name][0]:<12} {loaded[name][1]:5.1f} s"
            )
        worst = max(t for _, t in loaded.values())
        print(
            f"  slowest loaded detection {worst:.1f} s: {args.timeout / worst:.0f}x sooner "
            "than the timeout"
        )
        if not args.skip_baseline:
            with _pool(args.timeout, window=0) as pool:
                pool.run(collectives, 1)
                waited = one_hang(pool, args.timeout)
            print(f"  without detection a skipped collective waits {waited:.0f} s")

        print(
            f"\n1b. false-alarm sweep: {args.runs} runs of each of {len(correct)} correct programs"
        )
        for label, burners in (("quiet", 0), ("loaded", args.burners)):
            with Load(burners), _pool(args.timeout) as pool:
                t0 = time.perf_counter()
                outcomes = sweep(pool, correct, args.runs)
                took = time.perf_counter() - t0
            total = sum(outcomes.values())
            bad = {k: v for k, v in outcomes.items() if k != "passed"}
            print(f"  {label}: {outcomes['passed']}/{total} passed in {took:.0f} s; "
                  f"false alarms: {sum(bad.values())} {dict(bad) if bad else ''}")  # fmt: skip

    if args.only in (None, "shrink"):
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

    if args.only in (None, "debug"):
        print("\n3. torch.distributed's own checks on a clean run")
        debug_costs()


if __name__ == "__main__":
    main()
