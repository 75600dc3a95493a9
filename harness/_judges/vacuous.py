"""A check that proves nothing: nothing partitioned and nothing communicated.

ACE's own parallel test once passed while every rank ran the full domain. The harness
would have called that equivalent too: every rank's whole-field answer matches the
reference's. This rule fails such a check as ``vacuous``: with a spatial group of more than
one rank, either

- no rank issued any operation on a process group and every field is a whole tensor (no
  ``Shard``): each rank computed the whole problem alone; or
- every field is a ``Shard`` and every rank's shards cover the whole domain: the ranks
  split nothing.

A case that means it (a test of replicated code, say) opts out with the reason, as
``SpatialCase.vacuous_ok = "why"``. Pure: records in, mismatches out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harness._records.run import RunRecord
from harness.compare import Mismatch, Quantity

REMEDY = (
    "The check proves nothing about the parallel code: give each rank only its part of the "
    "domain (batch), return its part of each field as a Shard, and communicate what the "
    "model needs from the others; or, if this case is meant to be replicated, say why with "
    'vacuous_ok = "reason" on the case.'
)


def check_vacuous(
    label: str, reference: RunRecord, records: Sequence[RunRecord], spatial_size: int
) -> list[Mismatch]:
    """The ``vacuous`` finding of a run, or nothing (see the module docstring)."""
    if spatial_size < 2 or not records or not reference.steps:
        return []
    talked = [r.communicated for r in records]
    steps = [r.steps for r in records]
    fields = [f for st in steps for step in st for f in step.fields.values()]
    if all(n == 0 for n in talked) and not any(f.sharded for f in fields):
        why = (
            "no rank issued any torch.distributed operation and every field is a whole tensor "
            "(no Shard): each rank computed the whole problem alone"
        )
        return [Mismatch(Quantity.VACUOUS, label, None, None, where=why)]
    whole = _every_shard_covers_everything(reference, records)
    if whole:
        why = f"every rank's Shard of {whole} covers the whole domain: the ranks split nothing"
        return [Mismatch(Quantity.VACUOUS, label, None, None, where=why)]
    return []


def _every_shard_covers_everything(reference: RunRecord, records: Sequence[RunRecord]) -> str:
    """The names of the fields, when every field is sharded and every rank holds all of it."""
    names = sorted(reference.steps[0].fields)
    if not names:
        return ""
    for name in names:
        ref = reference.steps[0].fields[name].values
        for record in records:
            f = record.steps[0].fields.get(name)
            if f is None or not f.sharded:
                return ""
            if f.keys is not None:  # keyed items: all of them on this rank?
                n = ref.shape[0] if ref.dim() else 1
                if f.keys.shape[0] < n or len(np.unique(f.keys.numpy(), axis=0)) < n:
                    return ""
                continue
            dim = f.dim if f.dim is not None else -1
            values = ref.reshape(*ref.shape[:-2], -1) if f.grid is not None else ref
            size = values.shape[dim]
            if len(set(f.positions(size).tolist())) < size:
                return ""
    return ", ".join(repr(n) for n in names)
