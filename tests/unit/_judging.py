"""Hand-made records and the judge the check tests share (test_judge_*.py, test_keyed.py,
test_param_shards.py): a step, a run, a field or shard of float64 values, and ``recs`` /
``same``, which pin every field of a finding."""

from __future__ import annotations

import dataclasses
import math

import torch

from harness._judges import (
    Judge,
    Layout,
)
from harness._records.run import FieldRecord, RunRecord, StepRecord
from harness.compare import NUMERIC, Mismatch, QuantityStats, Tolerance

F64 = torch.float64


TOL = Tolerance.for_dtype(F64)


NAN = math.nan


def step(loss=1.0, grad=None, params=None, fields=None, mutated=()):
    return StepRecord(
        loss=torch.tensor(loss, dtype=F64),
        grads={"w": torch.tensor([1.0, 2.0], dtype=F64) if grad is None else grad},
        fields=fields or {},
        params={"w": torch.tensor([0.5, 0.25], dtype=F64)} if params is None else params,
        mutated_buffers=list(mutated),
    )


def run(*steps, spatial_rank=0, spatial_size=1, init=None):
    return RunRecord(
        init={"w": torch.tensor([0.0, 1.0], dtype=F64)} if init is None else init,
        steps=list(steps) or [step()],
        spatial_rank=spatial_rank,
        spatial_size=spatial_size,
    )


def judge(ranks=2, spatial=2):
    return Judge(TOL, Layout(ranks, spatial), {q: QuantityStats() for q in NUMERIC})


def field(values, index=None, dim=-1, grid=None):
    return FieldRecord(
        torch.as_tensor(values, dtype=F64),
        None if index is None else torch.as_tensor(index, dtype=torch.long),
        dim,
        grid,
    )


def quantities(found):
    return [(m.quantity, m.rank) for m in found]


def rec(m):
    """A Mismatch's fields that differ from their defaults (quantity, name, step and rank
    always), NaN as None: comparing whole records pins every field, defaults included."""
    defaults = Mismatch("grad", "", None, None)
    out = {}
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        v = None if isinstance(v, float) and math.isnan(v) else v
        d = getattr(defaults, f.name)
        d = None if isinstance(d, float) and math.isnan(d) else d
        if f.name in ("quantity", "name", "step", "rank") or v != d:
            out[f.name] = v
    return out


def recs(found):
    return [rec(m) for m in found]


def same(found, *expected):
    """The findings are exactly these, every field of every one (the report prints them);
    the same comparison as ``recs``, with the expected findings written as Mismatches."""
    assert recs(found) == recs(expected)


def shard(values, index, dim=-1, grid=None, unit="position", dtype=F64):
    index = torch.tensor(index, dtype=torch.long)
    return FieldRecord(torch.tensor(values, dtype=dtype), index, dim, grid, unit)


def _w(*values):
    return torch.tensor(values, dtype=F64)
