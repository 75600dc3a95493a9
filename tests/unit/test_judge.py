"""The judge (harness/_judges/judge.py) on hand-made records: the hints a comparison
under its bound gives (scale, float32 rounding) and how values and positions are written."""

from __future__ import annotations

import pytest
import torch

from harness._judges import (
    compare_runs,
    data_part,
    position_text,
    two_values,
)
from tests.unit._judging import (
    F64,
    TOL,
    run,
    step,
)

# ---------------------------------------------------------------- hints of the comparison


def test_a_gradient_s_times_too_large_is_named_so():
    ranks = [run(step(grad=torch.tensor([2.0, 4.0], dtype=F64))) for _ in range(2)]
    found = compare_runs(run(), ranks, TOL, spatial_size=2).mismatches
    grads = [m for m in found if m.quantity == "grad"]
    assert [m.rank for m in grads] == [0, 1]
    assert grads[0].hint.startswith("exactly 2x the reference")


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


def test_two_values_adds_digits_until_they_differ():
    a = torch.tensor(1.0000000001, dtype=F64)
    assert two_values(a, torch.tensor(1.0, dtype=F64)) == "1.0000000001 vs reference 1"
    assert two_values(torch.tensor(3.0), torch.tensor(2.0)) == "3 vs reference 2"


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


# ---------------------------------------------------------------- many pairs at once


def test_judging_many_pairs_at_once_finds_and_counts_what_one_by_one_does():
    from harness._judges.judge import Numeric
    from harness.compare import Mismatch, Quantity
    from tests.unit._judging import judge as judge_of

    e = torch.linspace(1, 2, 6, dtype=F64)
    near = e + 1e-13  # within the float64 bound: passes, and counts in the statistics
    far = e.clone()
    far[3] += 1e-3  # over it
    nan = e.clone()
    nan[1] = float("nan")
    calls = [
        Numeric(Quantity.GRAD, "w", 0, 0, near, e),
        Mismatch(Quantity.GRAD, "b", 0, 1, where="no gradient (None) on this rank"),
        Numeric(Quantity.GRAD, "w", 0, 1, far, e),
        Numeric(Quantity.PARAM, "w", 0, 0, nan, e),
        Numeric(Quantity.LOSS, "loss", 0, 0, e[:1] + 1e-14, e[:1]),
        Numeric(Quantity.PARAM, "w", 0, 1, near.float(), e.float()),
    ]
    together, alone = judge_of(2, 2), judge_of(2, 2)
    found = together.numeric_all(calls)
    expected = [c if isinstance(c, Mismatch) else alone.numeric(*c) for c in calls]
    assert list(map(repr, found)) == [repr(m) for m in expected if m is not None]  # NaN != NaN
    assert [m.name for m in found] == ["b", "w", "w"] and found[1].where == "(3,)"
    assert repr(together.stats) == repr(alone.stats)
    assert together.stats[Quantity.GRAD].compared == 2 and together.stats[Quantity.GRAD].max_abs > 0
