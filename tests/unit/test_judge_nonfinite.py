"""Non-finite values (harness/_judges/values.py) on hand-made records: in the reference or
on a rank, after build or in a step, each named by kind, name, step, rank and position."""

from __future__ import annotations

import math

import torch

from harness._judges import (
    check_nonfinite_init,
    check_nonfinite_step,
    compare_runs,
)
from harness._records.run import FieldRecord
from harness.compare import Mismatch
from tests.unit._judging import (
    F64,
    NAN,
    TOL,
    _w,
    field,
    quantities,
    recs,
    run,
    same,
    shard,
    step,
)


def test_a_nan_loss_fails_even_on_one_rank_where_both_runs_agree():
    bad = run(step(loss=NAN))
    out = compare_runs(bad, [run(step(loss=NAN))], TOL, spatial_size=1)
    found = [(m.quantity, m.run, m.rank, m.of, m.step) for m in out.mismatches]
    assert found == [("nonfinite", "reference", None, "loss", 0), ("nonfinite", "", 0, "loss", 0)]
    assert out.mismatches[0].where == "(1 NaN)"


def test_a_nonfinite_reference_is_named_as_the_reference():
    grad = torch.tensor([1.0, math.inf], dtype=F64)
    out = compare_runs(run(step(grad=grad)), [run(), run(spatial_rank=1)], TOL, spatial_size=2)
    nonfinite = [m for m in out.mismatches if m.quantity == "nonfinite"]
    assert len(nonfinite) == 1
    m = nonfinite[0]
    assert (m.run, m.of, m.name, m.step, m.rank, m.where, m.count, m.total) == (
        "reference",
        "grad",
        "w",
        0,
        None,
        "(1,) (1 inf)",
        1,
        2,
    )
    # the ranks' finite gradient against the reference's inf is a grad difference too
    assert ("grad", 0) in quantities(out.mismatches)


def test_a_nonfinite_value_on_a_rank_names_the_rank_and_global_position():
    values = torch.tensor([[1.0, NAN]], dtype=F64)
    shard = FieldRecord(values, torch.tensor([3, 2]), -1, (2, 2))
    ok = FieldRecord(torch.tensor([[1.0, 1.0]], dtype=F64), torch.tensor([0, 1]), -1, (2, 2))
    ref = run(step(fields={"y": field([[1.0, 1.0, 1.0, 1.0]])}))
    ranks = [run(step(fields={"y": ok})), run(step(fields={"y": shard}), spatial_rank=1)]
    out = compare_runs(ref, ranks, TOL, spatial_size=2)
    nonfinite = [m for m in out.mismatches if m.quantity == "nonfinite"]
    assert [(m.rank, m.of, m.where) for m in nonfinite] == [
        (1, "field", "[0] (lat 1, lon 0) (1 NaN)")
    ]


def test_nonfinite_values_in_the_initial_parameters_are_findings():
    init = {"w": torch.tensor([NAN, 1.0], dtype=F64)}
    out = compare_runs(run(init=init), [run(init=init)], TOL, spatial_size=1)
    assert [(m.quantity, m.run, m.step, m.of) for m in out.mismatches] == [
        ("nonfinite", "reference", None, "param"),
        ("nonfinite", "", None, "param"),
    ]


# ---------------------------------------------------------------- whole records


def test_nonfinite_records_name_run_quantity_and_global_position():
    ref = step(loss=NAN, fields={"y": field([[1.0, math.inf]])})
    rank0 = step(
        grad=_w(NAN, 1.0),
        params={"w": _w(1.0, -math.inf)},
        fields={"y": field([[1.0, NAN, 2.0]], [4, 2, 0], grid=(2, 3)), "s": field(NAN)},
    )
    assert recs(check_nonfinite_step(5, ref, [rank0])) == [
        {
            "quantity": "nonfinite",
            "name": "loss",
            "step": 5,
            "rank": None,
            "where": "(1 NaN)",
            "count": 1,
            "total": 1,
            "run": "reference",
            "of": "loss",
        },
        {
            "quantity": "nonfinite",
            "name": "y",
            "step": 5,
            "rank": None,
            "where": "(0, 1) (1 inf)",
            "count": 1,
            "total": 2,
            "run": "reference",
            "of": "field",
        },
        {
            "quantity": "nonfinite",
            "name": "w",
            "step": 5,
            "rank": 0,
            "where": "(0,) (1 NaN)",
            "count": 1,
            "total": 2,
            "of": "grad",
        },
        {
            "quantity": "nonfinite",
            "name": "y",
            "step": 5,
            "rank": 0,
            "where": "[0] (lat 0, lon 2) (1 NaN)",
            "count": 1,
            "total": 3,
            "of": "field",
        },
        {
            "quantity": "nonfinite",
            "name": "s",
            "step": 5,
            "rank": 0,
            "where": "(1 NaN)",
            "count": 1,
            "total": 1,
            "of": "field",
        },
        {
            "quantity": "nonfinite",
            "name": "w",
            "step": 5,
            "rank": 0,
            "where": "(1,) (1 inf)",
            "count": 1,
            "total": 2,
            "of": "param",
        },
    ]
    init = check_nonfinite_init(run(init={"w": _w(NAN)}), [run(init={"v": _w(1.0, math.inf)})])
    assert recs(init) == [
        {
            "quantity": "nonfinite",
            "name": "w",
            "step": None,
            "rank": None,
            "where": "(0,) (1 NaN)",
            "count": 1,
            "total": 1,
            "run": "reference",
            "of": "param",
        },
        {
            "quantity": "nonfinite",
            "name": "v",
            "step": None,
            "rank": 0,
            "where": "(1,) (1 inf)",
            "count": 1,
            "total": 2,
            "of": "param",
        },
    ]


def test_a_nonfinite_value_in_a_shard_given_by_a_slice_names_its_global_position():
    for index, where in [
        (slice(2, 4), "[0] position 3 (1 NaN)"),
        (slice(1, 5, 2), "[0] position 3 (1 NaN)"),
        (slice(None, 2), "[0] position 1 (1 NaN)"),
        (slice(-2, None), "[0] local position 1 (1 NaN)"),  # needs the size: said as local
    ]:
        shard = FieldRecord(torch.tensor([[1.0, NAN]], dtype=F64), index, -1, None)
        (m,) = check_nonfinite_step(0, step(), [step(fields={"y": shard})])
        assert m.where == where


def test_nonfinite_values_of_every_kind_are_named_by_kind_name_step_rank_and_position():
    cube = torch.zeros(2, 2, 2, dtype=F64)
    cube[1, 0, 1] = NAN
    bad = step(
        loss=NAN,
        grad=torch.tensor([1.0, math.inf], dtype=F64),
        params={"w": torch.tensor([NAN, 0.0], dtype=F64)},
        fields={
            "cells": shard([1.0, NAN, 2.0], [4, 5, 6], unit="cell"),
            "cube": FieldRecord(cube, torch.tensor([3, 1]), 1),
            "full": field([[1.0, math.inf]]),
        },
    )
    table = [
        ("loss", "(1 NaN)", 1, "loss"),
        ("w", "(1,) (1 inf)", 2, "grad"),
        ("cells", "cell 5 (1 NaN)", 3, "field"),
        ("cube", "[1, 1] position 3 (1 NaN)", 8, "field"),
        ("full", "(0, 1) (1 inf)", 2, "field"),
        ("w", "(0,) (1 NaN)", 2, "param"),
    ]
    same(
        check_nonfinite_step(1, step(), [step(), bad]),
        *[
            Mismatch("nonfinite", n, 1, 1, where=w, count=1, total=t, of=of)
            for n, w, t, of in table
        ],
    )
    same(
        check_nonfinite_step(2, bad, [step()]),
        *[
            Mismatch("nonfinite", n, 2, None, where=w, count=1, total=t, run="reference", of=of)
            for n, w, t, of in table
        ],
    )


def test_nonfinite_initial_parameters_are_named():
    init = {"w": torch.tensor([1.0, NAN], dtype=F64)}
    same(
        check_nonfinite_init(run(), [run(), run(init=init)]),
        Mismatch("nonfinite", "w", None, 1, where="(1,) (1 NaN)", count=1, total=2, of="param"),
    )


def test_a_nonfinite_value_in_a_slice_shard_is_named_by_its_global_position():
    values = torch.tensor([[1.0, NAN]], dtype=F64)
    st = step(fields={"y": FieldRecord(values, slice(2, 4), -1, None, "cell")})
    same(
        check_nonfinite_step(0, step(), [st]),
        Mismatch("nonfinite", "y", 0, 0, where="[0] cell 3 (1 NaN)", count=1, total=2, of="field"),
    )
