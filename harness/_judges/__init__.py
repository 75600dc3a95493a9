"""How a partitioned run is judged against its reference: one function per quantity.

Each ``check_*`` function reads ``RunRecord``s (``harness._records.run``) and returns the
``Mismatch``es it found; ``compare_runs`` calls them in run order (parameters after build,
then per step: non-finite values, loss, gradients, fields with their coverage, parameters
with their co-rank sync, buffers). Nothing here runs on a rank or touches a process group,
so every rule can be tested on hand-made records.

By subject: ``judge`` (the layout, one pair of tensors judged, how positions are written),
``values`` (loss, gradients, parameters whole or sharded, buffers, non-finite values),
``fields`` (full and sharded fields), ``keyed`` (fields matched by key) and ``shards``
(sharded parameters' fit and coverage, and the part of the reference a shard is judged by).
Every name is importable from ``harness._judges`` itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from harness._base.values import plain
from harness._judges.fields import (
    BATCH_HINT,
    SHARD_HINT,
    assemble_field,
    check_fields,
)
from harness._judges.judge import (
    Judge,
    Layout,
    data_part,
    diagnose,
    index_text,
    position_text,
    two_values,
)
from harness._judges.keyed import (
    GLOBAL_SAMPLE_HINT,
    KEY_WIDTH_HINT,
    KEYED_HINT,
    check_keyed_field,
    key_text,
)
from harness._judges.shards import (
    PARAM_SHARD_HINT,
    SHARD_INIT_HINT,
    ParamShards,
    check_param_shards,
)
from harness._judges.spread import Spreads, allowance, entry_spread, spreads_of
from harness._judges.values import (
    SEED_HINT,
    check_buffers,
    check_grads,
    check_init,
    check_loss,
    check_nonfinite_init,
    check_nonfinite_step,
    check_params,
)
from harness._records.run import FieldError, RunRecord
from harness.compare import NUMERIC, Mismatch, QuantityStats, Tolerance
from harness.report.hints import float32_evidence, likely_cause

__all__ = [
    "BATCH_HINT",
    "GLOBAL_SAMPLE_HINT",
    "KEYED_HINT",
    "KEY_WIDTH_HINT",
    "PARAM_SHARD_HINT",
    "SEED_HINT",
    "SHARD_HINT",
    "SHARD_INIT_HINT",
    "Comparison",
    "Judge",
    "Layout",
    "ParamShards",
    "Spreads",
    "allowance",
    "assemble_field",
    "check_buffers",
    "check_fields",
    "check_grads",
    "check_init",
    "check_keyed_field",
    "check_loss",
    "check_nonfinite_init",
    "check_nonfinite_step",
    "check_param_shards",
    "check_params",
    "compare_runs",
    "data_part",
    "diagnose",
    "entry_spread",
    "index_text",
    "key_text",
    "plain_record",
    "position_text",
    "spreads_of",
    "two_values",
]


@dataclass
class Comparison:
    """What ``compare_runs`` found: the mismatches, the worst errors seen, the error maps."""

    mismatches: list[Mismatch] = field(default_factory=list)
    stats: dict[str, QuantityStats] = field(
        default_factory=lambda: {q: QuantityStats() for q in NUMERIC}
    )
    field_errors: list[FieldError] = field(default_factory=list)
    likely: str = ""  # the one line most likely to name the bug (hints.likely_cause)
    #: what a hint could not do (``Not located: ... (TypeError: ...)``): the finding stands
    diagnoses: list[str] = field(default_factory=list)


def plain_record(record: RunRecord) -> RunRecord:
    """``record`` with every tensor a plain one (``harness._base.values.plain``): the ranks
    record plain values already; a record made by hand or by an older rank may not."""

    def values(d: dict[str, Any]) -> dict[str, Any]:
        return {k: plain(v) if isinstance(v, torch.Tensor) else v for k, v in d.items()}

    steps = [
        dataclasses.replace(
            st,
            loss=plain(st.loss),
            grads=values(st.grads),
            params=values(st.params),
            fields={
                n: dataclasses.replace(f, values=plain(f.values)) for n, f in st.fields.items()
            },
        )
        for st in record.steps
    ]
    return dataclasses.replace(record, init=values(record.init), steps=steps)


def compare_runs(
    reference: RunRecord,
    records: list[RunRecord],
    tolerance: Tolerance,
    *,
    spatial_size: int | None = None,
    allow_nonfinite: bool = False,
    spreads: Spreads | None = None,
) -> Comparison:
    """Judge every rank's record against the reference's, quantity by quantity: values by
    ``tolerance``, or where ``spreads`` are given (a calibrated check), each entry within
    their factor of its rounding spread (``harness._judges.spread``)."""
    reference, records = plain_record(reference), [plain_record(r) for r in records]
    layout = Layout(len(records), spatial_size or records[0].spatial_size)
    out = Comparison()
    seen = diagnose(out.diagnoses, "the float32 evidence", "", float32_evidence, reference, records)
    judge = Judge(tolerance, layout, out.stats, seen, out.diagnoses, spreads)
    m = out.mismatches
    if not allow_nonfinite:
        m += check_nonfinite_init(reference, records)
    found_shards, shards = check_param_shards(reference, records, layout)
    m += found_shards
    m += check_init(reference, records, tolerance, shards)
    for step, ref_step in enumerate(reference.steps):
        steps = [r.steps[step] for r in records]
        if not allow_nonfinite:
            m += check_nonfinite_step(step, ref_step, steps)
        m += check_loss(judge, step, ref_step, steps)
        m += check_grads(judge, step, ref_step, steps, shards)
        found, errors = check_fields(judge, step, ref_step, steps)
        m += found
        out.field_errors += errors
        m += check_params(judge, step, ref_step, steps, shards)
        m += check_buffers(step, ref_step, steps)
    out.likely = diagnose(out.diagnoses, "the likely cause", "", likely_cause, out.mismatches)
    return out
