"""Plain values (harness/_judges/values.py) on hand-made records: parameters after build,
loss, gradients, parameters after a step with their co-rank sync, and buffers."""

from __future__ import annotations

import math

import torch

from harness._judges import (
    check_buffers,
    check_grads,
    check_init,
    check_loss,
    check_params,
    compare_runs,
)
from harness.compare import Mismatch
from tests.unit._judging import (
    F64,
    NAN,
    TOL,
    _w,
    judge,
    recs,
    run,
    same,
    step,
)

# ---------------------------------------------------------------- parameters after build


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


# ---------------------------------------------------------------- gradients


def test_a_missing_gradient_on_a_rank_is_named_with_a_hint():
    ranks = [run(), run(step(), spatial_rank=1)]
    ranks[1].steps[0].grads["w"] = None
    out = compare_runs(run(), ranks, TOL, spatial_size=2)
    (m,) = [m for m in out.mismatches if m.quantity == "grad"]
    assert m.rank == 1 and "no gradient (None)" in m.where and "giving zeros" in m.hint


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


# the same two hints as the field-by-field tests below name them
SEED = SEED_HINT
NO_GRAD_HINT = NONE_HINT


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
