"""What a sweep of the layouts costs against one check, covering and exhaustive, what a pool
start costs per world size, what an idle rank holds, and what a trivial run costs; and with
``--proof``, that the covering sweep names the exhaustive sweep's smallest failing layout for
every fault of the catalogue and of the held-out stencil.

    PYTHONPATH=. python benchmarks/layouts_cost.py [--max-ranks 8] [--repeat 3]
        [--steppers sfno healpix mlp stencil] [--proof [SELECT]] [--cpus N]

Every number is measured in this one run, so its ratios hold on a loaded machine:

- pool start per world size 1..``--max-ranks`` (forkserver; the fork server already up, as
  it is after a session's first pool), and the first start with the fork server;
- a trivial run (one all-reduce) on a warm 4-rank pool: the floor of every test's cost;
- per built-in stepper and the held-out lat x lon stencil (``tests/distributed/stencil.py``:
  run from the repository root with ``PYTHONPATH=.``): the median of one warm 4-rank
  ``check_equivalence``, then ``check_layouts`` up to ``--max-ranks`` ranks: the covering
  sweep on fresh pools (started inside it, as a CI job would), then on the pools it left
  warm, side by side (the default) and one layout at a time, alternated ``--repeat``
  times, and the exhaustive sweep on fresh pools and warm; each printed as a ratio to the
  check, with the layouts the case refused and the share of the cores busy (this process
  and every rank: where it nears 100 % the sweep is bound by the CPUs, not by waiting) and
  the CPU the sweep used in checks' worth of every core ("its CPU alone"): no schedule of
  those runs on these cores takes fewer checks;
- the memory of the idle ranks the sweeps left alive (one ``PoolRegistry`` keeps a pool of
  every size within its budget): resident (RSS) and proportional (PSS: pages shared with the
  fork server and the other ranks counted once, split between them), per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from harness import SpatialCase, check_equivalence
from harness.layouts import LayoutsReport, check_layouts
from harness.pool import PoolRegistry, RankPool


def trivial_job() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def steppers() -> dict[str, Callable[[], SpatialCase]]:
    from harness.steppers.healpix import HealpixCase
    from harness.steppers.mlp import CoupledMLPCase
    from harness.steppers.sfno import SFNOCase

    def stencil() -> SpatialCase:
        from tests.distributed.stencil import StencilCase

        return StencilCase()

    return {"sfno": SFNOCase, "healpix": HealpixCase, "mlp": CoupledMLPCase, "stencil": stencil}


def pool_starts(max_ranks: int) -> None:
    t0 = time.perf_counter()
    with RankPool(1, start_method="forkserver") as pool:  # the fork server starts here
        first = time.perf_counter() - t0
        pool.run(trivial_job)
        print(f"pool start (forkserver), first pool with its fork server: {first:5.2f} s")
        line = []
        for size in range(1, max_ranks + 1):
            t0 = time.perf_counter()
            with RankPool(size, start_method="forkserver") as other:
                line.append(f"{size}: {time.perf_counter() - t0:4.2f}")
                other.run(trivial_job)
        print("  then per world size (s): " + "  ".join(line))


def trivial_runs(registry: PoolRegistry, runs: int = 200) -> float:
    pool = registry.get(4)
    for _ in range(20):
        pool.run(trivial_job)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        pool.run(trivial_job)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_check(case: SpatialCase, pool: RankPool, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        check_equivalence(case, ranks=4, pool=pool)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_seconds(registry: PoolRegistry) -> float:
    """CPU seconds used so far by this process and every rank of ``registry``'s pools."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for size in registry.live:
        for pid in registry.get(size).pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def timed_sweep(
    case: SpatialCase,
    max_ranks: int,
    registry: PoolRegistry,
    exhaustive: bool,
    side_by_side: bool = True,
) -> tuple[LayoutsReport, float, float]:
    """One sweep on ``registry``'s pools: its report, seconds, and the share of the cores
    busy (this process and the ranks; of a warm sweep: a fresh one starts ranks inside)."""
    cpu = cpu_seconds(registry)
    t0 = time.perf_counter()
    report = check_layouts(
        case,
        max_ranks=max_ranks,
        pools=registry.get,
        exhaustive=exhaustive,
        side_by_side=side_by_side,
    )
    seconds = time.perf_counter() - t0
    busy = (cpu_seconds(registry) - cpu) / (seconds * len(os.sched_getaffinity(0)))
    return report, seconds, busy


def sweep(name: str, case: SpatialCase, max_ranks: int, repeat: int) -> None:  # long: a table
    # The 4-rank check on its own warm pool, measured before and after the sweeps (the load
    # of a shared machine drifts within minutes; the ratios are against their mean). Each
    # sweep's pools start inside it (cold), as in a CI job; then the covering sweep runs
    # again on the pools it left (warm, as in a pytest session that swept before), side by
    # side and one layout at a time, alternated ``repeat`` times (medians).
    check_pools = PoolRegistry(start_method="forkserver", max_processes=4)
    cover_pools = PoolRegistry(start_method="forkserver", max_processes=64)
    every_pools = PoolRegistry(start_method="forkserver", max_processes=64)
    try:
        four = check_pools.get(4)
        check_equivalence(case, ranks=4, pool=four)  # warm: a session pays this once
        before = median_check(case, four, repeat)
        fresh = timed_sweep(case, max_ranks, cover_pools, False)
        warm: dict[bool, list[tuple[LayoutsReport, float, float]]] = {True: [], False: []}
        for _ in range(repeat):
            for beside in (True, False):
                warm[beside].append(timed_sweep(case, max_ranks, cover_pools, False, beside))
        every_fresh = timed_sweep(case, max_ranks, every_pools, True)
        every_warm = timed_sweep(case, max_ranks, every_pools, True)  # adjacent: warm
        after = median_check(case, four, repeat)
        check = (before + after) / 2
        print(
            f"  {name:<8} one warm 4-rank check {check:5.2f} s ({before:.2f} before, "
            f"{after:.2f} after); up to {max_ranks} ranks:"
        )
        rows = {
            "covering, fresh pools": fresh,
            "covering, warm, side by side": _median(warm[True]),
            "covering, warm, one at a time": _median(warm[False]),
            "exhaustive, fresh pools": every_fresh,
            "exhaustive, warm pools": every_warm,
        }
        for what, (report, seconds, busy) in rows.items():
            n = len(report.results) + len(report.left_out)
            # the CPU the sweep used, in checks of every core: no schedule of these runs on
            # these cores ends sooner (where it nears the ratio, only less CPU helps)
            floor = busy * seconds / check
            print(
                f"    {what:<30} {seconds:6.2f} s = {seconds / check:5.2f}x: layouts "
                f"{len(report.results)} of {n} ({len(report.passed)} run, "
                f"{len(report.refused)} refused, {len(report.failing)} failed); cores "
                f"busy {busy:4.0%}, its CPU alone {floor:5.2f}x"
            )
        mem = every_pools.memory_kib()
        rss = [r for ranks in mem.values() for r, _ in ranks]
        pss = [p for ranks in mem.values() for _, p in ranks]
        if pss:
            print(
                f"    idle ranks left alive: {len(pss)} (sizes {sorted(mem)}); per rank "
                f"RSS {statistics.median(rss) / 1024:5.0f} MiB, PSS "
                f"{statistics.median(pss) / 1024:5.1f} MiB (median); all: PSS "
                f"{sum(pss) / 1024:6.0f} MiB"
            )
    finally:
        every_pools.close()
        cover_pools.close()
        check_pools.close()


def _median(
    runs: list[tuple[LayoutsReport, float, float]],
) -> tuple[LayoutsReport, float, float]:
    """The run of median seconds."""
    return sorted(runs, key=lambda r: r[1])[len(runs) // 2]


def proof(max_ranks: int, select: str) -> int:
    """Both sweeps of every catalogue fault and held-out stencil bug (whose label contains
    ``select``) up to ``max_ranks``: the covering sweep must name the exhaustive sweep's
    smallest failing layout. Returns the number that do not."""
    from harness.steppers import catalogue
    from tests.distributed.stencil import FAULTS, StencilCase

    cases: list[tuple[str, SpatialCase]] = [
        (f"{s}:{f}", catalogue.sweep_case(s, make, kwargs, f))
        for s, make, kwargs, _sp, f, _q in catalogue.fault_matrix(4)
    ]
    cases += [(f"stencil:{f}", StencilCase(f)) for f in (None, *FAULTS)]
    registry = PoolRegistry(start_method="forkserver", max_processes=64)
    lost = 0
    try:
        for label, case in cases:
            if select not in label:
                continue
            t0 = time.perf_counter()
            every = check_layouts(
                case, max_ranks=max_ranks, pools=registry.get, locate=False, exhaustive=True
            )
            t1 = time.perf_counter()
            cover = check_layouts(case, max_ranks=max_ranks, pools=registry.get, locate=False)
            t2 = time.perf_counter()
            same = cover.smallest_failing == every.smallest_failing
            lost += not same
            print(
                f"  {'same' if same else 'LOST':<4} {label:<36} layouts {len(cover.results):>2} "
                f"of {len(every.results):>2} ({t2 - t1:5.1f} s vs {t1 - t0:5.1f} s); smallest "
                f"failing: {every.smallest_failing}"
                + ("" if same else f" / covering: {cover.smallest_failing}"),
                flush=True,
            )
    finally:
        registry.close()
    return lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steppers", nargs="+", default=list(steppers()))
    parser.add_argument(
        "--proof",
        nargs="?",
        const="",
        default=None,
        metavar="SELECT",
        help="only: both sweeps of each fault (whose stepper:fault contains SELECT)",
    )
    parser.add_argument(
        "--cpus",
        type=int,
        default=0,
        metavar="N",
        help="run on this process's first N CPUs only (the ranks inherit it): how the "
        "ratios move with the cores",
    )
    args = parser.parse_args()
    if args.cpus:  # before the fork server starts: every rank inherits it
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} CPUs")
    if args.proof is not None:
        print(f"covering vs exhaustive sweep up to {args.max_ranks} ranks, per fault:")
        lost = proof(args.max_ranks, args.proof)
        print(f"{lost} fault(s) whose smallest failing layout the covering sweep lost")
        raise SystemExit(1 if lost else 0)
    pool_starts(args.max_ranks)
    registry = PoolRegistry(start_method="forkserver")
    try:
        ms = trivial_runs(registry) * 1e3
        print(f"trivial run (one all-reduce) on a warm 4-rank pool: {ms:.2f} ms (median)")
    finally:
        registry.close()
    print("sweeps, covering and exhaustive:")
    makers = steppers()
    for name in args.steppers:
        sweep(name, makers[name](), args.max_ranks, args.repeat)


if __name__ == "__main__":
    main()
