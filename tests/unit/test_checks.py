"""checks.py on hand-made records: every rule of the comparison, without a rank in sight."""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.checks import (
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
    two_values,
)
from harness.compare import NUMERIC, Mismatch, QuantityStats, Tolerance
from harness.records import FieldRecord, RunRecord, StepRecord

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
NONE_HINT = "a rank whose domain is empty must still run every module, giving zeros, not None"
TWICE = "exactly 2x the reference: a reduction counted 2 times"


def rec(m):
    """A Mismatch's fields that differ from their defaults (quantity, name, step and rank
    always), NaN as None: comparing whole records pins every field, defaults included."""
    defaults = Mismatch("", "", None, None)
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
            "hint": SEED_HINT,
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
