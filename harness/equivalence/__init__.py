"""``check_equivalence``: a case run once as the single-process reference and once on every
rank of a warm rank pool, then compared (loss, every gradient, every output field reassembled
from the shards, the parameters after each SGD step) into an ``EquivalenceReport``; where it
fails, located (``harness.equivalence._locating``).

The contract itself (``SpatialCase``, ``Outputs``, ``Shard``) and ``run_case`` live in
``harness.case``; they are re-exported here, where downstream code has always imported them.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harness._base.cpus import serial_threads, torch_threads
from harness._base.deprecation import forward
from harness._judges import compare_runs
from harness._judges.vacuous import check_vacuous
from harness._mutation.mode import current as mutant_mode
from harness._rank import run as rank_run
from harness._rank.deadline import Deadline, RanOut
from harness._records.observe import observed
from harness._records.run import RunRecord
from harness.case.declared import CheckSpec
from harness.compare import FAILURES, Mismatch, Quantity, Tolerance
from harness.equivalence._calibrate import calibrate, calibrates
from harness.equivalence._calibrate import note as calibration_note
from harness.errors import (
    ConfigError,
    ProblemKind,
    RankFailure,
    exception_summary,
    user_traceback,
)
from harness.pool.overlap import Background, in_other_processes
from harness.report import EquivalenceReport
from harness.report.hints import culprit_hint
from harness.topology import Topology

if TYPE_CHECKING:
    from collections.abc import Callable

    from harness.case import SpatialCase
    from harness.pool import Runner

__all__ = [
    "bounded_reference",
    "check_equivalence",
    "failure_mismatches",
    "run_check",
    "serial_run",
    "spec_of",
    "start_ranks",
]

# Importable from here for older code (with a DeprecationWarning): the contract lives in
# harness.case, a rank's run in harness._rank.run.
__getattr__ = forward(
    __name__,
    {
        **dict.fromkeys(
            ("KEYED_FORM", "Outputs", "Shard", "SpatialCase", "data_share", "load_init",
             "load_shards", "parameter_shards"),
            "harness.case",
        ),
        **dict.fromkeys(("Progress", "Watch", "run_case"), "harness._rank.run"),
    },
)  # fmt: skip

# ---------------------------------------------------------------------- check


@observed  # the plugin's summary hears of it (harness._records.observe)
def check_equivalence(
    case: SpatialCase,
    *,
    ranks: int,
    spatial_size: int | None = None,
    steps: int = 2,
    lr: float = 0.1,
    tolerance: Tolerance | None = None,
    timeout: float | None = None,
    seed: int = 0,
    pool: Runner | None = None,
    allow_nonfinite: bool | None = None,
    locate: bool | None = None,
    mesh: tuple[int, ...] | None = None,
    reference: RunRecord | None = None,
    rollout: int | None = None,
    autocast: torch.dtype | None = None,
    calibrate: bool | None = None,
) -> EquivalenceReport:
    """Run ``case`` as the reference and on ``ranks`` ranks; compare everything.

    Returns an ``EquivalenceReport``; a crash, an exception or a timeout on any rank is a
    mismatch of the report (``crash``, ``error``, ``timeout``), not an exception; so is a
    reference that raises. ``pool`` defaults to a warm pool shared by the process
    (``harness.pool.shared_registry()``). A NaN or inf anywhere is a ``nonfinite`` mismatch
    unless ``allow_nonfinite`` (default: the case's ``expect_nonfinite``).

    When the check fails (or always, with ``locate=True``; never with ``locate=False``) the
    first failing step is rerun with hooks on every module to find where the partitioned
    run first departs (``report.first_divergence``, ``harness.equivalence._locating``; where
    only the rollout failed, its first divergent step:
    ``harness.equivalence._locating_rollout``). A run that raised, crashed or hung is not
    rerun: its traceback says where. Locating is a diagnosis: if it fails, a ``Not located:``
    line says so and the verdict stands.

    ``mesh``: the spatial group's process grid handed to the case as ``Topology.mesh``
    (a tuple of ``case.mesh_dims`` sizes whose product is the spatial size); ``None``: the
    case chooses its own. ``harness.check_layouts`` runs every one, with one ``reference``
    (the reference's ``run_case`` record of this case, ``steps``, ``lr`` and ``seed``: it
    does not depend on the layout).

    ``rollout`` (default: the case's ``rollout_steps``): also roll the model out that many
    steps with ``predict`` and judge each step by its own rounding spread
    (``harness.rollout``). ``autocast`` (default: the case's): run the reference and the
    ranks under ``torch.autocast`` at that dtype, judged by the ratio rule
    (``harness._judges.autocast``).

    ``calibrate`` (default: on where the check runs below float64 with no ``tolerance`` of
    the call's or the case's, and no autocast): judge every entry of every loss, gradient,
    field and parameter by the model's own rounding, within ``FACTOR`` times the spread
    that nudged reruns of the reference reach there (run while the ranks run;
    ``harness.equivalence._calibrate``); ``False``: by the fixed tolerance of the dtype.
    """
    # long: spec, reference, ranks, judge, report: one call each; the docstring is the API
    spec = CheckSpec.of(
        case,
        ranks=ranks,
        spatial_size=spatial_size,
        mesh=mesh,
        steps=steps,
        lr=lr,
        seed=seed,
        rollout=rollout,
        autocast=autocast,
        tolerance=tolerance,
        timeout=timeout,
        allow_nonfinite=allow_nonfinite,
        locate=locate,
        calibrate=calibrate,
    )
    if pool is None:
        from harness.pool import shared_registry

        pool = shared_registry().get(ranks)
    return run_check(spec, case, pool, reference)


def run_check(
    spec: CheckSpec,
    case: SpatialCase,
    pool: Runner,
    reference: RunRecord | None = None,
    started: Background | None = None,
) -> EquivalenceReport:
    """``check_equivalence`` of a checked ``spec`` on ``pool``: with ``reference``, that
    reference's run (else it runs here); with ``started`` (``start_ranks``), the ranks' run
    already under way (a sweep starts the next layout of each world size while this
    process judges another: ``harness.layouts``)."""
    # long: reference, ranks, judge, report: one call each
    t0 = time.perf_counter() if started is None else started.began
    ranks = spec.ranks
    if pool.world_size != ranks:
        if started is not None:
            started.join()
        raise ConfigError(f"pool has {pool.world_size} ranks but ranks={ranks} was asked for")

    report = EquivalenceReport(
        case=case.label,
        ranks=ranks,
        spatial_size=spec.spatial_size,
        partition="",
        steps=spec.steps,
        dtype="",  # the reference's, once it ran
        tolerance=None,
        latitudes=None if case.latitudes is None else [float(v) for v in case.latitudes],
    )
    limit = serial_limit(spec.timeout, pool)
    loads = case.load_reference_shards or case.load_reference_init
    if reference is None:
        if started is None and not loads:  # the ranks' run needs nothing of the reference
            started = _early(spec, case, pool)
        try:
            reference = _reference_beside(spec, case, limit, started)
        except Exception as exc:  # noqa: BLE001 - the reference's failure is the check's verdict
            return _reference_failed(report, case, exc, spec.tolerance, t0)
    try:
        dtype = reference.steps[0].loss.dtype
        tol = spec.tolerance or case.tolerance or Tolerance.for_dtype(dtype)
        report.dtype, report.tolerance = str(dtype).replace("torch.", ""), tol
        report.reference = reference.flat()
        # the reference ran first: its initial values can travel to ranks that load them
        run = _Run(spec, case, pool, reference.init if loads else None, limit)
        given = spec.tolerance is not None or case.tolerance is not None
        amp = spec.autocast
        calibrated = calibrates(dtype, asked=spec.calibrate, tolerance_given=given, autocast=amp)
        _train(run, report, reference, tol, calibrated, started)
    finally:  # whatever raised before _train took the ranks' run: none of it outlives the check
        if started is not None:
            started.join()
    if spec.rollout:
        _roll_out(run, report, tol)
    report.seconds = time.perf_counter() - t0
    # locating reruns a training step without autocast: it would see nothing of bf16's
    if _should_locate(spec.locate if amp is None else bool(spec.locate), report):
        _locate_first(run, report)
    return report


@dataclass(frozen=True)
class _Run:
    """What every phase of one check runs with: the ``spec`` that crosses to the ranks
    whole, and what only this process holds."""

    spec: CheckSpec
    case: SpatialCase
    pool: Runner
    #: the reference's initial values, for a case that loads them (else ``None``)
    init: dict[str, torch.Tensor] | None
    #: the serial runs' clock: ``timeout``, else the pool's (``serial_limit``)
    limit: float | None = None


def serial_limit(timeout: float | None, pool: Runner) -> float | None:
    """How long each serial part of a check (the reference, its nudged reruns, the serial
    rollouts) may run: the check's ``timeout``, else its pool's, as the ranks' run beside it."""
    return timeout if timeout is not None else getattr(pool, "timeout", None)


def bounded_reference(
    case: SpatialCase, steps: int, lr: float, seed: int, limit: float | None, beside: int = 0
) -> RunRecord:
    """The reference's training run, stopped (``RanOut``) past ``limit`` seconds, with the
    torch threads the ``beside`` ranks running meanwhile leave (``serial_threads``)."""
    clock = Deadline.after(limit)
    with torch_threads(serial_threads(beside)):
        return rank_run.run_case(case, Topology.single(), steps, lr, seed, progress=clock.progress)


def _early(spec: CheckSpec, case: SpatialCase, pool: Runner) -> Background | None:
    """The ranks' training run started now, in other processes, so that the reference runs
    in this one while they do: only where the ranks' call needs nothing of the reference
    (the caller checks the case loads none of its values) and no serial run under autocast
    goes first (``_train``); else ``None``, and the ranks run after the reference."""
    return _ranks_ahead(spec, case, pool, None)


def _ranks_ahead(
    spec: CheckSpec,
    case: SpatialCase,
    pool: Runner,
    init: dict[str, torch.Tensor] | None,
    done: Callable[[Background], None] | None = None,
) -> Background | None:
    """The ranks' training call (``init``: the reference's initial values, for a case that
    loads them) started now in a thread, or ``None`` where it cannot run beside this
    process: under autocast (its serial run goes first), or on a runner whose ranks run in
    this very process."""
    if spec.autocast is not None or not in_other_processes(pool):
        return None
    return Background(pool, (rank_run.rank_entry, spec, case, init), spec.timeout, done=done)


def spec_of(case: SpatialCase, **given: object) -> CheckSpec:
    """``CheckSpec.of`` of ``check_equivalence(case, **given)``: its own defaults for what
    ``given`` leaves out (read off its signature: one place says them)."""
    return CheckSpec.of(case, **{**_DEFAULTS, **given})


#: ``check_equivalence``'s defaults, what ``spec_of`` fills in
_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(check_equivalence).parameters.items()
    if p.default is not inspect.Parameter.empty and name not in ("pool", "reference")
}


def start_ranks(
    spec: CheckSpec,
    case: SpatialCase,
    pool: Runner,
    reference: RunRecord,
    done: Callable[[Background], None] | None = None,
) -> Background | None:
    """The ranks' training run of ``spec``, started now in a thread (``Background``), for
    ``run_check(..., reference, started=...)`` to judge once it ends: ``None`` where it
    cannot be started ahead (under autocast the serial run goes first; a runner whose ranks
    run in this very process). Carries the reference's initial values where the case loads
    them, as the check's own call does; ``done`` is told as the run ends."""
    loads = case.load_reference_shards or case.load_reference_init
    return _ranks_ahead(spec, case, pool, reference.init if loads else None, done)


def _reference_beside(
    spec: CheckSpec, case: SpatialCase, limit: float | None, started: Background | None
) -> RunRecord:
    """``bounded_reference`` while the ``started`` ranks run: should it raise (or run out),
    the ranks' run is joined first, so no thread or rank work outlives the verdict and the
    pool is idle for the next check (its own timeout bounds the wait; what it found is not
    judged: there is no reference to judge it by)."""
    try:
        beside = 0 if started is None else spec.ranks
        return bounded_reference(case, spec.steps, spec.lr, spec.seed, limit, beside)
    except BaseException:
        if started is not None:
            started.join()
        raise


def serial_run(spec: CheckSpec, case: SpatialCase) -> tuple[RunRecord, Tolerance]:
    """The serial run under ``spec.autocast`` (what the ranks' layout is checked against:
    the ranks' entry runs under the same ``spec``) and the tolerance for that check
    (unbounded: with it a loss, gradient, field or parameter mismatches only on its shape,
    dtype or a NaN; values are the ratio rule's)."""
    from harness._rank.dtypes import autocast_context

    with autocast_context(spec.autocast):
        serial = rank_run.run_case(case, Topology.single(), spec.steps, spec.lr, spec.seed)
    return serial, Tolerance.uniform(math.inf, math.inf)


def _train(
    run: _Run,
    report: EquivalenceReport,
    reference: RunRecord,
    tol: Tolerance,
    calibrated: bool = False,
    started: Background | None = None,
) -> None:
    """The training steps on every rank, compared into ``report`` (under autocast: with
    the serial run under it, by the ratio rule; ``calibrated``: each entry by its rounding
    spread, the nudged reruns run while the ranks do). ``started``: the ranks' run, already
    under way beside the reference (``_early``; never under autocast)."""
    # long: the ranks' run beside the reruns, its failure, then one judgement, each once
    case, ranks, spec = run.case, report.ranks, run.spec
    s, amp = spec.spatial_size, spec.autocast
    judged, judge_tol = reference, tol
    if amp is not None:  # the ranks under autocast, judged against the serial run under it
        try:
            judged, judge_tol = serial_run(spec, case)
        except Exception as exc:  # noqa: BLE001 - the serial run under autocast raised
            phase = f"autocast {getattr(exc, 'harness_phase', None) or ''}".strip()
            report.mismatches = [_reference_error(case.label, exc, phase, None)]
            report.partition = _layout(case.describe(None), s, ranks // s)
            return
    call = (rank_run.rank_entry, spec, case, run.init)  # what crosses to every rank: one spec
    measured = None
    try:
        ranks_run = started
        if ranks_run is None and calibrated:  # beside the nudged reruns, where it can
            ranks_run = _ranks_ahead(spec, case, run.pool, run.init)
        if ranks_run is not None:
            try:
                if calibrated:
                    # the reruns stop at the check's timeout, and at once when the ranks failed
                    clock = Deadline.after(run.limit, stop=ranks_run.failed)
                    measured = calibrate(spec, case, reference, deadline=clock)
            finally:
                records = ranks_run.result()  # joined whatever happened: no thread outlives
        else:
            records = run.pool.run(*call, timeout=spec.timeout)
            if calibrated:
                clock = Deadline.after(run.limit)
                measured = calibrate(spec, case, reference, deadline=clock)
    except RankFailure as failure:
        report.mismatches = failure_mismatches(failure, case.label)
        report.likely = culprit_hint(failure)
        report.partition = _layout(case.describe(None), s, ranks // s)
        return
    report.partition = _layout(records[0].describe, s, ranks // s)
    report.notes += _loaded_note(records, case.load_reference_init)
    spreads = None if measured is None else measured.spreads
    if measured is not None and spreads is None:
        report.diagnoses.append(f"Not calibrated: {measured.problem}; judged by the tolerance")
    elif spreads is not None:
        report.notes.append(calibration_note(spreads, report.dtype))
    found = compare_runs(
        judged,
        records,
        judge_tol,
        spatial_size=s,
        allow_nonfinite=spec.allow_nonfinite,
        spreads=spreads,
    )
    report.mismatches, report.stats = found.mismatches, found.stats
    if not case.vacuous_ok:
        report.mismatches[:0] = check_vacuous(case.label, judged, records, s)
    report.field_errors, report.likely = found.field_errors, found.likely
    report.diagnoses += found.diagnoses
    if amp is not None:
        from harness._judges.autocast import ratio_rule

        ratio_rule(case, report, reference, judged, records, amp)


def _roll_out(run: _Run, report: EquivalenceReport, tol: Tolerance) -> None:
    """The inference rollout, judged step by step into ``report`` (not after a training
    run that raised, crashed or hung: its traceback says more)."""
    from harness.rollout import SerialRanOut, roll_out

    n_rollout = run.spec.rollout
    report.rollout_steps = n_rollout
    if report.quantities & set(FAILURES):
        report.notes.append(f"rollout of {n_rollout} steps not run: the training run failed")
        return
    try:
        report.rollout = roll_out(run.spec, run.case, run.pool, tol.field)
    except RankFailure as failure:
        report.mismatches += _rollout_failure(failure, run.case.label, n_rollout)
        report.likely = report.likely or culprit_hint(failure)
    except SerialRanOut as out:  # the serial reference's rollout, and the ranks' if they did
        phase = getattr(out.cause, "harness_phase", None) or "rollout"
        report.mismatches.append(_reference_error(run.case.label, out.cause, phase, None))
        if out.ranks is not None:
            report.mismatches += _rollout_failure(out.ranks, run.case.label, n_rollout)
    except Exception as exc:  # noqa: BLE001 - the reference's rollout raised: a verdict
        phase = getattr(exc, "harness_phase", None) or "rollout"
        report.mismatches.append(_reference_error(run.case.label, exc, phase, None))
    else:
        report.mismatches += report.rollout.mismatches


def _rollout_failure(failure: RankFailure, label: str, steps: int) -> list[Mismatch]:
    """A rollout's failed run, as ``failure_mismatches``; a rank that returned (the
    culprit of a hang) said to be in the rollout, not "after build"."""
    found = failure_mismatches(failure, label)
    for m in found:
        m.phase = m.phase or f"rollout of {steps} steps"
    return found


def _locate_first(run: _Run, report: EquivalenceReport) -> None:
    """Locate the first failing training step or, where only the rollout failed, the
    rollout's first divergent step; should locating raise, a ``Not located:`` line."""
    rolled = report.rollout.mismatches if report.rollout is not None else []
    trained = [m for m in report.mismatches if not any(m is r for r in rolled)]
    divergent = report.rollout.first if report.rollout is not None else None
    rollout_only = divergent is not None and not trained  # its divergent step is rerun
    step = min((m.step for m in trained if m.step is not None), default=0)
    if divergent is not None and rollout_only:
        step = divergent.step
    where = f"rollout step {step}" if rollout_only else f"step {step}"
    try:
        if rollout_only:
            _locate_rollout(run, report, step)
        else:
            _locate(run, report, step)
    except Exception as exc:  # noqa: BLE001 - a diagnosis never takes the verdict down
        report.location = None
        report.first_divergence = None
        report.diagnoses.append(
            f"Not located: the first divergence at {where} ({exception_summary(exc)})"
        )


def _locate_rollout(run: _Run, report: EquivalenceReport, step: int) -> None:
    """Locate the first divergence inside rollout step ``step`` into ``report``
    (``harness.equivalence._locating_rollout``)."""
    from harness.equivalence._locating_rollout import locate_rollout

    report.location = locate_rollout(run.spec, run.case, run.pool, step=step)
    report.first_divergence = report.location.first
    report.location.lines()  # rendered now: a line it cannot write is said here, not in str()


def _locate(run: _Run, report: EquivalenceReport, step: int) -> None:
    """Locate the first divergence of training step ``step`` into ``report``
    (``harness.equivalence._locating``)."""
    from harness.equivalence._locating import locate as locate_run

    report.location = locate_run(run.spec, run.case, run.pool, step=step, reference_init=run.init)
    report.first_divergence = report.location.first
    report.location.lines()  # rendered now: a line it cannot write is said here, not in str()


def _reference_failed(
    report: EquivalenceReport,
    case: SpatialCase,
    exc: Exception,
    tolerance: Tolerance | None,
    t0: float,
) -> EquivalenceReport:
    """``report`` of a check whose reference raised: one ``error`` of the reference, with
    its phase and traceback; the ranks are not run (there is nothing to compare them with)."""
    dtype = case.dtype or torch.get_default_dtype()
    phase = getattr(exc, "harness_phase", None) or ""
    step = next((int(w) for w in phase.split()[1:2] if w.isdigit()), None)
    s = report.spatial_size
    report.partition = _layout(case.describe(None), s, report.ranks // s)
    report.dtype = str(dtype).replace("torch.", "")
    report.tolerance = tolerance or case.tolerance or Tolerance.for_dtype(dtype)
    report.mismatches = [_reference_error(case.label, exc, phase, step)]
    report.seconds = time.perf_counter() - t0
    return report


def _reference_error(label: str, exc: Exception, phase: str, step: int | None) -> Mismatch:
    """The reference raised: one ``error`` of the reference, with its phase and traceback
    (stopped by the check's clock, ``RanOut``: a ``timeout`` of the serial reference)."""
    if isinstance(exc, RanOut):
        return Mismatch(
            Quantity.TIMEOUT,
            label,
            step,
            None,
            where=f"the serial reference (this process) {exc}, in {phase or 'its run'}",
            detail="the reference runs in the calling process under the same timeout as "
            "the ranks: raise timeout= if the run is merely slow",
            run="reference",
            phase=phase,
        )
    return Mismatch(
        Quantity.ERROR,
        label,
        step,
        None,
        where=exception_summary(exc),
        detail=user_traceback(exc),
        run="reference",
        phase=phase,
    )


def _loaded_note(records: list[RunRecord], every: bool = False) -> list[str]:
    """The report's line for parameters that started from the reference's values
    (``every``: the case's ``load_reference_init``, else its ``load_reference_shards``)."""
    loaded = sorted({n for r in records for n in r.loaded_shards})
    if not loaded:
        return []
    names = ", ".join(loaded[:4]) + (f" and {len(loaded) - 4} more" if len(loaded) > 4 else "")
    if every:
        sharded = sorted({n for r in records for n in r.param_shards})
        of = f", {len(sharded)} of them sharded" if sharded else ""
        return [
            f"reference initial values loaded: the reference's initial values were copied "
            f"into every parameter ({len(loaded)}{of}: {names}) before the first step "
            "(load_reference_init), so initial values are not checked"
        ]
    return [
        f"reference shards loaded: the reference's initial values were copied into the "
        f"shards of {len(loaded)} parameter(s) ({names}) before the first step "
        "(load_reference_shards), so their initial values are not checked"
    ]


def _should_locate(locate: bool | None, report: EquivalenceReport) -> bool:
    """Locate on request, or by default when a check failed in its numbers (a training
    step's or a rollout step's); never on a run that raised or hung, nor in a mutant's rerun
    (``MutantMode.verdict_only``: the one place that says so, whoever asked for locating)."""
    if locate is False or report.quantities & set(FAILURES) or mutant_mode().verdict_only:
        return False
    return locate is True or bool(report.mismatches)


_culprit = culprit_hint  # its older, private name


def failure_mismatches(failure: RankFailure, label: str) -> list[Mismatch]:
    """One mismatch per rank of a failed run (healthy ranks stopped after it left out)."""
    hangs = (Quantity.DEADLOCK, Quantity.TIMEOUT)
    kinds = [ProblemKind(p.kind) for p in failure.problems]
    hang = next((k.quantity for k in kinds if k.quantity in hangs), None)
    out = []
    for p, kind in zip(failure.problems, kinds):
        if kind is ProblemKind.STOPPED:
            continue
        # a rank that returned is the culprit of its run's hang: a row of the hang's quantity
        quantity = hang if kind is ProblemKind.RETURNED else kind.quantity
        if quantity is None:  # a rank that returned in a run that did not hang: context
            continue
        detail = p.detail + (
            f"\n--- rank {p.rank} output ---\n{p.output}" if p.output.strip() else ""
        )
        out.append(
            Mismatch(
                quantity,
                label,
                p.step,
                p.rank,
                where=p.summary,
                detail=detail,
                phase=p.phase if kind is not ProblemKind.RETURNED else "",
            )
        )
    return out


def flatten_record(record: RunRecord) -> dict[str, torch.Tensor]:
    """Deprecated: ``record.flat()``, which this only calls (kept for old imports)."""
    import warnings

    warnings.warn(
        "harness.equivalence.flatten_record is deprecated; use RunRecord.flat()",
        DeprecationWarning,
        stacklevel=2,
    )
    return record.flat()


def _layout(describe: str, spatial: int, data: int) -> str:
    """``"nside 2, ... · spatial 2 x data 2"``: the partition and, if any, the data groups."""
    groups = f"spatial {spatial} x data {data}" if data > 1 else ""
    return " · ".join(p for p in (describe, groups) if p) or f"spatial {spatial}"
