"""Sharded parameters on hand-made records (checks.py) and as a case declares them
(run_case): fit, coverage, values at the shard's positions, sync between copies."""

from __future__ import annotations

import pytest
import torch

from harness import ConfigError, Outputs, Shard, SpatialCase, Topology
from harness._judges import (
    PARAM_SHARD_HINT,
    SHARD_INIT_HINT,
    Layout,
    check_param_shards,
    compare_runs,
)
from harness._records.run import ParamShard, RunRecord, StepRecord
from harness.case import load_init, parameter_shards
from harness.compare import Mismatch, Tolerance
from harness.equivalence import run_case
from tests.unit.test_checks import recs

F64 = torch.float64
TOL = Tolerance.for_dtype(F64)
# the reference's parameter "w" (2, 6), sharded along dim 1; "b" is replicated
W = torch.arange(12, dtype=F64).reshape(2, 6) / 7
GRAD = 1 - W / 3
AFTER = W - 0.1 * GRAD
B = torch.tensor([0.5, -0.25], dtype=F64)


def reference() -> RunRecord:
    step = StepRecord(
        loss=torch.tensor(1.0, dtype=F64),
        grads={"w": GRAD, "b": B / 2},
        params={"w": AFTER, "b": B},
    )
    return RunRecord(init={"w": W, "b": B}, steps=[step])


def rank(cols, *, init=None, grad=None, after=None, dim=1, shard=True, b=B):
    """A rank holding columns ``cols`` of "w" (its values taken from the reference's, unless
    given) and the replicated "b"."""
    index = torch.tensor(cols, dtype=torch.long)
    part = (lambda t: t.index_select(1, index)) if shard else (lambda t: t)
    step = StepRecord(
        loss=torch.tensor(1.0, dtype=F64),
        grads={"w": part(GRAD) if grad is None else grad, "b": B / 2},
        params={"w": part(AFTER) if after is None else after, "b": b},
    )
    return RunRecord(
        init={"w": part(W) if init is None else init, "b": B},
        steps=[step],
        param_shards={"w": ParamShard(index, dim)} if shard else {},
    )


def found(ranks, spatial_size=2):
    return compare_runs(reference(), ranks, TOL, spatial_size=spatial_size).mismatches


# ---------------------------------------------------------------- equivalent layouts


@pytest.mark.parametrize(
    ("layout", "spatial_size"),
    [
        ([[0, 1, 2], [3, 4, 5]], 2),
        ([[5, 3], [0, 4, 1, 2]], 2),  # any order, any sizes
        ([[0, 1, 2, 3, 4, 5], []], 2),  # an empty shard
        ([[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]], 4),  # copies over an azimuth group
        ([[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]], 2),  # the same shards in 2 data groups
    ],
    ids=["halves", "permuted", "empty", "copies", "data2"],
)
def test_shards_that_tile_the_parameter_are_equivalent_to_it(layout, spatial_size):
    assert found([rank(cols) for cols in layout], spatial_size) == []


# ---------------------------------------------------------------- coverage and fit


def test_a_position_no_rank_holds_is_a_coverage_finding_naming_the_rank_beside_it():
    assert recs(found([rank([0, 1, 2]), rank([4, 5])])) == recs(
        [
            Mismatch(
                "coverage",
                "w",
                None,
                0,
                count=1,
                total=6,
                where="1 position(s) along dim 1 held by no rank of ranks 0-1 (first: 3, next "
                "to rank 0's positions 0..2 along dim 1)",
                hint=PARAM_SHARD_HINT,
            )
        ]
    )


def test_a_position_two_different_shards_hold_is_a_coverage_finding_naming_both_ranks():
    (m,) = found([rank([0, 1, 2]), rank([2, 3, 4, 5])])
    assert (m.quantity, m.name, m.step, m.rank, m.count, m.total) == (
        "coverage",
        "w",
        None,
        1,
        1,
        6,
    )
    assert m.where == (
        "1 position(s) along dim 1 held by ranks of ranks 0-1 holding different shards (first: "
        "2, by rank 0's positions 0..2 along dim 1 and rank 1's positions 2..5 along dim 1)"
    )


def test_copies_that_hold_different_positions_are_double_owners_in_their_spatial_group():
    # ranks 0, 1 copy columns 0..2; rank 3 should copy rank 2's 3..5 but holds 2..5
    (m,) = found([rank([0, 1, 2]), rank([0, 1, 2]), rank([3, 4, 5]), rank([2, 3, 4, 5])], 4)
    assert (m.quantity, m.rank) == ("coverage", 3) and "first: 2, by rank 0's" in m.where


def test_a_hole_in_one_data_group_is_named_there_only():
    layout = [rank([0, 1, 2]), rank([3, 4, 5]), rank([0, 1, 2]), rank([3, 4])]
    (m,) = found(layout)
    assert (m.quantity, m.rank) == ("coverage", 3)  # the first hole, 5, borders rank 3's 3..4
    assert "held by no rank of ranks 2-3 (first: 5, next to rank 3's positions 3..4" in m.where


def test_positions_beyond_the_reference_parameter_are_a_coverage_finding_at_build():
    zeros = torch.zeros(2, 4, dtype=F64)
    (m,) = found([rank([0, 1, 2]), rank([3, 4, 5, 6], init=zeros, grad=zeros, after=zeros)])
    assert (m.quantity, m.step, m.rank) == ("coverage", None, 1)
    assert (
        m.where == "positions 3..6 along dim 1, outside [0, 6) of the reference's parameter (2, 6)"
    )


def test_a_whole_parameter_among_shards_is_a_coverage_finding():
    (m,) = found([rank([0, 1, 2]), rank([0, 1, 2, 3, 4, 5], shard=False)])
    assert (m.quantity, m.rank) == ("coverage", 1)
    assert m.where == "the whole parameter (2, 6) on this rank, where rank 0 hold(s) shards of it"


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        (
            rank([3, 4, 5], init=torch.zeros(3, 3, dtype=F64)),
            "a shard torch.float64 (3, 3) for positions 3..5 along dim 1, where the reference's "
            "parameter torch.float64 (2, 6) gives (2, 3)",
        ),
        (
            rank([3, 4, 5], init=torch.zeros(2, 3, dtype=torch.float32)),
            "a shard torch.float32 (2, 3) for positions 3..5 along dim 1, where the reference's "
            "parameter torch.float64 (2, 6) gives (2, 3)",
        ),
        (
            rank([0, 1], dim=2, init=torch.zeros(2, 3, 2, dtype=F64)),
            "sharded along dim 2, but the reference's parameter (2, 6) has 2 dimension(s)",
        ),
    ],
    ids=["other-size", "other-dtype", "no-such-dim"],
)
def test_a_shard_that_does_not_fit_is_a_param_finding_never_a_seeding_one(bad, where):
    (m,) = found([rank([0, 1, 2]), bad])
    assert (m.quantity, m.step, m.rank, m.where) == ("param", None, 1, where)
    assert "parameter_shards" in m.hint and "seed" not in m.hint


def test_ranks_sharding_along_different_dims_are_one_finding():
    ranks = [rank([0, 1, 2]), rank([0], dim=0, init=W[:1])]
    found_, shards = check_param_shards(reference(), ranks, Layout(2, 2))
    assert [(m.quantity, m.rank, m.where) for m in found_] == [
        ("param", None, "ranks shard it along different dims [0, 1]; shard every copy along one")
    ]
    assert shards.names == {"w"}  # left out of the whole-parameter checks all the same


# ---------------------------------------------------------------- values


def test_a_shard_that_starts_wrong_is_named_by_its_position_in_the_reference_parameter():
    init = W[:, [3, 4, 5]].clone()
    init[1, 2] += 1.0  # the reference's (1, 5)
    assert recs(found([rank([0, 1, 2]), rank([3, 4, 5], init=init)])) == recs(
        [
            Mismatch(
                "param",
                "w",
                None,
                1,
                float(init[1, 2] - W[1, 5]),
                float((init[1, 2] - W[1, 5]) / W[1, 5]),
                "initial value at (1, 5) (positions 3..5 along dim 1)",
                1,
                6,
                hint=SHARD_INIT_HINT,
            )
        ]
    )


def test_a_wrong_shard_gradient_is_named_on_the_rank_and_at_its_global_position():
    grad = GRAD[:, [3, 4, 5]].clone()
    grad[0, 1] *= 2  # the reference's (0, 4)
    (m,) = found([rank([0, 1, 2]), rank([3, 4, 5], grad=grad)])
    assert (m.quantity, m.name, m.step, m.rank, m.where) == ("grad", "w", 0, 1, "(0, 4)")


def test_a_copy_whose_gradient_was_not_summed_is_caught_on_that_copy():
    grad = GRAD[:, [0, 1, 2]] / 2  # half: the other copy's share is missing
    ranks = [rank([0, 1, 2]), rank([0, 1, 2], grad=grad), rank([3, 4, 5]), rank([3, 4, 5])]
    assert [(m.quantity, m.rank) for m in found(ranks, 4)] == [("grad", 1)]


def test_a_missing_shard_gradient_is_named_as_such():
    bad = rank([3, 4, 5])
    bad.steps[0].grads["w"] = None
    (m,) = found([rank([0, 1, 2]), bad])
    assert (m.quantity, m.rank, m.where) == (
        "grad",
        1,
        "no gradient (None) on this rank; the reference has one",
    )


def test_a_shard_off_the_reference_after_a_step_is_a_param_finding_at_its_position():
    after = AFTER[:, [3, 4, 5]].clone()
    after[1, 0] += 1e-6  # the reference's (1, 3)
    (m,) = found([rank([0, 1, 2]), rank([3, 4, 5], after=after)])
    assert (m.quantity, m.step, m.rank, m.where) == ("param", 0, 1, "(1, 3)")


# ---------------------------------------------------------------- sync between copies


def test_copies_of_a_shard_one_ulp_apart_are_a_sync_finding():
    after = AFTER[:, [3, 4, 5]].clone()
    after[0, 0] = torch.nextafter(after[0, 0], torch.tensor(10.0, dtype=F64))
    ranks = [rank([0, 1, 2]), rank([0, 1, 2]), rank([3, 4, 5]), rank([3, 4, 5], after=after)]
    assert recs(found(ranks, 4)) == recs(
        [
            Mismatch(
                "sync",
                "w",
                0,
                3,
                float(after[0, 0] - AFTER[0, 3]),
                float((after[0, 0] - AFTER[0, 3]) / AFTER[0, 3]),
                "differs from rank 2, which holds the same shard (positions 3..5 along dim 1)",
                1,
                6,
            )
        ]
    )


def test_the_same_shard_in_another_data_group_must_be_bitwise_equal_too():
    after = AFTER[:, [0, 1, 2]] * (1 + 1e-15)  # within the param tolerance, not bitwise
    ranks = [rank([0, 1, 2]), rank([3, 4, 5]), rank([0, 1, 2], after=after), rank([3, 4, 5])]
    assert [(m.quantity, m.rank, m.where[:22]) for m in found(ranks)] == [
        ("sync", 2, "differs from rank 0, w")
    ]


def test_replicated_parameters_keep_their_sync_check_next_to_shards():
    other = B.clone()
    other[0] += 1e-15
    assert [
        (m.quantity, m.name, m.rank) for m in found([rank([0, 1, 2]), rank([3, 4, 5], b=other)])
    ] == [("sync", "b", 1)]


def test_whole_and_sharded_parameters_are_judged_in_one_pass_rank_by_rank():
    # one comparison per quantity: rank 0's findings (its shard of "w", its whole "b") come
    # before rank 1's, each in the rank's own order, whole or sharded alike
    grad = GRAD[:, [3, 4, 5]] * 2
    ranks = [rank([0, 1, 2], grad=GRAD[:, [0, 1, 2]] * 2), rank([3, 4, 5], grad=grad)]
    for r in ranks:
        r.steps[0].grads["b"] = B
    assert [(m.quantity, m.name, m.rank) for m in found(ranks)] == [
        ("grad", "w", 0),
        ("grad", "b", 0),
        ("grad", "w", 1),
        ("grad", "b", 1),
    ]


# ---------------------------------------------------------------- as a case declares them

SINGLE = Topology.single()


class Sharded(SpatialCase):
    """A Linear(2, 3) whose answer to parameter_shards is given from outside."""

    dtype = torch.float64

    def __init__(self, shards=None, load=False):
        self.shards = shards or (lambda model: {})
        self.load_reference_shards = load

    def build(self, topo):
        return torch.nn.Linear(2, 3)

    def batch(self, topo, step):
        return torch.randn(4, 2)

    def forward(self, model, batch, topo):
        return Outputs((model(batch) ** 2).mean(), {})

    def parameter_shards(self, model, topo):
        return self.shards(model)


def record(shards, **kwargs):
    return run_case(Sharded(shards, kwargs.pop("load", False)), SINGLE, 1, 0.1, 0, **kwargs)


def test_a_case_records_each_shard_as_positions_along_a_non_negative_dim():
    rec = record(lambda m: {"module.weight": Shard(m.weight, slice(3, None), -2)})
    assert list(rec.param_shards) == ["weight"]
    assert rec.param_shards["weight"].index.tolist() == [3, 4, 5]
    assert rec.param_shards["weight"].dim == 0


BAD = [
    (lambda m: [m.weight], "returned a list; return a dict {parameter name: Shard"),
    (
        lambda m: {"weigth": Shard(m.weight, slice(0, 3), 0)},
        "names 'weigth', which is not a parameter of the model; name parameters as "
        "model.named_parameters() does (did you mean 'weight'?)",
    ),
    (lambda m: {"weight": m.weight}, "parameter 'weight' is given as a Parameter; give Shard"),
    (
        lambda m: {"weight": Shard(m.weight[:2], slice(0, 2), 0)},
        "parameter 'weight': Shard.values has shape (2, 2) but the parameter is (3, 2); give "
        "the parameter itself",
    ),
    (
        lambda m: {"weight": Shard(m.weight, slice(0, 3), 2)},
        "parameter 'weight': dim=2 but the parameter has 2 dimension(s) (shape (3, 2))",
    ),
    (
        lambda m: {"weight": Shard(m.weight, torch.tensor([0, 1]), 0)},
        "parameter 'weight' has 2 positions in an index of shape (2,), but the parameter has 3 "
        "values along dim 0 (shape (3, 2)); give one global position per value",
    ),
    (
        lambda m: {"weight": Shard(m.weight, torch.tensor([-1, 0, 1]), 0)},
        "parameter 'weight' has a negative position (-1)",
    ),
    (
        lambda m: {"weight": Shard(m.weight, torch.tensor([0, 0, 1]), 0)},
        "parameter 'weight' repeats a position in its index",
    ),
    (
        lambda m: {"weight": Shard(m.weight, torch.tensor([True, False, True]), 0)},
        "parameter 'weight' has a bool index (a mask); give the positions themselves",
    ),
    (
        lambda m: {"weight": Shard(m.weight, slice(0, 5), 0)},
        "parameter 'weight' has index slice(0, 5, None), 5 positions, but the parameter has 3 "
        "values along dim 0",
    ),
    (
        lambda m: {"weight": Shard(m.weight, slice(-3, None), 0)},
        "parameter 'weight' has index slice(-3, None, None); give a slice with a non-negative "
        "start",
    ),
]


@pytest.mark.parametrize(
    ("shards", "says"),
    BAD,
    ids=[
        "not-a-dict",
        "no-such-parameter",
        "not-a-shard",
        "not-the-parameter",
        "no-such-dim",
        "index-length",
        "negative",
        "repeated",
        "mask",
        "slice-length",
        "negative-slice",
    ],
)
def test_a_shard_that_cannot_be_part_of_the_parameter_is_one_error_naming_it_and_the_rank(
    shards, says
):
    with pytest.raises(ConfigError) as info:
        record(shards)
    assert str(info.value).startswith("Sharded.parameter_shards for the reference")
    assert says in str(info.value)


def test_the_reference_values_are_loaded_into_the_shards_when_the_case_asks():
    full = torch.arange(12, dtype=F64).reshape(6, 2)
    rec = record(
        lambda m: {"weight": Shard(m.weight, slice(3, 6), 0)},
        load=True,
        reference_init={"weight": full, "bias": torch.zeros(6, dtype=F64)},
    )
    assert torch.equal(rec.init["weight"], full[3:6])
    assert rec.loaded_shards == ["weight"]


def test_loading_without_shards_or_into_a_shard_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError, match="parameter_shards returned no shards, so there is"):
        record(lambda m: {}, load=True, reference_init={})
    with pytest.raises(ConfigError, match=r"the shard of 'weight' \(positions 4..6 along dim 0"):
        record(
            lambda m: {"weight": Shard(m.weight, slice(4, 7), 0)},
            load=True,
            reference_init={"weight": torch.zeros(6, 2, dtype=F64)},
        )


# ---------------------------------------------------------------- DTensor parameters


def _dtensor_model(placements, span, coordinate=(1,)):
    """A Linear(2, 4) whose weight (4, 2) is a DTensor-like holding rows ``span``."""
    from tests.unit.test_compare import Distributed, Mesh

    model = torch.nn.Linear(2, 4).double()
    whole = model.weight.detach().clone()
    dim, start, size = span
    local = whole if dim is None else whole.narrow(dim, start, size).clone()
    model._parameters["weight"] = Distributed(
        whole, local, placements, Mesh((2,), coordinate, ("spatial",))
    )
    return model, whole


def test_a_dtensor_parameter_is_a_shard_its_placements_describe():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    model, _ = _dtensor_model([DShard(0)], (0, 2, 2))
    shards = parameter_shards(Sharded(), model, SINGLE)
    assert list(shards) == ["weight"] and shards["weight"].index.tolist() == [2, 3]
    assert shards["weight"].text() == (
        "positions 2..3 along dim 0 of a Distributed (Shard(dim=0)) on a 2 mesh ('spatial',)"
    )
    replicated, _ = _dtensor_model([Replicate()], (None, 0, 0))
    assert parameter_shards(Sharded(), replicated, SINGLE) == {}


def test_a_declared_shard_of_a_dtensor_parameter_counts_its_local_values():
    from torch.distributed.tensor import Shard as DShard

    model, _ = _dtensor_model([DShard(0)], (0, 2, 2))
    # Shard.values given as the parameter: its .shape is the global (4, 2), its values 2 rows
    case = Sharded(lambda m: {"weight": Shard(m.weight, torch.tensor([3, 2]), 0)})
    shards = parameter_shards(case, model, SINGLE)
    assert shards["weight"].index.tolist() == [3, 2] and shards["weight"].how == ""
    wrong = Sharded(lambda m: {"weight": Shard(m.weight, torch.arange(4), 0)})
    with pytest.raises(ConfigError, match=r"has 4 positions .* but the parameter has 2 values"):
        parameter_shards(wrong, model, SINGLE)


def test_the_reference_init_is_loaded_into_every_parameter_whole_or_sharded():
    from torch.distributed.tensor import Shard as DShard

    model, _ = _dtensor_model([DShard(0)], (0, 2, 2))
    ref = {
        "weight": torch.arange(8, dtype=F64).reshape(4, 2),
        "bias": torch.tensor([9.0, 8.0, 7.0, 6.0], dtype=F64),
    }
    case = Sharded()
    shards = parameter_shards(case, model, SINGLE)
    assert load_init(case, model, SINGLE, shards, ref) == ["bias", "weight"]
    assert torch.equal(model.weight.to_local(), ref["weight"][2:4])  # its own rows, in place
    assert torch.equal(model.bias.detach(), ref["bias"])


def test_loading_the_reference_init_into_a_parameter_of_another_shape_is_refused():
    model = torch.nn.Linear(2, 3).double()
    with pytest.raises(ConfigError) as info:
        load_init(Sharded(), model, SINGLE, {}, {"weight": torch.zeros(6, 2), "bias": None})
    assert str(info.value) == (
        "Sharded.load_reference_init for the reference: parameter 'weight' (shape (3, 2)) does "
        "not fit the reference's (shape (6, 2)); a parameter this rank holds only part of must "
        "be named in parameter_shards"
    )


def test_run_case_loads_the_reference_init_before_recording_it():
    case = Sharded(lambda m: {"weight": Shard(m.weight, slice(3, 6), 0)})
    case.load_reference_init = True
    full = torch.arange(12, dtype=F64).reshape(6, 2)
    bias = torch.arange(3, dtype=F64)
    rec = run_case(case, SINGLE, 1, 0.1, 0, reference_init={"weight": full, "bias": bias})
    assert torch.equal(rec.init["weight"], full[3:6]) and torch.equal(rec.init["bias"], bias)
    assert rec.loaded_shards == ["bias", "weight"]


def test_a_sharded_parameters_gradient_that_comes_whole_is_cut_to_the_shards_positions():
    from torch.distributed.tensor import Partial

    from harness._rank.run import _value
    from tests.unit.test_compare import Distributed, Mesh

    whole = torch.arange(8, dtype=F64).reshape(4, 2)
    # DTensor's gradient of a Shard(0) weight left as Partial sums: gathered, then cut
    grad = Distributed(whole, whole / 2, [Partial()], Mesh((2,), (1,)))
    shard = ParamShard(torch.tensor([2, 3]), 0)
    assert torch.equal(_value(grad, shard), whole[2:4]) and grad.gathers == [1]
    # a plain tensor is recorded as given, declared shard or not
    assert torch.equal(_value(whole[2:4], shard), whole[2:4])
