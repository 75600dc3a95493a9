"""How long the Hypothesis recipe of docs/how-to/hypothesis.md takes to shrink one bug, and
whether two runs shrink it to the same example.

    python benchmarks/hypothesis_shrink.py [--runs 2] [--explain] [--nside 1]

The bug: the HEALPix stepper whose prediction gather keeps its padding (``padding-kept``),
wrong only where the ranks' cell ranges differ in size. Hypothesis draws the partition
(``harness.strategies.cell_partitions``, 4 ranks, empty ranks included) and two samples of
point observations (``observation_sets``: many choices, which is what the explain phase
reruns the check for, one by one) and runs one ``check_equivalence`` per example on one
warm pool. ``recipe``: ``check_settings()`` (the
how-to's: derandomized, no database, no explain phase, 10 examples), run ``--runs`` times;
``--explain`` adds one run with Hypothesis's default phases (explain included), the recipe
before this change. Printed per run: checks run, failing checks, seconds to the first
failure and from it to the shrunk example (the shrink), and that example. Nothing asserts
on timings; the runs of the recipe must shrink to the same example.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from harness import RankPool, check_equivalence
from harness.partition import CellPartition
from harness.steppers.healpix import HealpixCase
from harness.strategies import cell_partitions, check_settings, observation_sets

RANKS = 4


@dataclass
class Run:
    checks: int = 0
    failing: int = 0
    first_failure: float | None = None
    last_failing: str = ""
    t0: float = field(default_factory=time.perf_counter)


def shrink(pool: RankPool, nside: int, chosen: settings) -> tuple[Run, float]:
    run = Run()

    @chosen
    @given(data=st.data())
    def every_partition_is_equivalent(data: st.DataObject) -> None:
        run.checks += 1
        part: CellPartition = data.draw(cell_partitions(nside=nside, ranks=RANKS))
        sets = observation_sets(nside=nside, channels=2, max_points=24, partition=part)
        samples = data.draw(st.lists(sets, min_size=2, max_size=2))
        case = HealpixCase(
            nside=nside,
            bounds=part.bounds,
            observations=samples,
            channels=2,
            faults=("padding-kept",),
        )
        report = check_equivalence(case, ranks=RANKS, pool=pool)
        if not report.ok:
            run.failing += 1
            # the last failing example is the shrunk one (Hypothesis replays it at the end)
            points = [len(s) for s in samples]
            run.last_failing = f"bounds {part.bounds}, points per sample {points}"
            if run.first_failure is None:
                run.first_failure = time.perf_counter() - run.t0
        report.raise_if_failed()

    try:
        every_partition_is_equivalent()
    except AssertionError:
        pass
    else:
        raise SystemExit("no example failed: the bug was not found")
    return run, time.perf_counter() - run.t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--explain", action="store_true")
    parser.add_argument("--nside", type=int, default=1)
    args = parser.parse_args()
    modes = [("recipe", check_settings())] * args.runs
    if args.explain:  # the recipe before: Hypothesis's default phases, explain included
        modes.append(("with explain", check_settings(phases=tuple(settings.default.phases))))
    shrunk = []
    with RankPool(RANKS, start_method="forkserver") as pool:
        warm = HealpixCase(nside=args.nside)
        check_equivalence(warm, ranks=RANKS, pool=pool)  # imports, groups
        t0 = time.perf_counter()
        check_equivalence(warm, ranks=RANKS, pool=pool)
        one = time.perf_counter() - t0
        print(f"padding-kept, nside {args.nside}, {RANKS} ranks; one passing check {one:.2f} s")
        for name, chosen in modes:
            run, total = shrink(pool, args.nside, chosen)
            first = run.first_failure or 0.0
            print(
                f"  {name:12s}: {run.checks:3d} checks ({run.failing} failing), first failure "
                f"at {first:5.1f} s, shrunk {total - first:5.1f} s later, total {total:5.1f} s; "
                f"shrunk to {run.last_failing}"
            )
            if name == "recipe":
                shrunk.append(run.last_failing)
    same = len(set(shrunk)) == 1
    print(f"  the {len(shrunk)} runs of the recipe shrank to {'the same' if same else 'different'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
