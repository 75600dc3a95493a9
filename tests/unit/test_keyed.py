"""Keyed fields (``Shard.keyed``) on hand-made records: items matched by key, in any order.

Every finding is pinned whole (``same``): what the user reads is the record.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import ConfigError, Shard, Topology
from harness._judges import (
    GLOBAL_SAMPLE_HINT,
    KEY_WIDTH_HINT,
    KEYED_HINT,
    check_fields,
    check_nonfinite_step,
    compare_runs,
    key_text,
)
from harness._judges.vacuous import check_vacuous
from harness._records.run import FieldRecord, RunRecord
from harness.compare import Mismatch
from harness.equivalence import KEYED_FORM, run_case
from tests.unit.test_checks import F64, TOL, judge, same, step
from tests.unit.test_run_case import Configurable

# (sample, cell, token) keys: tokens per (sample, cell) of a 12-cell (nside 1) sphere; two
# ranks own cells 0:6 and 6:12, cell 1 of sample 0 and cell 7 of sample 1 have no token
TOKENS = np.array(
    [
        [2, 0, 1, 3, 1, 1, 2, 1, 1, 1, 2, 1],
        [1, 2, 1, 1, 1, 1, 1, 0, 3, 1, 1, 2],
    ]
)
N = int(TOKENS.sum())  # 31 items: 15 on rank 0, 16 on rank 1


def items(samples=(0, 1), cells=range(12)):
    """(keys, values) of the items of ``cells`` of ``samples``, packed sample, cell, token;
    item (s, c, t) holds ``[100 s + 10 c + t, -(100 s + 10 c + t)]``: every value differs."""
    keys = [(s, c, t) for s in samples for c in cells for t in range(TOKENS[s, c])]
    k = torch.tensor(keys, dtype=torch.long).reshape(-1, 3)
    v = (100.0 * k[:, 0] + 10.0 * k[:, 1] + k[:, 2]).to(F64)
    return k, torch.stack([v, -v], dim=1)


def keyed(keys, values, cell_column=1):
    return FieldRecord(
        values, None, 0, None, "cell", keys if keys.dim() == 2 else keys[:, None], cell_column
    )


def reference(order=None):
    k, v = items()
    if order is not None:
        k, v = k[order], v[order]
    return step(fields={"y": keyed(k, v)})


def ranks(*parts):
    return [step(fields={"y": keyed(k, v)}) for k, v in parts]


def halves():
    return [items(cells=range(6)), items(cells=range(6, 12))]


def check(parts, ref=None, spatial=None, step_no=0):
    spatial = spatial or len(parts)
    return check_fields(judge(len(parts), spatial), step_no, ref or reference(), ranks(*parts))


def test_items_match_by_key_in_any_packing_order_on_both_sides():
    (k0, v0), (k1, v1) = halves()
    g = torch.Generator().manual_seed(0)
    p0, p1 = torch.randperm(len(k0), generator=g), torch.randperm(len(k1), generator=g)
    ref = reference(order=torch.randperm(N, generator=g))  # the reference packs its own way
    assert check([(k0[p0], v0[p0]), (k1[p1], v1[p1])], ref) == ([], [])
    # a rank without items (an empty domain) holds an empty keyed field
    empty = (torch.zeros((0, 3), dtype=torch.long), torch.zeros((0, 2), dtype=F64))
    assert check([items(), empty]) == ([], [])


def test_a_dropped_item_is_charged_to_the_rank_holding_the_rest_of_its_sample_and_cell():
    (k0, v0), (k1, v1) = halves()
    found, errors = check([(k0, v0), (k1[1:], v1[1:])])  # (0, 6, 0): rank 1 keeps (0, 6, 1)
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            1,
            where="key (0, 6, 0) in cell 6 of the reference missing: this rank holds the rest "
            "of (0, 6, *)",
            count=1,
            total=N,
        ),
    )
    assert errors == []


def test_items_missing_with_their_whole_sample_and_cell_are_charged_to_the_cell_s_holder():
    (k0, v0), (k1, v1) = halves()
    found, _ = check([(k0[2:], v0[2:]), (k1, v1)])  # both tokens of (0, 0); (1, 0, 0) stays
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            0,
            where="2 keys (first: key (0, 0, 0) in cell 0) of the reference missing: this rank "
            "holds the other items of cell 0",
            count=2,
            total=N,
        ),
    )
    # the whole of cell 0 gone: no rank holds anything of it
    gone = k0[:, 1] != 0
    found, _ = check([(k0[gone], v0[gone]), (k1, v1)])
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            None,
            where="3 keys (first: key (0, 0, 0) in cell 0) of the reference held by no rank",
            count=3,
            total=N,
        ),
    )


def test_an_item_held_twice_by_one_rank_or_by_two_ranks_is_named_by_key_and_rank():
    (k0, v0), (k1, v1) = halves()
    twice = (torch.cat([k1, k1[3:4]]), torch.cat([v1, v1[3:4]]))
    found, errors = check([(k0, v0), twice])
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            1,
            where="key (0, 8, 0) in cell 8 held 2 times here",
            count=1,
            total=N,
        ),
    )
    assert errors == []
    found, _ = check([(torch.cat([k0, k1[:1]]), torch.cat([v0, v1[:1]])), (k1, v1)])
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            None,
            where="key (0, 6, 0) in cell 6 held by several ranks (first by ranks 0, 1)",
            count=1,
            total=N,
        ),
    )


def test_an_item_not_in_the_reference_is_named_by_key_and_rank():
    (k0, v0), (k1, v1) = halves()
    extra_k = torch.tensor([[1, 7, 0], [1, 7, 1]])  # cell 7 of sample 1 has no token
    extra = (torch.cat([k1, extra_k]), torch.cat([v1, torch.zeros(2, 2, dtype=F64)]))
    found, _ = check([(k0, v0), extra])
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            1,
            where="2 keys (first: key (1, 7, 0) in cell 7) not in the reference",
            count=2,
            total=N,
        ),
    )


def test_a_wrong_value_is_named_by_key_cell_and_owner_and_feeds_a_cell_error_map():
    (k0, v0), (k1, v1) = halves()
    g = torch.Generator().manual_seed(1)
    p1 = torch.randperm(len(k1), generator=g)
    k1, v1 = k1[p1], v1[p1].clone()
    bad = int(((k1 == torch.tensor([1, 8, 2])).all(1)).nonzero())
    v1[bad, 1] += 0.5
    found, errors = check([(k0, v0), (k1, v1)])
    worst = 0.5 / 182.0  # item (1, 8, 2) holds -182 in column 1
    same(
        found,
        Mismatch(
            "field", "y", 0, None, 0.5, worst, "[1] key (1, 8, 2) in cell 8 on rank 1", 1, 2 * N
        ),
    )
    (err,) = errors
    assert (err.name, err.step, err.data_group, err.grid, err.unit) == ("y", 0, 0, None, "cell")
    assert err.error.tolist() == [0.0] * 8 + [0.5] + [0.0] * 3
    assert err.owners.tolist() == [0] * 6 + [1] * 6


def test_a_nan_in_an_item_is_named_by_key_as_nonfinite_and_as_a_field_difference():
    (k0, v0), (k1, v1) = halves()
    v0 = v0.clone()
    v0[3, 0] = math.nan  # item (0, 3, 0)
    parts = [(k0, v0), (k1, v1)]
    found, _ = check(parts)
    same(
        found,
        Mismatch(
            "field",
            "y",
            0,
            None,
            math.inf,
            math.inf,
            "[0] key (0, 3, 0) in cell 3 on rank 0",
            1,
            2 * N,
        ),
    )
    nonfinite = check_nonfinite_step(0, reference(), ranks(*parts))
    same(
        [m for m in nonfinite if m.of == "field"],
        Mismatch(
            "nonfinite",
            "y",
            0,
            0,
            where="[0] key (0, 3, 0) in cell 3 (1 NaN)",
            count=1,
            total=v0.numel(),
            of="field",
        ),
    )


def test_a_nonfinite_reference_item_is_named_by_key_as_the_reference_s():
    k, v = items()
    v[5, 1] = math.inf
    ref = step(fields={"y": keyed(k, v, cell_column=None)})
    nonfinite = check_nonfinite_step(0, ref, [])
    same(
        [m for m in nonfinite if m.of == "field"],
        Mismatch(
            "nonfinite",
            "y",
            0,
            None,
            where="[1] key (0, 3, 2) (1 inf)",
            count=1,
            total=v.numel(),
            run="reference",
            of="field",
        ),
    )


def test_coverage_and_values_are_both_reported_and_no_error_map_is_drawn_with_holes():
    (k0, v0), (k1, v1) = halves()
    v0 = v0.clone()
    v0[0, 0] += 1.0  # item (0, 0, 0): value 0 -> 1, judged by atol alone
    found, errors = check([(k0, v0), (k1[1:], v1[1:])])
    assert [(m.quantity, m.rank, m.where) for m in found] == [
        (
            "coverage",
            1,
            "key (0, 6, 0) in cell 6 of the reference missing: this rank holds the rest of "
            "(0, 6, *)",
        ),
        ("field", None, "[0] key (0, 0, 0) in cell 0 on rank 0"),
    ]
    assert errors == []


def test_with_data_groups_items_are_matched_across_all_groups_by_global_sample():
    # two data groups of two ranks: group g holds sample g
    parts = [
        items((0,), range(6)),
        items((0,), range(6, 12)),
        items((1,), range(6)),
        items((1,), range(6, 12)),
    ]
    assert check(parts, spatial=2) == ([], [])
    # group 1 keys its sample locally (0, not 1): sample 1 is held by no rank (but cell 1,
    # where sample 0 has no token, by rank 2 alone), the tokens both samples have are held
    # twice (by groups 0 and 1), the rest are not in the reference
    local = [(torch.cat([k[:, :1] - 1, k[:, 1:]], 1), v) for k, v in parts[2:]]
    found, errors = check([*parts[:2], *local], spatial=2)
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            None,
            where="13 keys (first: key (1, 0, 0) in cell 0) of the reference held by no rank",
            count=13,
            total=N,
        ),
        Mismatch(
            "coverage",
            "y",
            0,
            2,
            where="2 keys (first: key (1, 1, 0) in cell 1) of the reference missing: this rank "
            "holds the other items of cell 1",
            count=2,
            total=N,
        ),
        Mismatch(
            "coverage",
            "y",
            0,
            None,
            where="10 keys (first: key (0, 0, 0) in cell 0) held by several ranks (first by "
            "ranks 0, 2)",
            count=10,
            total=N,
            hint=GLOBAL_SAMPLE_HINT,
        ),
        Mismatch(
            "coverage",
            "y",
            0,
            2,
            where="2 keys (first: key (0, 1, 0) in cell 1) not in the reference",
            count=2,
            total=N,
        ),
        Mismatch(
            "coverage",
            "y",
            0,
            3,
            where="3 keys (first: key (0, 8, 1) in cell 8) not in the reference",
            count=3,
            total=N,
        ),
    )
    assert errors == []


def test_samples_keyed_locally_in_data_groups_are_the_likely_cause():
    parts = [
        items((0,), range(6)),
        items((0,), range(6, 12)),
        *[(torch.cat([k[:, :1] - 1, k[:, 1:]], 1), v) for k, v in (items((1,), range(6)),)],
        *[(torch.cat([k[:, :1] - 1, k[:, 1:]], 1), v) for k, v in (items((1,), range(6, 12)),)],
    ]
    ref = RunRecord(init={}, steps=[reference()])
    recs = [
        RunRecord(init={}, steps=[s], spatial_rank=r % 2, spatial_size=2)
        for r, s in enumerate(ranks(*parts))
    ]
    assert compare_runs(ref, recs, TOL, spatial_size=2).likely == GLOBAL_SAMPLE_HINT


def test_data_groups_error_maps_are_per_group():
    parts = [
        items((0,), range(6)),
        items((0,), range(6, 12)),
        items((1,), range(6)),
        items((1,), range(6, 12)),
    ]
    k, v = parts[3]
    v = v.clone()
    v[-1] += 3.0  # item (1, 11, 1)
    found, errors = check([*parts[:3], (k, v)], spatial=2)
    assert [(m.quantity, m.where) for m in found] == [
        ("field", "[0] key (1, 11, 1) in cell 11 on rank 3")
    ]
    (err,) = errors
    assert err.data_group == 1 and err.owners.tolist() == [2] * 6 + [3] * 6
    assert err.error.tolist() == [0.0] * 11 + [3.0]


def test_a_plain_reference_tensor_is_keyed_by_row_for_one_dimensional_keys_only():
    ref = step(fields={"y": FieldRecord(torch.arange(4.0, dtype=F64))})
    one_d = [
        FieldRecord(torch.tensor([3.0, 0.0], dtype=F64), None, 0, keys=torch.tensor([[3], [0]])),
        FieldRecord(torch.tensor([1.0, 2.0], dtype=F64), None, 0, keys=torch.tensor([[1], [2]])),
    ]
    found, _ = check_fields(judge(2, 2), 0, ref, [step(fields={"y": f}) for f in one_d])
    assert found == []
    one_d[1].values[1] = 2.5
    found, _ = check_fields(judge(2, 2), 0, ref, [step(fields={"y": f}) for f in one_d])
    same(found, Mismatch("field", "y", 0, None, 0.5, 0.25, "key 2 on rank 1", 1, 4))
    plain = step(fields={"y": FieldRecord(torch.tensor([1.0, 2.5], dtype=F64))})
    found, _ = check_fields(judge(2, 2), 0, ref, [step(fields={"y": one_d[0]}), plain])
    assert [(m.quantity, m.rank, m.where) for m in found] == [
        ("field", 1, "a plain tensor of shape (2,) where other ranks return keyed items"),
        ("coverage", None, "2 keys (first: key 1) of the reference held by no rank"),
    ]
    (k0, v0), (k1, v1) = halves()
    found, _ = check_fields(
        judge(2, 2), 0, step(fields={"y": FieldRecord(v0)}), ranks((k0, v0), (k1, v1))
    )
    same(
        found,
        Mismatch(
            "field",
            "y",
            0,
            None,
            where="a plain tensor of shape (15, 2) where the ranks return keyed items (keys "
            "of 3 columns)",
            hint=KEYED_HINT,
            run="reference",
        ),
    )


def test_refused_keyed_shards_name_the_rank_and_the_fix():
    (k0, v0), (k1, v1) = halves()
    found, _ = check_fields(
        judge(2, 2), 0, reference(), [*ranks((k0, v0)), step(fields={"y": FieldRecord(v1)})]
    )
    plain = Mismatch(
        "field",
        "y",
        0,
        1,
        where="a plain tensor of shape (16, 2) where the reference's field is keyed items",
        hint=KEYED_HINT,
    )
    hole = Mismatch(
        "coverage",
        "y",
        0,
        None,
        where="16 keys (first: key (0, 6, 0) in cell 6) of the reference held by no rank",
        count=16,
        total=N,
    )
    same(found, plain, hole)
    found, _ = check([(k0, v0), (k1[:, :2], v1)])
    same(
        found,
        Mismatch(
            "field",
            "y",
            0,
            1,
            where="keys of 2 columns where the reference's have 3 columns",
            hint=KEY_WIDTH_HINT,
        ),
        hole,
    )
    found, _ = check([(k0, v0), (k1, v1.to(torch.float32))])
    same(
        found,
        Mismatch(
            "field",
            "y",
            0,
            1,
            where="items torch.float32 (2,) where the reference's are torch.float64 (2,) "
            "(items run along dim 0)",
        ),
    )


def test_keys_held_twice_by_the_reference_are_the_reference_s_finding():
    k, v = items()
    ref = step(fields={"y": keyed(torch.cat([k, k[:1]]), torch.cat([v, v[:1]]))})
    found, _ = check(halves(), ref)
    same(
        found,
        Mismatch(
            "coverage",
            "y",
            0,
            None,
            where="key (0, 0, 0) in cell 0 held more than once in the reference",
            count=1,
            total=N + 1,
            hint="the reference must name each item once",
            run="reference",
        ),
    )


def test_a_keyed_field_skips_the_batch_trap_and_the_whole_run_compares():
    # items along dim 0 are not samples: 4 ranks in 2 data groups, 32 items in all
    parts = [
        items((0,), range(6)),
        items((0,), range(6, 12)),
        items((1,), range(6)),
        items((1,), range(6, 12)),
    ]
    ref = RunRecord(init={}, steps=[reference()])
    recs = [
        RunRecord(init={}, steps=[s], spatial_rank=r % 2, spatial_size=2)
        for r, s in enumerate(ranks(*parts))
    ]
    assert compare_runs(ref, recs, TOL, spatial_size=2).mismatches == []


def test_a_rank_holding_every_item_is_vacuous():
    ref = RunRecord(init={}, steps=[reference()])
    whole = [RunRecord(init={}, steps=ranks(items())) for _ in range(2)]
    (m,) = check_vacuous("case", ref, whole, 2)
    assert m.where == ("every rank's Shard of 'y' covers the whole domain: the ranks split nothing")
    split = [RunRecord(init={}, steps=[s]) for s in ranks(*halves())]
    assert check_vacuous("case", ref, split, 2) == []


@pytest.mark.parametrize(
    ("key", "column", "text"),
    [
        ([7], None, "key 7"),
        ([0, 5, 2], None, "key (0, 5, 2)"),
        ([0, 5, 2], 1, "key (0, 5, 2) in cell 5"),
    ],
    ids=["1d", "3d", "3d_cell"],
)
def test_key_text_names_an_item(key, column, text):
    assert key_text(key, column) == text


# ---------------------------------------------------------------- what forward returns


def _keyed(keys, values=None, **kw):
    values = torch.zeros(3, 2) if values is None else values
    return Configurable(fields={"y": Shard.keyed(values, keys, **kw)})


WHERE = "Configurable.forward: Shard.keyed of field 'y'"


@pytest.mark.parametrize(
    ("case", "says"),
    [
        (
            _keyed(torch.tensor([0.0, 1.0, 2.0])),
            f"{WHERE} has float32 keys; keys must be integers (torch.long): items are matched "
            "by exact key, so cast the ids you pack, not values computed from them",
        ),
        (
            _keyed(torch.tensor([True, False, True])),
            f"{WHERE} has bool keys; keys must be integers (torch.long): items are matched by "
            "exact key, so cast the ids you pack, not values computed from them",
        ),
        (
            _keyed(torch.zeros(3, 2, 1, dtype=torch.long)),
            f"{WHERE} has keys of shape (3, 2, 1); give {KEYED_FORM}",
        ),
        (
            _keyed(torch.zeros(3, 0, dtype=torch.long)),
            f"{WHERE} has keys of shape (3, 0); give {KEYED_FORM}",
        ),
        (
            _keyed("abc"),
            f"{WHERE} has keys of type str; give {KEYED_FORM}",
        ),
        (
            _keyed(torch.arange(2)),
            f"{WHERE} has 2 keys but 3 items along dim 0 of its values (shape (3, 2)); one key "
            "(row) per item: items run along dim 0, so move the item dim first "
            "(values.movedim(d, 0))",
        ),
        (
            _keyed(torch.arange(3), torch.tensor(1.0)),
            f"{WHERE} has values that are a 0-d tensor; give {KEYED_FORM}",
        ),
        (
            _keyed(torch.zeros(3, 3, dtype=torch.long), cell_column=3),
            f"{WHERE} has cell_column=3 but its keys have 3 column(s); give the index of the "
            "column holding the cell, 0..2",
        ),
        (
            _keyed(torch.tensor([[0, -1], [0, 2], [0, 3]]), cell_column=1),
            f"{WHERE} has a negative cell (-1) in key column 1; cells are HEALPix NESTED ids "
            "counting from 0",
        ),
        (
            Configurable(fields={"y": Shard(torch.zeros(3, 1), None)}),
            "Configurable.forward: Shard of field 'y' has no index (None); give Shard(values, "
            f"index, dim) for positions, or {KEYED_FORM}",
        ),
    ],
    ids=[
        "float",
        "bool",
        "3d",
        "no-columns",
        "str",
        "length",
        "scalar-values",
        "cell-column",
        "negative-cell",
        "no-index",
    ],
)
def test_bad_keys_are_one_clear_error_naming_the_field_and_the_fix(case, says):
    with pytest.raises(ConfigError) as info:
        run_case(case, Topology.single(), steps=1, lr=0.1, seed=0)
    assert str(info.value) == says


def test_keys_are_recorded_as_long_rows_and_pinned_by_goldens():
    case = _keyed([[0, 5, 1], [0, 5, 0], [1, 2, 0]], cell_column=1)
    record = run_case(case, Topology.single(), steps=1, lr=0.1, seed=0)
    f = record.steps[0].fields["y"]
    assert (f.keys.tolist(), f.keys.dtype, f.cell_column, f.unit, f.index, f.dim) == (
        [[0, 5, 1], [0, 5, 0], [1, 2, 0]],
        torch.long,
        1,
        "cell",
        None,
        0,
    )
    assert record.flat()["step0/keys/y"].tolist() == [[0, 5, 1], [0, 5, 0], [1, 2, 0]]
    one_d = run_case(_keyed([4, 0, 2]), Topology.single(), steps=1, lr=0.1, seed=0)
    empty = run_case(
        _keyed(torch.zeros(0, dtype=torch.long), torch.zeros(0, 2)),
        Topology.single(),
        steps=1,
        lr=0.1,
        seed=0,
    )
    assert one_d.steps[0].fields["y"].keys.tolist() == [[4], [0], [2]]
    assert tuple(empty.steps[0].fields["y"].keys.shape) == (0, 1)


# ---------------------------------------------------------------- any split, any packing


@settings(max_examples=40, deadline=None, database=None)
@given(
    owner=st.lists(st.integers(0, 2), min_size=N, max_size=N),
    seed=st.integers(0, 2**16),
    dropped=st.sets(st.integers(0, N - 1), max_size=4),
)
def test_any_split_in_any_order_passes_and_each_dropped_item_is_counted_once(owner, seed, dropped):
    k, v = items()
    g = torch.Generator().manual_seed(seed)
    owner_t = torch.tensor(owner)
    parts = []
    for r in range(3):
        mine = [i for i in (owner_t == r).nonzero().flatten().tolist() if i not in dropped]
        order = torch.tensor(mine, dtype=torch.long)[torch.randperm(len(mine), generator=g)]
        parts.append((k[order], v[order]))
    found, errors = check(parts)
    assert errors == []
    assert all(m.quantity == "coverage" for m in found)
    assert sum(m.count for m in found) == len(dropped)  # missing, charged or not: once each
