"""What a 150-step rollout check costs against its own baseline and against the 2-step
training check, and how many nudged reruns (ensemble members) its envelope needs.

    python benchmarks/rollout_cost.py [--steps 150] [--repeats 2] [--members 1 2 4 8]
        [--only baseline|cost|members]

Against its baseline, what a user would do by hand without the harness: the ranks of the
same warm pool roll the model out (``predict`` on each rank's part, its shards returned),
this process rolls out the serial model at the same time, then every step's reassembled
field is compared with ``torch.allclose``. The rollout check (``check_rollout``: the same
two rollouts, ``MEMBERS`` nudged serial reruns, the judgement of every step and field)
and the whole check with ``rollout=`` (the 2-step training check too) against it,
alternated, medians of ``--repeats`` (the goal: at most 1.3x).

The SFNO stepper (16x32, 2x2 process grid, float32) on 4 ranks: the training check
(``check_equivalence``, 2 steps) against the rollout that ``rollout=150`` adds (the
reference, ``MEMBERS`` nudged reruns of it and the partitioned rollout, then the
judgement), medians of ``--repeats`` through one warm pool (the goal: at most 3x), with
the serial rollouts run before the ranks' (``OVERLAP = False``, as before) and while the
ranks run (``OVERLAP = True``, the default), interleaved.

Ensemble size: the ranks' rollout is run once, the reference nudged ``max(--members)``
times; for each size ``m`` the envelope from the first ``m`` members is compared with the
largest one's: the narrowest it gets (its smallest spread over the steps, relative to the
largest ensemble's) and the worst ratio of the partitioned run's error to the spread
(which must stay well under ``FACTOR``). The same for the chaotic Lorenz-96 ring of the
tests (``tests/distributed/ring.py``). Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.distributed.ring

import harness.rollout as rollout
from harness import PoolRegistry, Tolerance, Topology, check_equivalence
from harness._judges.fields import assemble_whole, flat_like
from harness._rank.predict import rollout_entry, run_prediction
from harness.pool.overlap import Background
from harness.rollout import FACTOR, MEMBERS, SERIAL_THREADS, check_rollout, judge_rollout

RANKS = 4


def _cost(case, pool, steps: int, repeats: int) -> None:
    check_equivalence(case, ranks=RANKS, pool=pool, rollout=2)  # warm: imports, groups
    trains: list[float] = []
    rolls: dict[bool, list[float]] = {True: [], False: []}
    serials: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = check_equivalence(case, ranks=RANKS, pool=pool)
        trains.append(time.perf_counter() - t0)
        assert report.ok, report
        for overlap in (False, True):  # interleaved: the machine's load hits both alike
            rollout.OVERLAP = overlap
            try:
                rolled = check_equivalence(case, ranks=RANKS, pool=pool, rollout=steps)
            finally:
                rollout.OVERLAP = True
            assert rolled.ok and rolled.rollout is not None, rolled
            rolls[overlap].append(rolled.rollout.seconds)
            serials[overlap].append(rolled.rollout.serial_seconds)
    train = statistics.median(trains)
    print(f"  training check (2 steps):        {train:6.2f} s")
    for overlap, how in ((False, "serial, then ranks"), (True, "serial while ranks run")):
        roll, serial = statistics.median(rolls[overlap]), statistics.median(serials[overlap])
        print(
            f"  {steps}-step rollout ({MEMBERS} members, {how}): {roll:6.2f} s -> "
            f"{roll / train:.1f}x the training check ({(roll + train) / train:.1f}x for the "
            f"check with both); serial part (ref + members) {serial:.2f} s"
        )


def _bare(case, pool, steps: int) -> bool:
    """The rollout by hand: the ranks' partitioned one beside the serial one (one torch
    thread, as the check runs it), then ``torch.allclose`` on every step's fields."""
    ranks_run = Background(pool, (rollout_entry, case, None, steps, 0, None), None)
    threads = torch.get_num_threads()
    torch.set_num_threads(SERIAL_THREADS)
    try:
        serial = run_prediction(case, Topology.single(), steps, 0)
    finally:
        torch.set_num_threads(threads)
    ranks = ranks_run.result()
    close = True
    for k, fields in enumerate(serial):
        for n, ref in fields.items():
            shards = [r[k][n] for r in ranks]
            got = assemble_whole(n, ref.values, shards, RANKS)
            close &= torch.allclose(got, flat_like(ref, shards), rtol=1e-3, atol=1e-3)
    return close


def _baseline(case, pool, steps: int, repeats: int) -> None:
    """The rollout check and the whole check against the rollout by hand, alternated."""
    bound = Tolerance.for_dtype(torch.float32).field
    check_equivalence(case, ranks=RANKS, pool=pool, rollout=2)  # warm: imports, groups
    _bare(case, pool, 2)
    times: dict[str, list[float]] = {"bare": [], "rollout": [], "check": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        _bare(case, pool, steps)  # its verdict: chaos may leave a correct rollout beyond 1e-3
        times["bare"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        record = check_rollout(case, pool, spatial_size=RANKS, steps=steps, seed=0, bound=bound)
        times["rollout"].append(time.perf_counter() - t0)
        assert record.first is None and not record.mismatches, record.lines()
        t0 = time.perf_counter()
        report = check_equivalence(case, ranks=RANKS, pool=pool, rollout=steps)
        times["check"].append(time.perf_counter() - t0)
        assert report.ok, report
    bare = statistics.median(times["bare"])
    roll, check = statistics.median(times["rollout"]), statistics.median(times["check"])
    print(f"  by hand (partitioned beside serial, allclose): {bare:6.2f} s")
    print(f"  rollout check ({MEMBERS} members): {roll:6.2f} s -> {roll / bare:.2f}x")
    print(f"  check, rollout={steps} + 2 training steps: {check:6.2f} s -> {check / bare:.2f}x")


def _members(case, pool, steps: int, sizes: list[int]) -> None:
    bound = Tolerance.for_dtype(torch.float32).field
    threads = torch.get_num_threads()
    torch.set_num_threads(SERIAL_THREADS)
    try:
        reference = run_prediction(case, Topology.single(), steps, 0)
        members = [
            run_prediction(case, Topology.single(), steps, 0, member=j) for j in range(max(sizes))
        ]
    finally:
        torch.set_num_threads(threads)
    ranks = pool.run(rollout_entry, case, None, steps, 0, None)
    full = judge_rollout(reference, members, ranks, bound, spatial_size=RANKS)
    for m in sizes:
        record = judge_rollout(reference, members[:m], ranks, bound, spatial_size=RANKS)
        narrow = min(p.spread / q.spread for p, q in zip(record.curve, full.curve) if q.spread > 0)
        worst = max(p.ratio for p in record.curve)
        verdict = "passes" if record.first is None else f"fails at step {record.first.step}"
        print(
            f"  {m} member(s): spread down to {narrow:.2f}x the {max(sizes)}-member one; worst "
            f"error/spread {worst:.2f} (bound {FACTOR:g}); {verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--members", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--only", choices=("baseline", "cost", "members"), default=None)
    args = parser.parse_args()
    from harness.steppers.sfno import SFNOCase
    from tests.distributed.ring import RingCase

    sfno = SFNOCase(nlat=16, nlon=32, h=2, w=2, dtype=torch.float32)
    registry = PoolRegistry()
    try:
        pool = registry.get(RANKS)
        cases = (("SFNO 16x32 on 2x2 ranks", sfno), ("Lorenz-96 ring of 40", RingCase()))
        if args.only in (None, "baseline"):
            for label, case in cases:
                print(
                    f"{label}, float32: {args.steps} steps against the rollout by hand, "
                    f"median of {args.repeats}"
                )
                _baseline(case, pool, args.steps, args.repeats)
        if args.only in (None, "cost"):
            print(f"SFNO 16x32 on 2x2 ranks, float32, median of {args.repeats}")
            _cost(sfno, pool, args.steps, args.repeats)
        if args.only in (None, "members"):
            for label, case in cases:
                print(f"{label}: ensemble size, {args.steps} steps")
                _members(case, pool, args.steps, sorted(args.members))
    finally:
        registry.close()


if __name__ == "__main__":
    main()
