"""checks.py on hand-made records: every rule of the comparison, without a rank in sight."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from harness import ConfigError, Positions, Shard, SpatialCase, Topology
from harness._judges import (
    BATCH_HINT,
    SHARD_HINT,
    Judge,
    Layout,
    check_buffers,
    check_fields,
    check_grads,
    check_init,
    check_loss,
    check_nonfinite_init,
    check_nonfinite_step,
    check_params,
    compare_runs,
    data_part,
    position_text,
    two_values,
)
from harness._judges.vacuous import check_vacuous
from harness._records.run import FieldRecord, RunRecord, StepRecord
from harness.case.declared import check_activation_shard, check_partition
from harness.compare import NUMERIC, Mismatch, Quantity, QuantityStats, Tolerance
from harness.report import EquivalenceReport

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


# ---------------------------------------------------------------- the whole comparison


def test_identical_runs_are_equivalent_and_their_errors_zero():
    out = compare_runs(run(), [run(), run(spatial_rank=1)], TOL, spatial_size=2)
    assert out.mismatches == []
    assert {q: s.max_rel for q, s in out.stats.items()} == dict.fromkeys(NUMERIC, 0.0)
    assert out.stats["grad"].compared == 2


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


def test_every_finding_names_its_quantity_and_the_report_row_that_travels_has_plain_text():
    # findings hold Quantity members; a report's summary row crosses to xdist's controller,
    # which carries built-in types only (execnet refuses a str subclass), so it is plain
    bad = run(step(loss=NAN, grad=torch.tensor([1.0, 3.0], dtype=F64)))
    out = compare_runs(run(), [run(), bad], TOL, spatial_size=2)
    assert {(m.quantity, m.of) for m in out.mismatches} >= {("nonfinite", "loss"), ("grad", "")}
    assert {(type(m.quantity), type(m.of)) for m in out.mismatches} == {(Quantity, str)}
    report = EquivalenceReport("c", 2, 2, "", 1, "float64", TOL, mismatches=out.mismatches)
    row = report.summary_row()
    assert row["problems"] == ["grad", "loss", "nonfinite"]
    assert {type(q) for q in row["problems"]} | {type(k) for k in row["worst"]} == {str}


def test_nonfinite_values_in_the_initial_parameters_are_findings():
    init = {"w": torch.tensor([NAN, 1.0], dtype=F64)}
    out = compare_runs(run(init=init), [run(init=init)], TOL, spatial_size=1)
    assert [(m.quantity, m.run, m.step, m.of) for m in out.mismatches] == [
        ("nonfinite", "reference", None, "param"),
        ("nonfinite", "", None, "param"),
    ]


def test_expected_nonfinite_values_pass_only_where_they_match():
    nan_loss = run(step(loss=NAN))
    assert (
        compare_runs(
            nan_loss, [run(step(loss=NAN))], TOL, spatial_size=1, allow_nonfinite=True
        ).mismatches
        == []
    )
    out = compare_runs(nan_loss, [run(step(loss=1.0))], TOL, spatial_size=1, allow_nonfinite=True)
    assert quantities(out.mismatches) == [("loss", 0)]
    assert out.mismatches[0].max_abs == math.inf


def test_initial_parameters_differ_with_a_hint_about_seeding():
    other = run(init={"w": torch.tensor([0.0, 1.5], dtype=F64)})
    out = compare_runs(run(), [run(), other], TOL, spatial_size=2)
    (m, *_rest) = out.mismatches
    assert (m.quantity, m.step, m.rank, m.name) == ("param", None, 1, "w")
    assert "seed the initialisation" in m.hint


def test_parameters_present_on_one_side_only_are_named():
    extra = run(init={"w": torch.zeros(2, dtype=F64), "b": torch.zeros(1, dtype=F64)})
    missing = run(init={})
    out = compare_runs(run(), [extra, missing], TOL, spatial_size=2)
    wheres = {(m.rank, m.name): m.where for m in out.mismatches if m.step is None}
    assert wheres[(0, "b")] == "parameter not in the reference model"
    assert wheres[(1, "w")] == "reference parameter missing on this rank"


# ---------------------------------------------------------------- loss


def test_a_loss_that_differs_says_both_values_with_enough_digits():
    out = compare_runs(run(step(loss=2.2874)), [run(step(loss=2.28740001))], TOL, spatial_size=1)
    (m,) = out.mismatches
    assert (m.quantity, m.rank) == ("loss", 0)
    assert m.where == "2.28740001 vs reference 2.2874"


def test_ranks_of_one_group_must_hold_the_same_loss():
    ranks = [run(step(loss=1.0)), run(step(loss=1.5), spatial_rank=1)]
    names = [(m.name, m.rank) for m in compare_runs(run(), ranks, TOL, spatial_size=2).mismatches]
    assert ("loss (vs spatial rank 0)", 1) in names


def test_with_data_groups_the_mean_of_their_losses_is_compared():
    ranks = [run(step(loss=0.5)), run(step(loss=1.5))]  # two data groups of one rank
    out = compare_runs(run(step(loss=1.0)), ranks, TOL, spatial_size=1)
    assert [m for m in out.mismatches if m.quantity == "loss"] == []
    ranks[1].steps[0].loss = torch.tensor(1.25, dtype=F64)
    out = compare_runs(run(step(loss=1.0)), ranks, TOL, spatial_size=1)
    assert [(m.quantity, m.name, m.rank) for m in out.mismatches] == [
        ("loss", "loss (mean over data groups)", None)
    ]


def test_two_values_adds_digits_until_they_differ():
    a = torch.tensor(1.0000000001, dtype=F64)
    assert two_values(a, torch.tensor(1.0, dtype=F64)) == "1.0000000001 vs reference 1"
    assert two_values(torch.tensor(3.0), torch.tensor(2.0)) == "3 vs reference 2"


# ---------------------------------------------------------------- gradients


def test_a_missing_gradient_on_a_rank_is_named_with_a_hint():
    ranks = [run(), run(step(), spatial_rank=1)]
    ranks[1].steps[0].grads["w"] = None
    out = compare_runs(run(), ranks, TOL, spatial_size=2)
    (m,) = [m for m in out.mismatches if m.quantity == "grad"]
    assert m.rank == 1 and "no gradient (None)" in m.where and "giving zeros" in m.hint


def test_a_gradient_s_times_too_large_is_named_so():
    ranks = [run(step(grad=torch.tensor([2.0, 4.0], dtype=F64))) for _ in range(2)]
    found = compare_runs(run(), ranks, TOL, spatial_size=2).mismatches
    grads = [m for m in found if m.quantity == "grad"]
    assert [m.rank for m in grads] == [0, 1]
    assert grads[0].hint.startswith("exactly 2x the reference")


# ---------------------------------------------------------------- fields and coverage


def _shards(*indices, nvalues=None):
    out = []
    for idx in indices:
        n = len(idx) if nvalues is None else nvalues
        out.append(field([[float(i) for i in idx[:n]] + [0.0] * (n - len(idx[:n]))], idx))
    return out


def _fields(shards, ref_len=4):
    ref = step(fields={"y": field([[float(i) for i in range(ref_len)]])})
    steps = [step(fields={"y": s}) for s in shards]
    return check_fields(judge(len(shards), len(shards)), 0, ref, steps)


def test_shards_that_cover_every_position_once_reassemble_to_the_reference():
    found, errors = _fields(_shards([0, 1], [2, 3]))
    assert found == [] and errors == []
    found, _ = _fields(_shards([3, 1], [], [0, 2]))  # any order, an empty rank
    assert found == []


def test_a_position_owned_by_no_rank_is_a_coverage_hole():
    found, _ = _fields(_shards([0, 1], [3]))
    assert [(m.quantity, m.rank, m.count, m.total) for m in found] == [("coverage", None, 1, 4)]
    assert found[0].where == "1 position owned by no rank (first: position 2)"


def test_a_position_owned_by_two_ranks_is_a_double_owner():
    found, _ = _fields(_shards([0, 1, 2], [2, 3]))
    assert [(m.quantity, m.count) for m in found] == [("coverage", 1)]
    assert found[0].where == "1 owned by several (first: position 2, by ranks 0, 1)"


def test_a_position_out_of_range_names_the_rank():
    found, _ = _fields(_shards([0, 1], [2, 4]))
    assert (found[0].quantity, found[0].rank) == ("coverage", 1)
    assert found[0].where == "index out of range [0, 4): 2..4"


def test_a_shard_whose_values_do_not_match_its_index_names_the_rank():
    shards = _shards([0, 1], [2, 3])
    shards[1].values = shards[1].values[:, :1]
    found, _ = _fields(shards)
    assert [(m.quantity, m.rank) for m in found] == [("field", 1)]
    assert "where the reference gives torch.float64 (1, 2) for its 2 positions" in found[0].where


def test_a_wrong_value_names_its_position_and_owner_and_feeds_the_error_map():
    shards = _shards([0, 1], [2, 3])
    shards[1].values[0, 1] = 7.0
    found, errors = _fields(shards)
    assert [(m.quantity, m.rank, m.where) for m in found] == [
        ("field", None, "[0] position 3 on rank 1")
    ]
    (err,) = errors
    assert err.error.tolist() == [0.0, 0.0, 0.0, 4.0] and err.owners.tolist() == [0, 0, 1, 1]


def test_a_plain_tensor_where_a_shard_is_needed_suggests_shard_grid():
    shards = _shards([0, 1], [2, 3])
    shards[1] = field([[2.0, 3.0]])  # the local block as a plain tensor
    found, _ = _fields(shards)
    assert any(m.hint == SHARD_HINT and m.rank == 1 for m in found)
    assert "Shard.grid" in SHARD_HINT
    # every rank returns its local block as a plain tensor: the shape tells
    found, _ = _fields([field([[0.0, 1.0]]), field([[2.0, 3.0]])])
    assert [(m.rank, m.hint) for m in found] == [(0, SHARD_HINT), (1, SHARD_HINT)]
    assert found[0].where == "a plain tensor of shape (1, 2) where the reference's field is (1, 4)"


def test_a_plain_tensor_of_another_shape_that_is_no_block_gets_no_shard_hint():
    # an extra leading dim, or more positions than the field has: a bug of its own, not a
    # block that should have been a Shard
    for values in ([[[0.0, 1.0, 2.0, 3.0]]], [[0.0, 1.0, 2.0, 3.0, 4.0]]):
        found, _ = _fields([field(values), field(values)])
        assert [m.quantity for m in found] == ["field", "field"]
        assert all(m.hint == "" and m.where.startswith("a plain tensor of shape") for m in found)


def test_a_replicated_field_is_compared_on_every_rank():
    ref = step(fields={"y": field([[1.0, 2.0]])})
    steps = [step(fields={"y": field([[1.0, 2.0]])}), step(fields={"y": field([[1.0, 2.5]])})]
    found, _ = check_fields(judge(), 0, ref, steps)
    assert [(m.quantity, m.rank) for m in found] == [("field", 1)]


def test_a_field_missing_on_a_rank_is_named():
    ref = step(fields={"y": field([[1.0]])})
    found, _ = check_fields(judge(), 0, ref, [step(fields={"y": field([[1.0]])}), step()])
    assert [(m.quantity, m.rank, m.where) for m in found] == [
        ("field", 1, "field missing on this rank")
    ]


def test_data_groups_each_reassemble_their_share_of_the_samples():
    ref = step(fields={"y": field([[0.0, 1.0], [2.0, 3.0]])})
    steps = [
        step(fields={"y": field([[0.0]], [0])}),
        step(fields={"y": field([[1.0]], [1])}),
        step(fields={"y": field([[2.0]], [0])}),
        step(fields={"y": field([[3.0]], [1])}),
    ]
    found, _ = check_fields(judge(4, 2), 0, ref, steps)
    assert found == []
    steps[3].fields["y"].values[0, 0] = 9.0
    found, errors = check_fields(judge(4, 2), 0, ref, steps)
    assert [(m.quantity, m.where) for m in found] == [("field", "[0] position 1 on rank 3")]
    assert errors[0].data_group == 1


# ---------------------------------------------------------------- parameters after a step


def _params(a, b):
    ref = step(params={"w": a.clone()})
    return check_params(judge(), 0, ref, [step(params={"w": a}), step(params={"w": b})])


def test_co_rank_parameters_one_ulp_apart_are_out_of_sync():
    a = torch.tensor([1.0, 2.0], dtype=torch.float32)
    b = a.clone()
    b[0] = torch.nextafter(b[0], torch.tensor(2.0))
    found = _params(a, b)
    (m,) = [m for m in found if m.quantity == "sync"]
    assert (m.rank, m.count, m.total) == (1, 1, 2)
    assert m.where == "differs from spatial rank 0 (rank 0)"


def test_co_rank_parameters_holding_the_same_nan_are_in_sync():
    a = torch.tensor([NAN, 2.0], dtype=F64)
    assert [m.quantity for m in _params(a, a.clone())] == []


def test_bitwise_equal_parameters_far_from_the_reference_are_a_param_mismatch():
    a = torch.tensor([1.0, 2.0], dtype=F64)
    ref = step(params={"w": a + 1})
    found = check_params(judge(), 0, ref, [step(params={"w": a}), step(params={"w": a.clone()})])
    assert [(m.quantity, m.rank) for m in found] == [("param", 0), ("param", 1)]


# ---------------------------------------------------------------- buffers


def test_a_buffer_mutated_only_on_the_ranks_is_named():
    out = compare_runs(
        run(), [run(step(mutated=["m"])), run(step(mutated=["m"]))], TOL, spatial_size=2
    )
    assert [(m.quantity, m.name, m.rank) for m in out.mismatches] == [
        ("buffer", "m", 0),
        ("buffer", "m", 1),
    ]
    same = compare_runs(run(step(mutated=["m"])), [run(step(mutated=["m"]))], TOL, spatial_size=1)
    assert same.mismatches == []


# ---------------------------------------------------------------- whole records
# A Mismatch is what a user reads: every field of it is pinned for one case of each rule.

SEED_HINT = (
    "differs from the reference right after build: seed the initialisation identically on "
    "every rank (the harness seeds torch, numpy and random before build; a generator of your "
    "own is not)."
)
SHAPE_HINT = (
    "a parameter of another shape than the reference's: if this rank holds only part of it, "
    "name it in SpatialCase.parameter_shards as Shard(param, index, dim): the global positions "
    "along dim of the reference's parameter that this rank's values hold"
)
NONE_HINT = "a rank whose domain is empty must still run every module, giving zeros, not None"
TWICE = "exactly 2x the reference: a reduction counted 2 times"


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


def _w(*values):
    return torch.tensor(values, dtype=F64)


def test_initial_parameters_records():
    ref = run(init={"w": _w(0.0, 1.0), "gone": _w(0.0)})
    ranks = [
        run(init={"w": _w(0.0, 1.5), "extra": _w(0.0), "gone": _w(0.0)}),
        run(init={"w": _w(0.0, 1.0, 2.0)}),
    ]
    assert recs(check_init(ref, ranks, TOL)) == [
        {
            "quantity": "param",
            "name": "w",
            "step": None,
            "rank": 0,
            "max_abs": 0.5,
            "max_rel": 0.5,
            "where": "initial value",
            "count": 1,
            "total": 2,
            "hint": SEED_HINT,
        },
        {
            "quantity": "param",
            "name": "extra",
            "step": None,
            "rank": 0,
            "where": "parameter not in the reference model",
        },
        {
            "quantity": "param",
            "name": "w",
            "step": None,
            "rank": 1,
            "where": "shape (3,) where the reference has (2,)",
            "total": 2,
            "hint": SHAPE_HINT,  # a shape no seed can cause: never the seeding hint
        },
        {
            "quantity": "param",
            "name": "gone",
            "step": None,
            "rank": 1,
            "where": "reference parameter missing on this rank",
        },
    ]


def test_loss_records_co_rank_then_data_group_mean():
    steps = [step(loss=1.0), step(loss=1.25), step(loss=3.0), step(loss=3.0)]
    assert recs(check_loss(judge(4, 2), 3, step(loss=1.0), steps)) == [
        {
            "quantity": "loss",
            "name": "loss (vs spatial rank 0)",
            "step": 3,
            "rank": 1,
            "max_abs": 0.25,
            "max_rel": 0.25,
            "where": "1.25 vs reference 1",
            "count": 1,
            "total": 1,
        },
        {
            "quantity": "loss",
            "name": "loss (mean over data groups)",
            "step": 3,
            "rank": None,
            "max_abs": 1.0,
            "max_rel": 1.0,
            "where": "2 vs reference 1",
            "count": 1,
            "total": 1,
            "hint": TWICE,
        },
    ]
    assert recs(check_loss(judge(2, 2), 1, step(loss=1.0), [step(loss=2.0)] * 2)) == [
        {
            "quantity": "loss",
            "name": "loss",
            "step": 1,
            "rank": r,
            "max_abs": 1.0,
            "max_rel": 1.0,
            "where": "2 vs reference 1",
            "count": 1,
            "total": 1,
            "hint": TWICE,
        }
        for r in (0, 1)
    ]


def test_data_groups_with_losses_of_different_shapes():
    steps = [step(), step(), step(), step()]
    steps[2].loss = steps[3].loss = torch.zeros(2, dtype=F64)
    assert recs(check_loss(judge(4, 2), 0, step(), steps)) == [
        {
            "quantity": "loss",
            "name": "loss",
            "step": 0,
            "rank": None,
            "where": "the data groups' losses differ in shape",
        }
    ]


def test_gradient_records():
    ref, s0, s1 = step(), step(), step()
    ref.grads = {"w": _w(1.0, 2.0), "b": None, "c": _w(1.0)}
    s0.grads = {"w": None, "b": _w(1.0), "c": _w(1.0), "only-here": _w(1.0)}
    s1.grads = {"w": _w(1.0, 2.5), "b": None, "c": _w(1.0)}
    assert recs(check_grads(judge(2, 2), 2, ref, [s0, s1])) == [
        {
            "quantity": "grad",
            "name": "w",
            "step": 2,
            "rank": 0,
            "where": "no gradient (None) on this rank; the reference has one",
            "hint": NONE_HINT,
        },
        {
            "quantity": "grad",
            "name": "b",
            "step": 2,
            "rank": 0,
            "where": "a gradient where the reference has None",
        },
        {
            "quantity": "grad",
            "name": "w",
            "step": 2,
            "rank": 1,
            "max_abs": 0.5,
            "max_rel": 0.25,
            "where": "(1,)",
            "count": 1,
            "total": 2,
        },
    ]


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


def test_a_batch_the_reference_did_not_see_is_a_batch_record():
    ref = step(fields={"y": field([[0.0, 1.0], [2.0, 3.0]])})
    per_group = [field([[0.0], [2.0]], [0]), field([[1.0], [3.0]], [1])]
    steps = [step(fields={"y": per_group[r % 2]}) for r in range(4)]  # 2 samples per group
    assert recs(check_fields(judge(4, 2), 1, ref, steps)[0]) == [
        {
            "quantity": "batch",
            "name": "y",
            "step": 1,
            "rank": None,
            "where": "the reference saw 2 samples, the 2 data groups 4 together (2, 2)",
            "hint": BATCH_HINT,
        }
    ]


def test_ranks_sharding_different_dims_are_refused():
    ref = step(fields={"y": field([[0.0, 1.0], [2.0, 3.0]])})
    steps = [
        step(fields={"y": field([[0.0, 1.0]], [0], dim=0)}),
        step(fields={"y": field([[1.0], [3.0]], [1], dim=1)}),
    ]
    assert recs(check_fields(judge(2, 2), 0, ref, steps)[0]) == [
        {
            "quantity": "field",
            "name": "y",
            "step": 0,
            "rank": None,
            "where": "ranks shard along different dims [0, 1]; every rank must shard the same dim",
        }
    ]


def test_a_wrong_value_in_a_grid_field_names_lat_lon_and_owner():
    ref = step(fields={"y": field([[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]])})
    blocks = [([[[0.0, 1.0, 2.0]]], [0, 1, 2]), ([[[3.0, 4.0, 9.0]]], [3, 4, 5])]
    steps = [step(fields={"y": field([v[0][0]], i, -1, (2, 3))}) for v, i in blocks]
    found, (err,) = check_fields(judge(2, 2), 0, ref, steps)
    assert recs(found) == [
        {
            "quantity": "field",
            "name": "y",
            "step": 0,
            "rank": None,
            "max_abs": 4.0,
            "max_rel": 0.8,
            "where": "[0] (lat 1, lon 2) on rank 1",
            "count": 1,
            "total": 6,
        }
    ]
    assert (err.name, err.step, err.data_group, err.grid, err.unit) == (
        "y",
        0,
        0,
        (2, 3),
        "position",
    )
    assert err.error.tolist() == [0.0] * 5 + [4.0]
    assert err.owners.tolist() == [0, 0, 0, 1, 1, 1]


def test_sync_and_param_records():
    a = _w(1.0, 2.0)
    ref = step(params={"w": a.clone()})
    found = check_params(judge(2, 2), 4, ref, [step(params={"w": a}), step(params={"w": a + 1})])
    assert recs(found) == [
        {
            "quantity": "sync",
            "name": "w",
            "step": 4,
            "rank": 1,
            "max_abs": 1.0,
            "max_rel": 1.0,
            "where": "differs from spatial rank 0 (rank 0)",
            "count": 2,
            "total": 2,
        },
        {
            "quantity": "param",
            "name": "w",
            "step": 4,
            "rank": 1,
            "max_abs": 1.0,
            "max_rel": 1.0,
            "where": "(0,)",
            "count": 2,
            "total": 2,
        },
    ]
    found = check_params(
        judge(2, 2), 4, ref, [step(params={"w": a}), step(params={"w": _w(1, 2, 3)})]
    )
    assert recs(found) == [
        {
            "quantity": "sync",
            "name": "w",
            "step": 4,
            "rank": 1,
            "where": "shape (3,) where the reference has (2,)",
            "total": 3,
        },
        {
            "quantity": "param",
            "name": "w",
            "step": 4,
            "rank": 1,
            "where": "shape (3,) where the reference has (2,)",
            "total": 2,
        },
    ]


def test_buffer_records_sorted_by_name():
    found = check_buffers(2, step(mutated=["a"]), [step(mutated=["a", "z", "b"]), step()])
    assert recs(found) == [
        {
            "quantity": "buffer",
            "name": n,
            "step": 2,
            "rank": 0,
            "where": "modified in place during the step; the reference's was not",
        }
        for n in ("b", "z")
    ]


# ---------------------------------------------------------------- whole findings, field by field


def same(found, *expected):
    """The findings are exactly these, every field of every one (the report prints them);
    the same comparison as ``recs``, with the expected findings written as Mismatches."""
    assert recs(found) == recs(expected)


def shard(values, index, dim=-1, grid=None, unit="position", dtype=F64):
    index = torch.tensor(index, dtype=torch.long)
    return FieldRecord(torch.tensor(values, dtype=dtype), index, dim, grid, unit)


BUFFER = "modified in place during the step; the reference's was not"
SEED = (
    "differs from the reference right after build: seed the initialisation identically on "
    "every rank (the harness seeds torch, numpy and random before build; a generator of your "
    "own is not)."
)
NO_GRAD_HINT = "a rank whose domain is empty must still run every module, giving zeros, not None"


def test_every_finding_of_a_later_step_names_that_step_and_error_maps_accumulate():
    y = [[0.0, 1.0, 2.0, 3.0]]
    ref = run(step(fields={"y": field(y)}), step(loss=2.0, fields={"y": field(y)}))
    later = {
        "loss": 2.5,
        "grad": torch.tensor([1.0, 3.0], dtype=F64),
        "params": {"w": torch.tensor([0.5, 0.5], dtype=F64)},
        "mutated": ["m"],
    }
    r0 = run(
        step(fields={"y": shard([[0.0, 1.0]], [0, 1])}),
        step(fields={"y": shard([[0.0, 1.0]], [0, 1])}, **later),
    )
    r1 = run(
        step(fields={"y": shard([[2.0, 9.0]], [2, 3])}),
        step(fields={"y": shard([[2.0, 8.0]], [2, 3])}, **later),
        spatial_rank=1,
    )
    out = compare_runs(ref, [r0, r1], TOL, spatial_size=2)
    same(
        out.mismatches,
        Mismatch("field", "y", 0, None, 6.0, 2.0, "[0] position 3 on rank 1", 1, 4),
        *(Mismatch("loss", "loss", 1, r, 0.5, 0.25, "2.5 vs reference 2", 1, 1) for r in (0, 1)),
        *(Mismatch("grad", "w", 1, r, 1.0, 0.5, "(1,)", 1, 2) for r in (0, 1)),
        Mismatch("field", "y", 1, None, 5.0, 5.0 / 3.0, "[0] position 3 on rank 1", 1, 4),
        *(Mismatch("param", "w", 1, r, 0.25, 1.0, "(1,)", 1, 2) for r in (0, 1)),
        *(Mismatch("buffer", "m", 1, r, where=BUFFER) for r in (0, 1)),
    )
    assert [(e.step, e.error.tolist()) for e in out.field_errors] == [
        (0, [0.0, 0.0, 0.0, 6.0]),
        (1, [0.0, 0.0, 0.0, 5.0]),
    ]
    assert out.likely == ""


def test_the_spatial_size_defaults_to_the_records():
    assert compare_runs(run(), [run()], TOL).mismatches == []
    ranks = [run(spatial_size=2), run(step(loss=1.5), spatial_rank=1, spatial_size=2)]
    names = [(m.name, m.rank) for m in compare_runs(run(), ranks, TOL).mismatches]
    assert names == [("loss (vs spatial rank 0)", 1), ("loss", 1)]


def test_a_loss_s_times_too_large_is_named_so_and_is_the_likely_cause():
    ranks = [run(step(loss=2.0)), run(step(loss=2.0), spatial_rank=1)]
    out = compare_runs(run(), ranks, TOL, spatial_size=2)
    hint = "exactly 2x the reference: a reduction counted 2 times"
    same(
        out.mismatches,
        *(
            Mismatch("loss", "loss", 0, r, 1.0, 1.0, "2 vs reference 1", 1, 1, hint=hint)
            for r in (0, 1)
        ),
    )
    assert out.likely == hint


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


def test_initial_parameters_extra_different_or_missing_are_each_a_finding():
    ref = run(init={"w": torch.tensor([0.0, 1.0], dtype=F64), "v": torch.zeros(2, dtype=F64)})
    rank = run(
        init={
            "b": torch.zeros(1, dtype=F64),  # not in the reference: the rest is still checked
            "w": torch.tensor([0.0, 1.5], dtype=F64),
            "v": torch.zeros(3, dtype=F64),
        }
    )
    same(
        check_init(ref, [rank, run(init={"w": torch.tensor([0.0, 1.0], dtype=F64)})], TOL),
        Mismatch("param", "b", None, 0, where="parameter not in the reference model"),
        Mismatch("param", "w", None, 0, 0.5, 0.5, "initial value", 1, 2, hint=SEED),
        Mismatch(
            "param",
            "v",
            None,
            0,
            where="shape (3,) where the reference has (2,)",
            total=2,
            hint=SHAPE_HINT,
        ),
        Mismatch("param", "v", None, 1, where="reference parameter missing on this rank"),
    )


def test_gradients_none_on_one_side_only_are_named_and_the_rest_still_compared():
    ref = step()
    ref.grads = {
        "a": None,
        "b": torch.tensor([1.0], dtype=F64),
        "c": None,
        "w": torch.tensor([1.0, 2.0], dtype=F64),
    }
    st = step()
    st.grads = {
        "x": torch.ones(1, dtype=F64),  # not in the reference: reported as a parameter
        "a": None,  # None on both sides: fine
        "b": None,
        "c": torch.ones(1, dtype=F64),
        "w": torch.tensor([1.0, 2.5], dtype=F64),
    }
    none_here = "no gradient (None) on this rank; the reference has one"
    none_there = "a gradient where the reference has None"
    same(
        check_grads(judge(), 3, ref, [st, st]),
        *[
            m
            for r in (0, 1)
            for m in (
                Mismatch("grad", "b", 3, r, where=none_here, hint=NO_GRAD_HINT),
                Mismatch("grad", "c", 3, r, where=none_there),
                Mismatch("grad", "w", 3, r, 0.5, 0.25, "(1,)", 1, 2),
            )
        ],
    )


# ---------------------------------------------------------------- loss, exactly


def test_every_co_rank_whose_loss_differs_from_spatial_rank_0_is_named():
    ranks = [step(loss=1.0), step(loss=1.5), step(loss=2.0)]
    same(
        check_loss(judge(3, 3), 2, step(loss=1.0), ranks),
        Mismatch("loss", "loss (vs spatial rank 0)", 2, 1, 0.5, 0.5, "1.5 vs reference 1", 1, 1),
        Mismatch("loss", "loss (vs spatial rank 0)", 2, 2, 1.0, 1.0, "2 vs reference 1", 1, 1),
        Mismatch("loss", "loss", 2, 1, 0.5, 0.5, "1.5 vs reference 1", 1, 1),
        Mismatch("loss", "loss", 2, 2, 1.0, 1.0, "2 vs reference 1", 1, 1),
    )


def test_co_rank_losses_a_rounding_apart_are_within_tolerance():
    ranks = [step(loss=1.0), step(loss=1.0 + 1e-13)]
    assert check_loss(judge(2, 2), 0, step(loss=1.0), ranks) == []


def test_data_groups_losses_of_different_shapes_are_one_finding():
    ranks = [step(loss=1.0), step(loss=[1.0, 2.0])]
    same(
        check_loss(judge(2, 1), 2, step(loss=1.0), ranks),
        Mismatch("loss", "loss", 2, None, where="the data groups' losses differ in shape"),
    )


def test_per_sample_losses_of_data_groups_are_averaged_elementwise():
    ranks = [step(loss=[1.0, 3.0]), step(loss=[2.0, 4.0])]
    assert check_loss(judge(2, 1), 0, step(loss=[1.5, 3.5]), ranks) == []
    same(
        check_loss(judge(2, 1), 4, step(loss=[1.5, 3.0]), ranks),
        Mismatch("loss", "loss (mean over data groups)", 4, None, 0.5, 0.5 / 3.0, "(1,)", 1, 2),
    )


# ---------------------------------------------------------------- fields, exactly


def test_every_field_of_a_step_is_checked_whatever_the_earlier_ones_found():
    four = [[0.0, 1.0, 2.0, 3.0]]
    ref = step(fields={n: field(four) for n in ("plain", "gone", "plain2", "s1", "s2")})
    r0 = {
        "plain": field(four),
        "gone": field(four),
        "plain2": field(four),
        "s1": shard([[0.0, 1.0]], [0, 1]),
        "s2": shard([[0.5, 1.0]], [0, 1]),
    }
    r1 = {
        "plain": field([[0.0, 1.0, 2.0, 4.0]]),
        "plain2": field([[0.0, 1.0, 2.5, 3.0]]),
        "s1": shard([[2.0, 3.5]], [2, 3]),
        "s2": shard([[2.0, 3.0]], [2, 3]),
    }
    found, errors = check_fields(judge(), 5, ref, [step(fields=r0), step(fields=r1)])
    same(
        found,
        Mismatch("field", "plain", 5, 1, 1.0, 1.0 / 3.0, "(0, 3)", 1, 4),
        Mismatch("field", "gone", 5, 1, where="field missing on this rank"),
        Mismatch("field", "plain2", 5, 1, 0.5, 0.25, "(0, 2)", 1, 4),
        Mismatch("field", "s1", 5, None, 0.5, 0.5 / 3.0, "[0] position 3 on rank 1", 1, 4),
        Mismatch("field", "s2", 5, None, 0.5, 0.0, "[0] position 0 on rank 0", 1, 4),
    )
    assert [(e.name, e.step, e.data_group) for e in errors] == [("s1", 5, 0), ("s2", 5, 0)]


def test_a_reference_that_saw_another_batch_is_the_batch_trap():
    ref = step(fields={"t": field([0.0, 1.0, 2.0]), "u": field([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])})
    ranks = [
        step(fields={"t": field([0.0, 1.0, 2.0]), "u": field([[0.0, 1.0, 2.0]] * 2)}),
        step(fields={"t": field([0.0, 1.0, 2.0]), "u": field([[3.0, 4.0, 5.0]] * 2)}),
    ]
    found, errors = check_fields(judge(2, 1), 3, ref, ranks)
    same(
        found,
        Mismatch(
            "batch",
            "t",
            3,
            None,
            where="the reference saw 3 samples, the 2 data groups 6 together (3, 3)",
            hint=BATCH_HINT,
        ),
        Mismatch(
            "batch",
            "u",
            3,
            None,
            where="the reference saw 2 samples, the 2 data groups 4 together (2, 2)",
            hint=BATCH_HINT,
        ),
    )
    assert errors == []


def test_data_groups_each_compare_their_share_of_a_replicated_field():
    ref = step(fields={"y": field([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]), "s": field(1.0)})
    ranks = [
        step(fields={"y": field([[0.0, 1.0, 2.0]]), "s": field(1.0)}),
        step(fields={"y": field([[3.0, 4.0, 5.5]]), "s": field(1.0)}),  # a scalar: no samples
    ]
    found, _ = check_fields(judge(2, 1), 1, ref, ranks)
    same(found, Mismatch("field", "y", 1, 1, 0.5, 0.1, "(0, 2)", 1, 3))


def test_a_replicated_field_of_the_wrong_shape_on_a_single_rank_says_so_plainly():
    ref = step(fields={"y": field([[0.0, 1.0, 2.0]])})
    found, _ = check_fields(judge(1, 1), 1, ref, [step(fields={"y": field([[0.0, 1.0]])})])
    same(
        found,
        Mismatch("field", "y", 1, 0, where="shape (1, 2) where the reference has (1, 3)", total=3),
    )


def test_one_dimensional_cell_shards_name_the_cell_and_its_owner():
    ref = step(fields={"y": field([0.0, 1.0, 2.0, 3.0])})
    ranks = [
        step(fields={"y": shard([0.0, 1.0], [0, 1], unit="cell")}),
        step(fields={"y": shard([2.0, 3.5], [2, 3], unit="cell")}),
    ]
    found, (err,) = check_fields(judge(2, 2), 1, ref, ranks)
    same(found, Mismatch("field", "y", 1, None, 0.5, 0.5 / 3.0, "cell 3 on rank 1", 1, 4))
    assert (err.error.tolist(), err.owners.tolist(), err.grid, err.unit) == (
        [0.0, 0.0, 0.0, 0.5],
        [0, 0, 1, 1],
        None,
        "cell",
    )


def test_data_groups_of_one_rank_each_reassemble_their_own_shard():
    ref = step(fields={"y": field([[0.0, 1.0], [2.0, 3.0]])})
    ranks = [
        step(fields={"y": shard([[0.0, 1.0]], [0, 1], unit="cell")}),
        step(fields={"y": shard([[2.0, 3.5]], [0, 1], unit="cell")}),
    ]
    found, (err,) = check_fields(judge(2, 1), 1, ref, ranks)
    same(found, Mismatch("field", "y", 1, None, 0.5, 0.5 / 3.0, "[0] cell 1 on rank 1", 1, 2))
    assert type(err.data_group) is int and err.data_group == 1


def _grid_field(extra=0.0, index=(2, 5)):
    """A (2, 2, 3) field in Shard.grid form: rank 0 owns lat x lon positions 0, 1, 3, 4."""
    flat = torch.arange(12.0, dtype=F64).reshape(2, 6)
    ref = step(fields={"y": field(flat.reshape(2, 2, 3))})
    mine = flat[:, list(index)].clone()
    mine[1, -1] += extra
    ranks = [
        step(fields={"y": shard(flat[:, [0, 1, 3, 4]].tolist(), [0, 1, 3, 4], grid=(2, 3))}),
        step(fields={"y": shard(mine.tolist(), list(index), grid=(2, 3))}),
    ]
    return check_fields(judge(2, 2), 1, ref, ranks)


def test_grid_shards_of_a_batched_field_name_latitude_and_longitude():
    assert _grid_field() == ([], [])
    found, (err,) = _grid_field(extra=1.0)
    same(
        found,
        Mismatch("field", "y", 1, None, 1.0, 1.0 / 11.0, "[1] (lat 1, lon 2) on rank 1", 1, 12),
    )
    assert (err.error.tolist(), err.owners.tolist(), err.grid) == (
        [0.0] * 5 + [1.0],
        [0, 0, 1, 0, 0, 1],
        (2, 3),
    )
    found, _ = _grid_field(index=(2,))
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            1,
            None,
            where="1 position owned by no rank (first: (lat 1, lon 2))",
            count=1,
            total=6,
        ),
    )


def test_shards_along_the_sample_dim_and_mixed_dims():
    ref = step(fields={"y": field([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])})
    top = step(fields={"y": shard([[0.0, 1.0]], [0], dim=0)})
    found, (err,) = check_fields(
        judge(2, 2),
        1,
        ref,
        [top, step(fields={"y": shard([[2.0, 3.0], [4.0, 6.0]], [1, 2], dim=0)})],
    )
    same(found, Mismatch("field", "y", 1, None, 1.0, 0.2, "[1] position 2 on rank 1", 1, 6))
    assert (err.error.tolist(), err.owners.tolist()) == ([0.0, 0.0, 1.0], [0, 1, 1])
    found, errors = check_fields(
        judge(2, 2), 1, ref, [top, step(fields={"y": shard([[1.0], [3.0], [5.0]], [1], dim=1)})]
    )
    same(
        found,
        Mismatch(
            "field",
            "y",
            1,
            None,
            where="ranks shard along different dims [0, 1]; every rank must shard the same dim",
        ),
    )
    assert errors == []


def test_a_three_dimensional_field_names_every_other_index():
    ref = torch.arange(8.0, dtype=F64).reshape(2, 2, 2)
    got = ref.clone()
    got[1, 1, 0] += 1.0
    ranks = [
        step(fields={"y": FieldRecord(got[:, :, :1].clone(), torch.tensor([0]), -1, None, "cell")}),
        step(fields={"y": FieldRecord(got[:, :, 1:].clone(), torch.tensor([1]), -1, None, "cell")}),
    ]
    found, (err,) = check_fields(judge(2, 2), 0, step(fields={"y": field(ref)}), ranks)
    same(found, Mismatch("field", "y", 0, None, 1.0, 1.0 / 6.0, "[1, 1] cell 0 on rank 0", 1, 8))
    assert err.error.tolist() == [1.0, 0.0]


def test_refused_shards_are_named_with_their_rank_and_a_fix():
    ref = step(fields={"y": field([[0.0, 1.0, 2.0, 3.0]])})
    first = step(fields={"y": shard([[0.0, 1.0]], [0, 1])})

    def findings(second):
        return check_fields(judge(2, 2), 1, ref, [first, step(fields={"y": second})])

    hole = Mismatch(
        "coverage",
        "y",
        1,
        None,
        where="2 positions owned by no rank (first: position 2)",
        count=2,
        total=4,
    )
    found, errors = findings(field([[2.0, 3.0]]))
    same(
        found,
        Mismatch(
            "field",
            "y",
            1,
            1,
            where="a plain tensor of shape (1, 2) where other ranks return a Shard",
            hint=SHARD_HINT,
        ),
        hole,
    )
    assert errors == []
    found, _ = findings(shard([[2.0, 3.0]], [-1, 2]))
    same(found, Mismatch("coverage", "y", 1, 1, where="index out of range [0, 4): -1..2"), hole)
    found, _ = findings(shard([[2.0, 3.0]], [2, 3], dtype=torch.float32))
    same(
        found,
        Mismatch(
            "field",
            "y",
            1,
            1,
            where="shard torch.float32 (1, 2) where the reference gives torch.float64 (1, 2) "
            "for its 2 positions",
        ),
    )


def test_an_unflattened_grid_block_suggests_shard_grid():
    ref = step(fields={"y": field([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])})
    ranks = [
        step(fields={"y": shard([[0.0, 1.0, 2.0]], [0, 1, 2], grid=(2, 3))}),
        step(fields={"y": shard([[[3.0, 4.0, 5.0]]], [3, 4, 5], grid=(2, 3))}),
    ]
    found, _ = check_fields(judge(2, 2), 1, ref, ranks)
    hint = (
        "the values are the rank's (1, 3) block, not flattened: use "
        "Shard.grid(values, rows, cols, nlat, nlon)"
    )
    same(
        found,
        Mismatch(
            "field",
            "y",
            1,
            1,
            where="shard torch.float64 (1, 1, 3) where the reference gives torch.float64 (1, 3) "
            "for its 3 positions",
            hint=hint,
        ),
    )


def test_a_float32_field_s_error_map_is_float64():
    ref = step(fields={"y": FieldRecord(torch.tensor([0.0, 1.0, 2.0, 3.0]))})
    ranks = [
        step(fields={"y": shard([0.0, 1.0], [0, 1], dtype=torch.float32)}),
        step(fields={"y": shard([2.0, 3.5], [2, 3], dtype=torch.float32)}),
    ]
    found, (err,) = check_fields(
        Judge(
            Tolerance.for_dtype(torch.float32), Layout(2, 2), {q: QuantityStats() for q in NUMERIC}
        ),
        1,
        ref,
        ranks,
    )
    same(found, Mismatch("field", "y", 1, None, 0.5, 0.5 / 3.0, "position 3 on rank 1", 1, 4))
    assert err.error.dtype == torch.float64 and err.error.tolist() == [0.0, 0.0, 0.0, 0.5]


def test_a_scalar_owned_by_one_rank_is_compared_as_one_value():
    ref = step(fields={"s": field(2.0)})
    ranks = [step(fields={"s": shard(2.5, [0])}), step(fields={"s": shard(0.0, [])})]
    found, (err,) = check_fields(judge(2, 2), 1, ref, ranks)
    same(found, Mismatch("field", "s", 1, None, 0.5, 0.25, "2.5 vs reference 2", 1, 1))
    assert (err.error.tolist(), err.owners.tolist()) == ([0.5], [0])
    ranks[0].fields["s"] = shard(2.0, [0])
    assert check_fields(judge(2, 2), 1, ref, ranks) == ([], [])


def _line_of_blocks(got: torch.Tensor, ranks: int) -> list[StepRecord]:
    n = len(got) // ranks
    return [
        step(
            fields={
                "y": FieldRecord(
                    got[r * n : (r + 1) * n].clone(), torch.arange(r * n, (r + 1) * n), -1
                )
            }
        )
        for r in range(ranks)
    ]


def test_errors_on_the_boundary_between_blocks_point_at_the_halo():
    ref = torch.arange(1.0, 65.0, dtype=F64)
    got = ref.clone()
    got[[15, 16, 31, 32, 47, 48]] += 1.0  # every position next to another rank's block
    found, _ = check_fields(judge(4, 4), 0, step(fields={"y": field(ref)}), _line_of_blocks(got, 4))
    hint = (
        "the 6 positions that differ all border another rank (6 of 64 positions do): a halo "
        "exchange is off (width, order or which neighbour), or a neighbour table uses local "
        "indices"
    )
    same(
        found,
        Mismatch("field", "y", 0, None, 1.0, 1 / 16, "position 15 on rank 0", 6, 64, hint=hint),
    )


def test_two_errors_that_border_another_rank_by_chance_are_no_evidence_of_a_halo():
    # 2 of 8 positions border another rank: two bad positions land there by chance 1 time
    # in 16, which a logic bug anywhere does (an off-by-one at the end of one block)
    ref = torch.arange(1.0, 9.0, dtype=F64)
    got = ref.clone()
    got[3] += 1.0
    got[4] += 1.0
    found, _ = check_fields(judge(2, 2), 0, step(fields={"y": field(ref)}), _line_of_blocks(got, 2))
    same(found, Mismatch("field", "y", 0, None, 1.0, 0.25, "position 3 on rank 0", 2, 8))


# ---------------------------------------------------------------- parameters, exactly


def test_co_ranks_out_of_sync_are_named_with_how_many_elements_differ():
    a = torch.tensor([1.0, 2.0], dtype=F64)
    sync = "differs from spatial rank 0 (rank 0)"
    found = _params(a, torch.tensor([1.0, 2.5], dtype=F64))
    same(
        found,
        Mismatch("sync", "w", 0, 1, 0.5, 0.25, sync, 1, 2),
        Mismatch("param", "w", 0, 1, 0.5, 0.25, "(1,)", 1, 2),
    )
    nan = torch.tensor([1.0, NAN], dtype=F64)
    same(
        _params(a, nan)[:1],
        Mismatch("sync", "w", 0, 1, math.inf, math.inf, sync, 1, 2),
    )
    same(
        _params(a, a.float())[:1],
        Mismatch(
            "sync",
            "w",
            0,
            1,
            where="dtype torch.float32 where the reference has torch.float64",
            total=2,
        ),
    )
    same(
        _params(a, torch.ones(3, dtype=F64))[:1],
        Mismatch("sync", "w", 0, 1, where="shape (3,) where the reference has (2,)", total=3),
    )


SEEN = "an all_reduce at model.py:42 ran in float32"


def test_float32_sized_errors_with_a_float32_collective_on_the_path_name_it():
    a = torch.linspace(1, 2, 8, dtype=F64)
    ref = run(step(grad=a))
    ranks = [run(step(grad=a.float().double())), run(step(grad=a), spatial_rank=1)]
    ranks[1].dtypes = {"float32": SEEN}
    out = compare_runs(ref, ranks, TOL, spatial_size=2)
    (m,) = [m for m in out.mismatches if m.quantity == "grad"]
    assert m.hint.startswith("relative errors of ") and "(float32 rounding is 1e-07)" in m.hint
    assert f"in a float64 run, and {SEEN} on rank 1: look there" in m.hint
    assert out.likely == m.hint


def test_float32_sized_errors_without_a_float32_value_seen_are_no_precision_evidence():
    # a logic bug that moves a gradient by 1e-7 relative looks like float32 rounding: without
    # a float32 value on the path, no hint
    a = torch.linspace(1, 2, 8, dtype=F64)
    out = compare_runs(run(step(grad=a)), [run(step(grad=a * (1 + 1e-7)))], TOL)
    assert [m.quantity for m in out.mismatches] == ["grad"]
    assert out.mismatches[0].hint == "" and out.likely == ""
    # a float32 value that is not float32 (a complex64 is) or seen nowhere: still none
    other = run(step(grad=a * (1 + 1e-7)))
    other.dtypes = {"bfloat16": "an all_gather at m.py:3 ran in bfloat16"}
    assert compare_runs(run(step(grad=a)), [other], TOL).likely == ""
    other.dtypes = {"complex64": "the output of 'sht' (RealSHT) was complex64"}
    assert "complex64 on rank 0" in compare_runs(run(step(grad=a)), [other], TOL).likely


def test_a_parameter_off_by_float32_rounding_gets_no_precision_hint_even_with_float32_seen():
    # after a step a parameter moves by lr x its gradient: any bug leaves it close, so its
    # small relative error is no evidence (the gradient's is)
    a = torch.linspace(1, 2, 8, dtype=F64)
    rank = run(step(params={"w": a.float().double()}))
    rank.dtypes = {"float32": SEEN}
    out = compare_runs(run(step(params={"w": a})), [rank], TOL)
    assert [(m.quantity, m.hint) for m in out.mismatches] == [("param", "")]


# ---------------------------------------------------------------- text


def test_data_part_is_the_group_s_contiguous_share_of_the_samples():
    ref = torch.arange(12.0).reshape(4, 3)
    assert data_part(ref, 1, 2).tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
    assert data_part(ref, 0, 1) is ref
    assert data_part(torch.tensor(5.0), 1, 2).item() == 5.0


def test_position_text_names_a_grid_position_or_a_unit():
    assert position_text(7, None) == "position 7"
    assert position_text(7, None, "cell") == "cell 7"
    assert position_text(7, (2, 3)) == "(lat 2, lon 1)"


@pytest.mark.parametrize(
    ("actual", "expected", "text"),
    [
        (2.5, 3.5, "2.5 vs reference 3.5"),
        (1.234567, 2.234567, "1.23457 vs reference 2.23457"),
        (1.0000001, 1.0000002, "1.0000001 vs reference 1.0000002"),
        (0.1, 0.1, "0.1 vs reference 0.1"),
    ],
)
def test_two_values_shows_at_least_six_digits_and_no_more_than_needed(actual, expected, text):
    assert two_values(torch.tensor(actual, dtype=F64), torch.tensor(expected, dtype=F64)) == text


def test_a_nonfinite_value_in_a_slice_shard_is_named_by_its_global_position():
    values = torch.tensor([[1.0, NAN]], dtype=F64)
    st = step(fields={"y": FieldRecord(values, slice(2, 4), -1, None, "cell")})
    same(
        check_nonfinite_step(0, step(), [st]),
        Mismatch("nonfinite", "y", 0, 0, where="[0] cell 3 (1 NaN)", count=1, total=2, of="field"),
    )


# ---------------------------------------------------------------- values of any tensor type


def test_records_holding_dtensor_like_values_are_compared_by_the_values_they_hold():
    from torch.distributed.tensor import Shard as DShard

    from tests.unit.test_compare import Distributed, Mesh

    whole = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=F64)

    def held(rank):  # a field whose .shape is the global (1, 4), its values the rank's half
        local = whole[:, 2 * rank : 2 * rank + 2]
        value = Distributed(whole, local, [DShard(1)], Mesh((2,), (rank,)))
        return FieldRecord(value, torch.tensor([2 * rank, 2 * rank + 1]), -1)

    ref = run(step(fields={"y": field(whole)}))
    ranks = [run(step(fields={"y": held(r)})) for r in (0, 1)]
    found = compare_runs(ref, ranks, TOL, spatial_size=2)
    assert found.mismatches == [] and found.diagnoses == []


def test_a_hint_that_raises_is_a_not_located_line_and_the_finding_stands(monkeypatch):
    import harness._judges
    import harness._judges.judge

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(harness._judges.judge, "scale_hint", broken)
    monkeypatch.setattr(harness._judges, "likely_cause", broken)
    bad = run(step(grad=torch.tensor([1.0, 3.0], dtype=F64)))
    found = compare_runs(run(), [run(), bad], TOL, spatial_size=2)
    assert quantities(found.mismatches) == [("grad", 1)]
    assert found.mismatches[0].where == "(1,)" and found.likely == ""
    assert found.diagnoses == [
        "Not located: a hint for grad 'w' (RuntimeError: boom)",
        "Not located: the likely cause (RuntimeError: boom)",
    ]


def test_a_keyed_shard_with_duplicated_keys_does_not_hold_the_whole_field():
    # 2 ranks each hold 4 items of a 4-item field, but rank 1 holds item 0 twice and item 3
    # not at all: it does not hold the whole field, so the check is not vacuous
    keys = torch.arange(4)[:, None]
    values = torch.arange(4, dtype=F64)[:, None]
    ref = RunRecord(init={}, steps=[step(fields={"y": FieldRecord(values, None, 0, keys=keys)})])
    doubled = torch.tensor([[0], [1], [2], [0]])
    whole = [
        RunRecord(init={}, steps=[step(fields={"y": FieldRecord(values, None, 0, keys=k)})])
        for k in (keys, keys)
    ]
    assert check_vacuous("case", ref, whole, 2) != []  # both hold all four: vacuous
    held = [
        RunRecord(init={}, steps=[step(fields={"y": FieldRecord(values, None, 0, keys=k)})])
        for k in (keys, doubled)
    ]
    assert check_vacuous("case", ref, held, 2) == []


# ---------------------------------------------------------------- declarations up front


class Declares(SpatialCase):
    """Answers partition and activation_shard with what it is given."""

    def __init__(self, partition=None, said=None):
        self.given, self.said = partition, said

    def partition(self, topo):
        return self.given


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("junk", "'junk' (a str)"),
        (42, "42 (a int)"),
        (
            [Positions(4, range(2)), 3.5],
            "[Positions(size=4, index=range(0, 2), unit='position'), 3.5] (a list)",
        ),
    ],
    ids=["str", "int", "list-with-junk"],
)
def test_a_partition_locating_cannot_read_is_one_config_error(given, shown):
    with pytest.raises(ConfigError) as info:
        check_partition(Declares(given), Topology.single())
    assert str(info.value) == (
        f"Declares.partition for the reference returned {shown}; return a LatLonPartition, "
        "a CellPartition, harness.Positions, a list of them, or None"
    )
    check_partition(Declares(Positions(4, range(2))), Topology.single())  # a good one passes
    check_partition(Declares(None), Topology.single())


@pytest.mark.parametrize(
    ("said", "says"),
    [
        (7, 'returned 7 (a int); return a Shard, "whole", "skip" or None'),
        ("halo", "returned 'halo' (a str); return a Shard"),
        (Shard(torch.zeros(3), torch.tensor([0, 1]), 0), "has 2 positions in its index but 3"),
        (Shard(torch.zeros(2), torch.tensor([0.0, 1.0]), 0), "has a float32 index"),
        (Shard.keyed(torch.zeros(2, 1), torch.arange(2)), "returned a Shard.keyed"),
    ],
    ids=["int", "str", "index-length", "float-index", "keyed"],
)
def test_an_activation_shard_answer_locating_cannot_read_is_one_config_error(said, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_activation_shard(Declares(), "block", said, " on rank 1")
    for good in (None, "whole", "skip", Shard(torch.zeros(2), torch.tensor([3, 5]), 0)):
        assert check_activation_shard(Declares(), "block", good) is good


def test_a_grid_shard_of_spectral_coefficients_is_named_by_its_own_axes():
    values = torch.zeros(2, 1, 3, dtype=F64)
    spectral = Shard.grid(values, slice(1, 2), slice(0, 3), 2, 3, axes=("l", "m"))
    plain = Shard.grid(values, slice(1, 2), slice(0, 3), 2, 3)
    assert (spectral.unit, plain.unit) == ("l,m", "position")
    flat = torch.arange(12.0, dtype=F64).reshape(2, 6)
    mine = flat[:, [3, 4, 5]].clone()
    mine[1, -1] += 1.0
    ref = step(fields={"y": field(flat.reshape(2, 2, 3))})
    ranks = [
        step(fields={"y": shard(flat[:, [0, 1, 2]].tolist(), [0, 1, 2], grid=(2, 3), unit="l,m")}),
        step(fields={"y": shard(mine.tolist(), [3, 4, 5], grid=(2, 3), unit="l,m")}),
    ]
    found, _ = check_fields(judge(2, 2), 1, ref, ranks)
    assert [m.where for m in found] == ["[1] (l 1, m 2) on rank 1"]


@pytest.mark.parametrize("axes", [("l",), ("l", ""), ("l,m", "n"), "lm"])
def test_grid_axes_that_are_not_two_plain_names_are_refused_with_an_example(axes):
    with pytest.raises(ConfigError, match=r'two names without commas.*axes=\("l", "m"\)'):
        Shard.grid(torch.zeros(1, 3), slice(0, 1), slice(0, 3), 2, 3, axes=axes)
