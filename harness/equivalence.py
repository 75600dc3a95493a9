"""``check_equivalence``: a case run once as the single-process reference and once on every
rank of a warm rank pool, then compared (loss, every gradient, every output field reassembled
from the shards, the parameters after each SGD step) into an ``EquivalenceReport``; where it
fails, located (``harness.locate``).

The contract itself (``SpatialCase``, ``Outputs``, ``Shard``) and ``run_case`` live in
``harness.case``; they are re-exported here, where downstream code has always imported them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from harness.case import (
    KEYED_FORM,
    Outputs,
    Progress,
    Shard,
    SpatialCase,
    Watch,
    _rank_entry,
    data_share,
    load_shards,
    parameter_shards,
    run_case,
)
from harness.checks import compare_runs
from harness.compare import FAILURES, Mismatch, Tolerance
from harness.errors import ConfigError, RankFailure
from harness.hints import culprit_hint
from harness.records import RunRecord
from harness.report import EquivalenceReport
from harness.topology import Topology, validate_sizes
from harness.vacuous import check_vacuous

if TYPE_CHECKING:
    from harness.pool import Runner

__all__ = [
    "KEYED_FORM",
    "Outputs",
    "Progress",
    "Shard",
    "SpatialCase",
    "Watch",
    "check_equivalence",
    "data_share",
    "failure_mismatches",
    "load_shards",
    "parameter_shards",
    "run_case",
]

# ---------------------------------------------------------------------- check


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
    rollout: int | None = None,
    autocast: torch.dtype | None = None,
) -> EquivalenceReport:
    """Run ``case`` as the reference and on ``ranks`` ranks; compare everything.

    Returns an ``EquivalenceReport``; a crash, an exception or a timeout on any rank is a
    mismatch of the report (``crash``, ``error``, ``timeout``), not an exception. ``pool``
    defaults to a warm pool shared by the process (``harness.pool.shared_registry()``).
    A NaN or inf anywhere is a ``nonfinite`` mismatch unless ``allow_nonfinite`` (default:
    the case's ``expect_nonfinite``).

    When the check fails (or always, with ``locate=True``; never with ``locate=False``) the
    first failing step is rerun with hooks on every module to find where the partitioned
    run first departs (``report.first_divergence``, ``harness.locate``). A run that raised,
    crashed or hung is not rerun: its traceback says where.
    """
    if not isinstance(case, SpatialCase):
        raise ConfigError(
            f"check_equivalence needs a harness.SpatialCase, got {type(case).__name__}; "
            "subclass SpatialCase and implement build, batch and forward"
        )
    s = validate_sizes(ranks, spatial_size)
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if case.vacuous_ok is not None and not (
        isinstance(case.vacuous_ok, str) and case.vacuous_ok.strip()
    ):
        raise ConfigError(
            f"{case.label}.vacuous_ok = {case.vacuous_ok!r}: give the reason as a sentence "
            '(vacuous_ok = "the model is replicated by design: ..."), or leave it None'
        )
    allow = case.expect_nonfinite if allow_nonfinite is None else allow_nonfinite
    from harness.rollout import _has_predict, check_rollout, rollout_steps

    n_rollout = rollout_steps(case, rollout)
    if n_rollout:
        _has_predict(case)
    amp = case.autocast if autocast is None else autocast
    if amp is not None:
        from harness.autocast import check_dtype

        amp = check_dtype(amp)
    t0 = time.perf_counter()
    if pool is None:
        from harness.pool import shared_registry

        pool = shared_registry().get(ranks)
    if pool.world_size != ranks:
        raise ConfigError(f"pool has {pool.world_size} ranks but ranks={ranks} was asked for")

    reference = run_case(case, Topology.single(), steps, lr, seed)
    dtype = reference.steps[0].loss.dtype
    tol = tolerance or case.tolerance or Tolerance.for_dtype(dtype)
    report = EquivalenceReport(
        case=case.label,
        ranks=ranks,
        spatial_size=s,
        partition="",
        steps=steps,
        dtype=str(dtype).replace("torch.", ""),
        tolerance=tol,
        reference=reference.flat(),
        latitudes=None if case.latitudes is None else [float(v) for v in case.latitudes],
    )
    # the reference ran first: its initial values can travel to ranks that load them
    init = reference.init if case.load_reference_shards else None
    judged, judge_tol, entry = reference, tol, (_rank_entry,)
    if amp is not None:  # the ranks under autocast, judged against the serial run under it
        from harness.autocast import serial_run

        judged, judge_tol, entry = serial_run(case, amp, steps, lr, seed)
    try:
        records = pool.run(*entry, case, spatial_size, steps, lr, seed, init, timeout=timeout)
    except RankFailure as failure:
        report.mismatches = failure_mismatches(failure, case.label)
        report.likely = culprit_hint(failure)
        report.partition = _layout(case.describe(None), s, ranks // s)
    else:
        report.partition = _layout(records[0].describe, s, ranks // s)
        report.notes += _loaded_note(records)
        found = compare_runs(judged, records, judge_tol, spatial_size=s, allow_nonfinite=allow)
        report.mismatches, report.stats = found.mismatches, found.stats
        if not case.vacuous_ok:
            report.mismatches[:0] = check_vacuous(case.label, judged, records, s)
        report.field_errors, report.likely = found.field_errors, found.likely
        if amp is not None:
            from harness.autocast import ratio_rule

            ratio_rule(case, report, reference, judged, records, amp)
    if n_rollout and not report.quantities & set(FAILURES):
        try:
            report.rollout = check_rollout(
                case,
                pool,
                spatial_size=s,
                steps=n_rollout,
                seed=seed,
                bound=tol.field,
                timeout=timeout,
                autocast=amp,
            )
        except RankFailure as failure:
            report.mismatches += failure_mismatches(failure, case.label)
            report.likely = report.likely or culprit_hint(failure)
        else:
            report.mismatches += report.rollout.mismatches
    elif n_rollout:
        report.notes.append(f"rollout of {n_rollout} steps not run: the training run failed")
    report.seconds = time.perf_counter() - t0
    # locating reruns a training step without autocast: it would see nothing of bf16's
    if _should_locate(locate if amp is None else bool(locate), report, pool):
        from harness.locate import locate as locate_run

        steps_failed = [
            m.step for m in report.mismatches if m.step is not None and m.quantity != "rollout"
        ]
        report.location = locate_run(
            case,
            pool,
            spatial_size=spatial_size,
            step=min(steps_failed, default=0),
            lr=lr,
            seed=seed,
            timeout=timeout,
            reference_init=init,
        )
        report.first_divergence = report.location.first
    return report


def _loaded_note(records: list[RunRecord]) -> list[str]:
    """The report's line for shards that started from the reference's values."""
    loaded = sorted({n for r in records for n in r.loaded_shards})
    if not loaded:
        return []
    names = ", ".join(loaded[:4]) + (f" and {len(loaded) - 4} more" if len(loaded) > 4 else "")
    return [
        f"reference shards loaded: the reference's initial values were copied into the "
        f"shards of {len(loaded)} parameter(s) ({names}) before the first step "
        "(load_reference_shards), so their initial values are not checked"
    ]


def _should_locate(locate: bool | None, report: EquivalenceReport, pool: Runner) -> bool:
    """Locate on request, or by default when a check failed in its numbers (not on a run
    that raised or hung, nor in a mutant's rerun, which only asks whether a check fails)."""
    if locate is False or report.quantities & set(FAILURES):
        return False
    if locate is None:  # a rollout's divergence is not a training step's: it is not rerun
        trained = any(m.quantity != "rollout" for m in report.mismatches)
        return trained and getattr(pool, "mutant", None) is None
    return True


_culprit = culprit_hint  # its older, private name


def failure_mismatches(failure: RankFailure, label: str) -> list[Mismatch]:
    """One mismatch per rank of a failed run (healthy ranks stopped after it left out)."""
    hang = next((str(p.kind) for p in failure.problems if p.kind in ("deadlock", "timeout")), "")
    out = []
    for p in failure.problems:
        if p.kind == "stopped":
            continue
        quantity = hang if p.kind == "returned" else str(p.kind)  # plain text: it travels
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
                phase=p.phase if p.kind != "returned" else "",
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
