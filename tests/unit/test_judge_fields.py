"""Fields (harness/_judges/fields.py) on hand-made records: full tensors rank by rank, or
shards reassembled per data group, their coverage, and every finding's position and owner."""

from __future__ import annotations

import torch

from harness import Shard
from harness._judges import (
    BATCH_HINT,
    SHARD_HINT,
    Judge,
    Layout,
    check_fields,
)
from harness._records.run import FieldRecord, StepRecord
from harness.compare import NUMERIC, Mismatch, QuantityStats, Tolerance
from tests.unit._judging import (
    F64,
    field,
    judge,
    recs,
    same,
    shard,
    step,
)

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


# ---------------------------------------------------------------- whole records


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
