"""How a check below float64 is judged: by the fixed tolerance of its dtype, or by each
entry's rounding spread (``harness.equivalence._calibrate``, the default). The numbers behind
``FACTOR``, ``ULPS`` and ``MEMBERS`` and docs/precision.md.

    python benchmarks/precision.py [--seeds 0 1 2] [--part correct faults tail cost]

- ``correct``: every built-in stepper's main-job layouts, and the halo-tail stencil of the
  tests on 4x1 and 2x1 with 2 data groups, in float32: the worst error as a multiple of its
  entry's rounding spread, per quantity (what ``FACTOR`` must stay above, with a margin).
- ``faults``: every fault of the catalogue run in float32: caught by the fixed tolerance
  (``calibrate=False``), by the calibrated judgement, and at what multiple.
- ``tail``: the halo one row short (``tests/distributed/halo_tail.py``) as its dropped
  weights shrink: where the fixed tolerance stops seeing it, where the calibrated one does.
- ``cost``: the calibrated check against the bare check (``calibrate=False``: the ranks'
  run, judged by the tolerance), alternated in one process through one warm pool.

Nothing asserts: it prints. A 2-core machine shared with other work moves every timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.distributed.halo_tail

from harness import PoolRegistry, check_equivalence
from harness.compare import NUMERIC
from harness.steppers.catalogue import fault_matrix, main_configs

RANKS = 4
F32 = torch.float32


def _multiples(report) -> str:
    return "  ".join(
        f"{q} {report.spread_multiple(q):5.2f}x" if report.spread_multiple(q) is not None else ""
        for q in NUMERIC
    )


def correct(pool, seeds: list[int]) -> None:
    from tests.distributed.halo_tail import HaloTailCase

    print("correct float32 layouts: worst error / rounding spread (must stay under FACTOR)")
    cases = [(label, make(**{**kw, "dtype": F32}), s) for label, make, kw, s in main_configs(4)]
    cases += [("halo-tail 4x1", HaloTailCase(), None), ("halo-tail 2x1 s×d", HaloTailCase(), 2)]
    worst = 0.0
    for label, case, spatial in cases:
        for seed in seeds:
            r = check_equivalence(case, ranks=RANKS, spatial_size=spatial, seed=seed, pool=pool)
            seen = max((r.spread_multiple(q) or 0.0) for q in NUMERIC)
            worst = max(worst, seen)
            verdict = "ok " if r.ok else "FAIL"
            print(f"  {verdict} {label:22s} seed {seed}: {_multiples(r)}")
    print(f"  worst over every correct run: {worst:.2f}x")


def faults(pool) -> None:
    print("catalogue faults in float32: fixed tolerance vs calibrated (multiple of the spread)")
    both = fixed_only = calibrated_only = 0
    for stepper, make, kw, spatial, fault, _ in fault_matrix(RANKS):
        case = make(**{**kw, "dtype": F32, "faults": (fault,)})
        args = {"ranks": RANKS, "spatial_size": spatial, "pool": pool, "locate": False}
        fixed = check_equivalence(case, calibrate=False, **args)
        calibrated = check_equivalence(case, **args)
        multiple = max(
            (m.spread_multiple for m in calibrated.mismatches if m.calibrated), default=0
        )
        seen = f"{multiple:.3g}x" if multiple else "-"
        print(
            f"  {stepper:12s} {fault:28s} fixed {'caught' if not fixed.ok else 'MISSED'}  "
            f"calibrated {'caught' if not calibrated.ok else 'MISSED'} "
            f"({', '.join(sorted(calibrated.quantities)) or 'nothing'}; worst {seen})"
        )
        both += not fixed.ok and not calibrated.ok
        fixed_only += not fixed.ok and calibrated.ok
        calibrated_only += fixed.ok and not calibrated.ok
    print(f"  both {both}, fixed only {fixed_only}, calibrated only {calibrated_only}")


def tail(pool, seeds: list[int]) -> None:
    from tests.distributed.halo_tail import HaloTailCase

    print("halo one row short, by the size of the dropped weights (4x1, float32)")
    for size in (1e-6, 3e-7, 1e-7, 3e-8):
        for seed in seeds:
            case = HaloTailCase("halo-short", tail=size)
            args = {"ranks": RANKS, "pool": pool, "locate": False, "seed": seed}
            fixed = check_equivalence(case, calibrate=False, **args)
            calibrated = check_equivalence(case, **args)
            field = calibrated.spread_multiple("field")
            print(
                f"  tail {size:.0e} seed {seed}: fixed {'caught' if not fixed.ok else 'missed'}"
                f" (field max rel {fixed.worst('field') or 0:.1e}), calibrated "
                f"{'caught' if not calibrated.ok else 'missed'} (field {field or 0:.3g}x)"
            )


def cost(pool, repeats: int) -> None:
    from harness.steppers import SFNOCase

    print("cost: calibrated check / bare check (alternated, medians)")
    for label, case in (
        ("sfno 16x32 2x2", SFNOCase(nlat=16, nlon=32, h=2, w=2, dtype=F32)),
        (
            "sfno 30x62 4x1 gauss",
            SFNOCase(nlat=30, nlon=62, h=4, w=1, grid="legendre-gauss", dtype=F32),
        ),
    ):
        check_equivalence(case, ranks=RANKS, pool=pool)  # warm: imports, groups
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for calibrated in (False, True):
                t0 = time.perf_counter()
                check_equivalence(case, ranks=RANKS, pool=pool, calibrate=calibrated, locate=False)
                times[calibrated].append(time.perf_counter() - t0)
        bare, cal = statistics.median(times[False]), statistics.median(times[True])
        print(f"  {label:22s} bare {bare:.2f} s, calibrated {cal:.2f} s: {cal / bare:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--part",
        nargs="+",
        default=["correct", "faults", "tail", "cost"],
        choices=["correct", "faults", "tail", "cost"],
    )
    args = parser.parse_args()
    registry = PoolRegistry()
    try:
        pool = registry.get(RANKS)
        for part in args.part:
            t0 = time.perf_counter()
            if part == "correct":
                correct(pool, args.seeds)
            elif part == "faults":
                faults(pool)
            elif part == "tail":
                tail(pool, args.seeds)
            else:
                cost(pool, args.repeats)
            print(f"  ({time.perf_counter() - t0:.0f} s)\n")
    finally:
        registry.close()


if __name__ == "__main__":
    main()
