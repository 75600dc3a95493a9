"""Inference rollouts, step by step: ``SpatialCase.predict`` run on the reference, on a small
ensemble of the reference nudged by a few units of rounding, and on every rank; each step
and field judged against the spread that rounding alone reaches there.

A chaotic rollout cannot be judged with a fixed tolerance: its rounding differences grow
step after step (the float32 Lorenz-96 ring of the tests: ~1e-7 at step 0, ~1e-4 by step
90, ~1e-2 by step 150), so any fixed bound either fails a correct rollout late or misses a
bug early. What rounding *can* reach at each step is measured instead, the way MeteoSwiss'
probtest and CESM's ensemble consistency test do for their codes: the reference is rerun
``members`` times with its parameters and its batch moved by ``NUDGE_ULPS`` units of
rounding (random signs, a private generator per member). The spread of step ``k`` and
field ``f`` is the largest distance of any member from the reference; the partitioned run
fails there when its own distance exceeds ``FACTOR`` times that spread and the check's
fixed field tolerance (which covers the first steps, where a field that hardly depends on
its inputs has a spread of ~0).

What runs ``predict`` (here, in the ensemble and on the ranks) is the rank side's,
``harness._rank.predict``; what a check found, ``RolloutRecord``, lives in
``harness._records.rollout`` below the report that holds it; both are importable from here.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from harness._base.cpus import torch_threads
from harness._base.deprecation import forward
from harness._judges.fields import assemble_whole, flat_like
from harness._rank.deadline import Deadline, RanOut
from harness._rank.nudge import NUDGE_ULPS
from harness._rank.predict import (
    rollout_entry,
    run_prediction,
)
from harness._records.rollout import RolloutPoint, RolloutRecord
from harness._records.run import FieldRecord, StepRecord
from harness.case.declared import CheckSpec, has_predict
from harness.compare import Bound, Mismatch, Quantity
from harness.errors import RankFailure
from harness.pool.overlap import Background, in_other_processes
from harness.topology import Topology

if TYPE_CHECKING:
    from harness._judges import Judge
    from harness.case import SpatialCase
    from harness.pool import Runner

__all__ = [
    "FACTOR",
    "MEMBERS",
    "NUDGE_ULPS",
    "RolloutPoint",
    "RolloutRecord",
    "SerialRanOut",
    "check_rollout",
    "judge_rollout",
    "plot_rollout",
    "run_prediction",
]

# Importable from here for older code (with a DeprecationWarning).
__getattr__ = forward(
    __name__,
    {"autocast_context": "harness._rank.dtypes", "rollout_steps": "harness.case.declared"},
)

# the records' home for users, pickles and reprs is this module (``harness`` exports them;
# ``tests/unit/test_layers.py``: an exported name lives in a public module)
for _public in (RolloutPoint, RolloutRecord):
    _public.__module__ = __name__

#: Ensemble members (nudged reruns of the reference) that measure the rounding spread. Fewer
#: members see less of it: over 150 steps (benchmarks/rollout_cost.py, remeasured 2026-12-05)
#: the spread of one member dipped at some step to 0.11x that of eight, of two to 0.34x, of
#: four to 0.58x on the SFNO stepper (0.10x, 0.36x, 0.60x on the Lorenz-96 ring). With four,
#: FACTOR x the spread stays above 5x what eight members would measure, and a member costs
#: one serial rollout (0.3-0.9 s for 150 SFNO steps on the loaded 2-core machine), run while
#: the ranks roll out (OVERLAP).
MEMBERS = 4
#: A step fails when the partitioned run is further from the reference than FACTOR times the
#: furthest member. The partitioned run is one more draw of the same rounding process (sums
#: in another order instead of nudged inputs), usually a smaller one: measured (float32, 4
#: ranks, every step and field of 150-step rollouts) the ratio error/spread was at most 1.0
#: on the Lorenz-96 ring (its replicated 'energy' sum, seeds 0-2; tests/distributed/ring.py;
#: 0.67 with 4 members in benchmarks/rollout_cost.py) and 0.18 on the SFNO stepper with 4
#: members (0.64 with one). 10 leaves a margin of 10x over the worst seen; the inference
#: bugs measured enter at 700x..3e5x the spread (ring and SFNO faults), so the margin costs
#: them no detection.
FACTOR = 10.0
#: torch threads for the serial rollouts (reference and members) in the calling process, as
#: every rank runs. A rollout is many small steps, where intra-op threads cost more than
#: they give: measured, one 150-step float32 rollout of the 16x32 SFNO stepper took 4.6 s
#: with torch's default threads and 0.55 s with one, on a loaded 2-core machine.
SERIAL_THREADS = 1
#: Run the ranks' partitioned rollout (a ``RankPool``'s other processes) while this process
#: computes the serial ones, instead of one after the other. The ranks spend their rollout
#: waiting in gloo (18 collectives per SFNO step), so the serial rollouts fit in beside them
#: where a core is free. On the loaded 2-core machine the gain is within the noise
#: (benchmarks/rollout_cost.py, interleaved: 4.2x vs 5.2x and 4.7x vs 3.3x the training check,
#: sequential vs overlapped), and at load 7 it saved ~1 s of 9.4 (the serial part);
#: docs/rollouts.md, "Cost".
OVERLAP = True


# ---------------------------------------------------------------------- judging


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not a.numel():
        return 0.0
    d = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float(d.nan_to_num(nan=math.inf).max())


def judge_rollout(
    reference: list[dict[str, FieldRecord]],
    members: list[list[dict[str, FieldRecord]]],
    ranks: list[list[dict[str, FieldRecord]]],
    bound: Bound,
    *,
    spatial_size: int,
    factor: float = FACTOR,
    high: list[dict[str, FieldRecord]] | None = None,
    ratio: float = 4.0,
    sticks: Yardsticks | None = None,
) -> RolloutRecord:
    """Judge every step and field of the ranks' rollout against the reference's, within
    ``factor`` times the members' spread (and at least the fixed ``bound``). Under autocast,
    ``high``: the reference's rollout without it; the bound is then at least ``ratio`` times
    the reference's distance from it (the reduced precision's own rounding, which nudges of
    the inputs do not reach: ``harness._judges.autocast``'s ratio rule, step by step).
    ``sticks``:
    what of it does not depend on the ranks (``yardsticks``), if measured already."""
    from harness._judges import Judge, Layout
    from harness.compare import NUMERIC, QuantityStats, Tolerance

    record = RolloutRecord(len(reference), len(members), factor)
    # structure only (missing fields, coverage, shard shapes): values are judged below
    loose = Judge(
        Tolerance.uniform(math.inf, math.inf),
        Layout(len(ranks), spatial_size),
        {q: QuantityStats() for q in NUMERIC},
    )
    sticks = yardsticks(reference, members) if sticks is None else sticks
    skipped: set[str] = set()  # keyed fields, said once
    stopped: set[str] = set()  # fields whose reference or spread stopped being finite
    for k, ref_fields in enumerate(reference):
        rank_fields = [r[k] for r in ranks]
        plain = _positional(record, ref_fields, rank_fields, skipped)
        broken = _structure(record, loose, k, plain, rank_fields)
        for n, ref_field in plain.items():
            if n in broken or n in stopped:
                continue
            shards = [fs[n] for fs in rank_fields]
            stick = sticks[k][n]
            point = _point(record, k, n, ref_field, shards, stick, bound, factor, spatial_size)
            if point is not None and high is not None and n in high[k]:
                _precision(point, ref_field, high[k][n], shards, ratio)
            if point is None:
                stopped.add(n)
            else:
                record.curve.append(point)
    _first_divergent(record, factor)
    return record


def _positional(
    record: RolloutRecord,
    ref_fields: dict[str, FieldRecord],
    rank_fields: list[dict[str, FieldRecord]],
    skipped: set[str],
) -> dict[str, FieldRecord]:
    """The reference's fields of one step that a rollout compares: keyed ones are named
    once on a ``Not compared`` line and left out."""
    keyed = {n for n, f in ref_fields.items() if f.keyed}
    keyed |= {n for fs in rank_fields for n, f in fs.items() if f.keyed}
    for n in sorted(keyed - skipped):
        record.not_compared.append(
            f"field '{n}' of the rollout is keyed (Shard.keyed): rollouts compare "
            "positional shards and whole tensors"
        )
    skipped |= keyed
    return {n: f for n, f in ref_fields.items() if n not in keyed}


def _structure(
    record: RolloutRecord,
    loose: Judge,
    k: int,
    plain: dict[str, FieldRecord],
    rank_fields: list[dict[str, FieldRecord]],
) -> set[str]:
    """Step ``k``'s missing fields, coverage and shard shapes, as the training check judges
    them (values are the envelope's): the mismatches go on the record, the names of the
    fields they broke come back."""
    from harness._judges import check_fields

    odd = _odd_shapes(record, k, plain, rank_fields, loose.layout.data_size)
    plain = {n: f for n, f in plain.items() if n not in odd}
    zero = torch.zeros(())
    found, _ = check_fields(
        loose,
        k,
        StepRecord(zero, fields=plain),
        [
            StepRecord(zero, fields={n: f for n, f in fs.items() if n in plain})
            for fs in rank_fields
        ],
    )
    # a NaN or inf against a number: judged by the envelope as an infinite error at its step
    found = [m for m in found if not (m.quantity is Quantity.FIELD and m.max_abs == math.inf)]
    for m in found:
        m.where = f"rollout step {k} of {record.steps}: {m.where}"
    record.mismatches += found
    return {m.name for m in found} | odd


def _rest(f: FieldRecord, values: torch.Tensor) -> tuple[int, ...]:
    """A field's shape but for the dim its shard splits (a whole tensor: all of it)."""
    if not f.sharded:
        return tuple(values.shape)
    shape = list(values.shape)
    if shape:
        del shape[(f.dim if f.dim is not None else -1) % len(shape)]
    return tuple(shape)


def _odd_shapes(
    record: RolloutRecord,
    k: int,
    plain: dict[str, FieldRecord],
    rank_fields: list[dict[str, FieldRecord]],
    groups: int,
) -> set[str]:
    """Fields of step ``k`` whose shape (but for the split dim) a few ranks changed, and
    the reference with them: the reference runs the code of spatial rank 0 of a group of
    one, so a shape that only rank 0 gets wrong, the reference gets wrong too. Judged
    against the reference, every other rank would be blamed, and the odd rank's shape
    called the reference's: instead, where a majority of the ranks agree on a shape the
    reference does not have, the ranks that differ from the majority are named (the
    structure check, which blames whoever differs from the reference, is skipped). With
    ``groups`` data groups, the reference's part is a group's share of its samples."""
    from harness._judges import data_part

    odd: set[str] = set()
    for n, ref in plain.items():
        if any(n not in fs or fs[n].keyed for fs in rank_fields):
            continue  # a missing field is the structure check's
        shards = [fs[n] for fs in rank_fields]
        rests = [_rest(f, f.values) for f in shards]
        majority = max(set(rests), key=rests.count)
        if rests.count(majority) * 2 <= len(rests) or rests.count(majority) == len(rests):
            continue  # no majority to judge by, or every rank agrees
        theirs = _rest(shards[0], data_part(flat_like(ref, shards), 0, groups))
        if theirs == majority:
            continue  # the reference agrees with the majority: blamed as usual
        many = [r for r, x in enumerate(rests) if x == majority]
        for r, (f, rest) in enumerate(zip(shards, rests)):
            if rest == majority:
                continue
            record.mismatches.append(
                Mismatch(
                    Quantity.FIELD,
                    n,
                    k,
                    r,
                    where=f"rollout step {k} of {record.steps}: rank {r} gives shape "
                    f"{tuple(f.values.shape)} where ranks {_ranks(many)} give "
                    f"{tuple(shards[many[0]].values.shape)}; the reference's "
                    f"{tuple(ref.values.shape)} agrees with rank {r} but for the split dim, "
                    "so it is no yardstick here: look at what only rank "
                    f"{r} and the reference run (the reference is spatial rank 0 of one)",
                )
            )
        odd.add(n)
    return odd


def _ranks(ranks: list[int]) -> str:
    """``0-3`` for a run of ranks, ``0,2`` otherwise."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _point(
    record: RolloutRecord,
    k: int,
    n: str,
    ref_field: FieldRecord,
    shards: list[FieldRecord],
    stick: Yardstick,
    bound: Bound,
    factor: float,
    spatial_size: int,
) -> RolloutPoint | None:
    """Field ``n`` at step ``k``: its error, spread and envelope; ``None`` (said on the
    record) where the reference or a member stopped being finite, so nothing after it can be
    judged."""
    finite, spread, scale = stick
    if not finite:
        record.mismatches.append(
            Mismatch(
                Quantity.NONFINITE,
                n,
                k,
                None,
                where=f"rollout step {k} of {record.steps}: the reference's rollout is "
                "not finite, so nothing after it can be judged",
                run="reference",
                of="rollout",
            )
        )
        return None
    ref_values = flat_like(ref_field, shards)
    got = assemble_whole(n, ref_field.values, shards, spatial_size)
    if math.isinf(spread):
        record.not_compared.append(
            f"field '{n}' from step {k} on: a nudged rerun of the reference was not "
            "finite there, so the rounding spread is unknown"
        )
        return None
    floor = bound.atol + bound.rtol * scale
    return RolloutPoint(k, n, _max_abs(got, ref_values), spread, max(factor * spread, floor), scale)


#: a field at a step: whether the reference is finite there, the members' spread (the
#: furthest distance of any member from it) and its largest magnitude
Yardstick = tuple[bool, float, float]
Yardsticks = list[dict[str, Yardstick]]


def yardsticks(
    reference: list[dict[str, FieldRecord]], members: list[list[dict[str, FieldRecord]]]
) -> Yardsticks:
    """Every step's and field's ``Yardstick``: what the judgement needs that does not depend
    on the ranks, so ``check_rollout`` measures it while they still run. (Distances and
    magnitudes do not depend on the layout ``flat_like`` gives a grid field.)"""
    out: Yardsticks = []
    for k, fields in enumerate(reference):
        step: dict[str, Yardstick] = {}
        for n, f in fields.items():
            if f.keyed:  # not judged by the envelope (``_positional``)
                continue
            v = f.values
            finite = bool(torch.isfinite(v).all())
            others = [m[k][n].values for m in members if n in m[k]]
            spread = max((_max_abs(o, v) for o in others), default=0.0)
            scale = float(v.abs().max()) if v.numel() and finite else 0.0
            step[n] = (finite, spread, scale)
        out.append(step)
    return out


def _precision(
    point: RolloutPoint,
    ref_field: FieldRecord,
    high_field: FieldRecord,
    shards: list[FieldRecord],
    ratio: float,
) -> None:
    """Widen ``point``'s bound to ``ratio`` times the reference's distance from its
    high-precision rollout there (under autocast: what the reduced precision rounds)."""
    distance = _max_abs(flat_like(ref_field, shards), flat_like(high_field, shards))
    if math.isfinite(distance):
        point.precision = distance
        point.envelope = max(point.envelope, ratio * distance)


def _first_divergent(record: RolloutRecord, factor: float) -> None:
    """The rollout's one mismatch: its first divergent step and field, if any."""
    first = record.first
    if first is None:
        return
    ratio = "inf" if math.isinf(first.ratio) else f"{first.ratio:.3g}"
    record.mismatches.append(
        Mismatch(
            Quantity.ROLLOUT,
            first.name,
            first.step,
            None,
            max_abs=first.error,
            max_rel=first.error / first.scale if first.scale else math.inf,
            where=f"step {first.step} of {record.steps}: {ratio}x the rounding spread "
            f"{first.spread:.3g} (bound {factor:g}x)",
        )
    )


# ---------------------------------------------------------------------- the check


def check_rollout(
    case: SpatialCase,
    pool: Runner,
    *,
    spatial_size: int,
    steps: int,
    seed: int,
    bound: Bound,
    timeout: float | None = None,
    members: int = MEMBERS,
    autocast: torch.dtype | None = None,
    factor: float = FACTOR,
) -> RolloutRecord:
    """Roll ``case`` out ``steps`` steps on the reference, on ``members`` nudged reruns of
    it and on every rank of ``pool``; judge each step and field (``judge_rollout``).
    A rank that raised, crashed or hung raises its ``RankFailure`` (``check_equivalence``
    makes it the report's mismatches)."""
    has_predict(case)
    spec = CheckSpec(
        pool.world_size,
        spatial_size,
        seed=seed,
        rollout=steps,
        autocast=autocast,
        timeout=timeout,
    )
    return roll_out(spec, case, pool, bound, members=members, factor=factor)


def roll_out(
    spec: CheckSpec,
    case: SpatialCase,
    pool: Runner,
    bound: Bound,
    *,
    members: int = MEMBERS,
    factor: float = FACTOR,
) -> RolloutRecord:
    """``check_rollout`` of the rollout ``spec`` asks for (``rollout`` steps from ``seed``,
    at ``autocast``, on ``spatial_size`` ranks a group, stopped at ``timeout``): the spec
    that crosses to every rank whole (``rollout_entry``)."""
    t0 = time.perf_counter()
    call = (rollout_entry, spec, case)
    # The ranks' rollout and the serial ones (reference, members) are independent: a
    # RankPool's ranks run while this process computes the serial ones (see OVERLAP); a
    # runner that runs the function in this very process (torchrun, srun) goes after.
    ranks_run = Background(pool, call, spec.timeout) if _overlaps(pool) else None
    clock = _clock(pool, spec.timeout, ranks_run)
    t_serial = time.perf_counter()
    try:
        reference, high, ensemble, short = _serial(spec, case, members, clock)
    except RanOut as out:
        _ran_out(out, ranks_run)  # joins the ranks' run
    except BaseException:
        if ranks_run is not None:
            ranks_run.join()  # never leave the ranks running behind a verdict
        raise
    serial = time.perf_counter() - t_serial
    sticks = yardsticks(reference, ensemble)  # while the ranks still run
    if ranks_run is not None:
        ranks = ranks_run.result()
    else:
        ranks = pool.run(*call, timeout=spec.timeout)
    from harness._judges.autocast import RATIO

    record = judge_rollout(
        reference,
        ensemble,
        ranks,
        bound,
        spatial_size=spec.spatial_size,
        factor=factor,
        high=high,
        ratio=RATIO,
        sticks=sticks,
    )
    record.autocast = "" if spec.autocast is None else str(spec.autocast).replace("torch.", "")
    if short:
        record.not_calibrated.append(short)
    from harness._records.samples import RolloutSamples

    record.samples = RolloutSamples.of(reference)  # a few steps, strided: the rest is freed
    record.seconds = time.perf_counter() - t0
    record.serial_seconds = serial
    return record


Steps = list[dict[str, FieldRecord]]


def _clock(pool: Runner, timeout: float | None, ranks_run: Background | None) -> Deadline:
    """The serial rollouts' clock: the ranks' timeout (``timeout``, else the pool's), and
    stopped at once when the ranks' run beside them failed."""
    limit = timeout if timeout is not None else getattr(pool, "timeout", None)
    return Deadline.after(limit, stop=None if ranks_run is None else ranks_run.failed)


class SerialRanOut(Exception):
    """The serial reference's rollout (or, under autocast, its run without it) stopped at
    the check's timeout; ``ranks``: the ranks' run's failure beside it, if it failed too."""

    def __init__(self, cause: RanOut, ranks: RankFailure | None) -> None:
        super().__init__(str(cause))
        self.cause, self.ranks = cause, ranks


def _ran_out(out: RanOut, ranks_run: Background | None) -> NoReturn:
    """Raise what a serial rollout stopped by its clock leaves: the ranks' failure where
    they failed first (the serial part was abandoned for it), else ``SerialRanOut``."""
    failure = None
    if ranks_run is not None:
        try:
            ranks_run.result()
        except RankFailure as exc:
            failure = exc
    if out.abandoned and failure is not None:
        raise failure from None
    raise SerialRanOut(out, failure) from out


def _serial(
    spec: CheckSpec, case: SpatialCase, members: int, clock: Deadline | None = None
) -> tuple[Steps, Steps | None, list[Steps], str]:
    """The serial rollouts of ``spec``, with ``SERIAL_THREADS`` torch threads: the
    reference, under autocast also without it (the reduced precision's own rounding,
    measured), and the nudged members, each stopped by ``clock`` (``RanOut``). Members that
    run out of time leave the ensemble of those done and a line that says so (the last
    item)."""
    steps, seed, autocast = spec.rollout, spec.seed, spec.autocast
    with torch_threads(SERIAL_THREADS):
        reference = run_prediction(
            case, Topology.single(), steps, seed, autocast=autocast, deadline=clock
        )
        high = None
        if autocast is not None:
            high = run_prediction(case, Topology.single(), steps, seed, deadline=clock)
        ensemble: list[Steps] = []
        try:
            for j in range(members):
                ensemble.append(
                    run_prediction(
                        case,
                        Topology.single(),
                        steps,
                        seed,
                        member=j,
                        autocast=autocast,
                        deadline=clock,
                    )
                )
        except RanOut as stop:
            if stop.abandoned:
                raise
            judged = "their spread" if ensemble else "the check's field tolerance alone"
            return (
                reference,
                high,
                ensemble,
                (
                    f"the nudged reruns of the rollout {stop} ({len(ensemble)} of {members} "
                    f"done); judged by {judged}"
                ),
            )
        return reference, high, ensemble, ""


def _overlaps(pool: Runner) -> bool:
    """Whether ``pool``'s run can overlap the serial rollouts of this process."""
    return OVERLAP and in_other_processes(pool)


# ---------------------------------------------------------------------- plot


def plot_rollout(record: RolloutRecord, path: Any, *, title: str = "") -> Any:
    """The error curve of each field (the partitioned run's distance from the reference,
    the rounding spread and the bound, per step, log scale) as a PNG at ``path``; the first
    divergent step marked. Needs matplotlib (``harness.report.plots``)."""
    from harness.report.plots import new_figure, save_figure

    names = list(dict.fromkeys(p.name for p in record.curve))
    fig = new_figure(7.0, 2.4 * max(len(names), 1))
    axes = fig.subplots(max(len(names), 1), 1, squeeze=False)[:, 0]
    first = record.first
    for ax, name in zip(axes, names):
        points = record.field_curve(name)
        steps = [p.step for p in points]
        tiny = 1e-300  # log scale: an exact match drawn at the floor, not dropped
        ax.semilogy(steps, [max(p.error, tiny) for p in points], label="partitioned - reference")
        ax.semilogy(steps, [max(p.spread, tiny) for p in points], label="rounding spread")
        ax.semilogy(steps, [p.envelope for p in points], "--", label="bound")
        if first is not None and first.name == name:
            ax.axvline(first.step, color="red", lw=1)
            ax.annotate(f"first divergent step {first.step}", (first.step, first.error))
        ax.set_title(f"field '{name}'", fontsize=9)
        ax.set_xlabel("rollout step")
        ax.set_ylabel("max abs")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
