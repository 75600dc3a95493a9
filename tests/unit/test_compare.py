"""compare.py: the elementwise rule, its edge cases, and the texts built on it.

Each test pins one rule at its boundary, so that loosening or dropping the line that
implements it fails here (the mutation tox env checks that it does).
"""

from __future__ import annotations

import math
import pickle
import re

import pytest
import torch

from harness._base.values import block, is_distributed, placed, plain
from harness.compare import (
    REMEDIES,
    Bound,
    Difference,
    EquivalenceReport,
    Mismatch,
    QuantityStats,
    Tolerance,
    bits_differ,
    bitwise_equal,
    compare_tensors,
    equivalence_table,
    format_table,
    mismatch_table,
    nonfinite_counts,
    nonfinite_text,
    scale_hint,
)
from harness.errors import EquivalenceFailure, HarnessError

NAN, INF = math.nan, math.inf
F64 = torch.float64


def t(*values: float, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------- the bound


@pytest.mark.parametrize(
    ("actual", "ok"),
    [(3.0, True), (1.0, True), (3.0 + 1e-12, False), (1.0 - 1e-12, False)],
    ids=["upper-edge", "lower-edge", "just-over", "just-under"],
)
def test_the_bound_is_atol_plus_rtol_times_the_reference_inclusive(actual, ok):
    # expected 2, rtol 0.25, atol 0.5: allowed |diff| <= 0.5 + 0.25 * 2 = 1.0 exactly
    d = compare_tensors(t(actual), t(2.0), Bound(rtol=0.25, atol=0.5))
    assert d.ok is ok
    assert d.count == (0 if ok else 1)


def test_rtol_scales_with_the_reference_not_the_actual_value():
    # |101 - 100| = 1 <= 0.01 * 100; measured against |actual| = 101 it would also pass, so
    # take a case where the two differ: expected 100, actual 98.99 (diff 1.01 > 1.0)
    assert compare_tensors(t(101.0), t(100.0), Bound(0.01, 0.0)).ok
    assert not compare_tensors(t(98.99), t(100.0), Bound(0.01, 0.0)).ok
    assert compare_tensors(t(-101.0), t(-100.0), Bound(0.01, 0.0)).ok  # |expected|


def test_atol_alone_holds_near_zero():
    assert compare_tensors(t(1e-3), t(0.0), Bound(0.0, 1e-3)).ok
    assert not compare_tensors(t(1.1e-3), t(0.0), Bound(0.0, 1e-3)).ok


def test_exact_bound_refuses_one_ulp():
    x = torch.tensor([1.0], dtype=F64)
    assert not compare_tensors(torch.nextafter(x, t(2.0)), x, Bound(0.0, 0.0)).ok


def test_the_numbers_name_the_worst_element():
    actual = t(1.0, 2.5, 3.0, 10.0)
    expected = t(1.0, 2.0, 3.0, 8.0)
    d = compare_tensors(actual, expected, Bound(0.0, 0.1))
    assert (d.ok, d.count, d.total, d.worst) == (False, 2, 4, 3)
    assert d.max_abs == 2.0
    assert d.max_rel == 0.25  # 0.5 / 2.0 = 0.25, 2.0 / 8.0 = 0.25
    assert d.nonfinite == 0 and d.nonfinite_at is None


def test_relative_error_leaves_out_entries_within_atol_of_zero():
    # 1e-7 against 1e-9 is a relative error of 99, but |expected| <= atol: judged by atol only
    d = compare_tensors(t(1e-7, 1.5), t(1e-9, 1.0), Bound(0.0, 1e-6))
    assert d.max_rel == 0.5
    assert d.count == 1 and d.worst == 1


def test_equal_values_have_zero_error():
    d = compare_tensors(t(1.0, -2.0), t(1.0, -2.0), Bound(0.0, 0.0))
    assert (d.ok, d.max_abs, d.max_rel, d.count, d.total) == (True, 0.0, 0.0, 0, 2)


# ---------------------------------------------------------------- non-finite values


@pytest.mark.parametrize(
    ("actual", "expected"),
    [
        (1.0, NAN),
        (NAN, 1.0),
        (NAN, NAN),
        (INF, INF),
        (-INF, -INF),
        (1.0, INF),
        (INF, 1.0),
        (INF, -INF),
        (INF, NAN),
    ],
    ids=[
        "ref-nan",
        "actual-nan",
        "both-nan",
        "both-inf",
        "both-minus-inf",
        "ref-inf",
        "actual-inf",
        "inf-vs-minus-inf",
        "inf-vs-nan",
    ],
)
def test_a_nan_or_inf_on_either_side_fails_even_when_both_match(actual, expected):
    d = compare_tensors(t(0.0, actual), t(0.0, expected), Bound(1e-5, 1e-7))
    assert not d.ok
    assert (d.count, d.nonfinite, d.nonfinite_at, d.worst) == (1, 1, 1, 1)
    assert d.max_abs == INF and d.max_rel == INF


@pytest.mark.parametrize(
    ("actual", "expected", "ok"),
    [
        (NAN, NAN, True),
        (INF, INF, True),
        (-INF, -INF, True),
        (1.0, NAN, False),
        (NAN, 1.0, False),
        (INF, -INF, False),
        (NAN, INF, False),
        (1.0, INF, False),
    ],
    ids=["nan", "inf", "minus-inf", "ref-nan", "actual-nan", "sign", "nan-vs-inf", "ref-inf"],
)
def test_allowed_nonfinite_values_must_match_position_for_position(actual, expected, ok):
    d = compare_tensors(t(actual, 2.0), t(expected, 2.0), Bound(1e-5, 1e-7), allow_nonfinite=True)
    assert d.ok is ok
    assert d.nonfinite == (0 if ok else 1)
    assert d.count == (0 if ok else 1)
    assert d.max_abs == (0.0 if ok else INF)


def test_finite_positions_are_still_judged_next_to_allowed_nan():
    d = compare_tensors(t(NAN, 3.0), t(NAN, 2.0), Bound(0.0, 0.5), allow_nonfinite=True)
    assert (d.ok, d.count, d.max_abs, d.worst) == (False, 1, 1.0, 1)


def test_nonfinite_counts_and_text():
    assert nonfinite_counts(t(1.0, NAN, INF, NAN, -INF)) == (2, 2, 1)
    assert nonfinite_counts(t(1.0, 2.0)) == (0, 0, None)
    assert nonfinite_counts(torch.tensor([1, 2])) == (0, 0, None)
    assert nonfinite_counts(torch.zeros(0)) == (0, 0, None)
    assert nonfinite_counts(torch.tensor([1 + 1j, complex(1, NAN)])) == (1, 0, 1)
    assert nonfinite_text(2, 0) == "2 NaN"
    assert nonfinite_text(0, 1) == "1 inf"
    assert nonfinite_text(1, 3) == "1 NaN, 3 inf"


# ---------------------------------------------------------------- dtypes and shapes


def test_complex_values_are_judged_by_the_modulus_of_the_difference():
    e = torch.tensor([1 + 0j], dtype=torch.complex128)
    # |0.36 + 0.48j| = 0.6 > 0.5, although each component is within 0.5
    assert not compare_tensors(e + (0.36 + 0.48j), e, Bound(0.0, 0.5)).ok
    # |0.3 + 0.4j| = 0.5: on the bound
    assert compare_tensors(e + (0.3 + 0.4j), e, Bound(0.0, 0.5)).ok


def test_complex_nan_in_one_component_is_nonfinite():
    a = torch.tensor([complex(1, NAN)], dtype=torch.complex128)
    b = torch.tensor([complex(1, NAN)], dtype=torch.complex128)
    assert not compare_tensors(a, b, Bound(0, 0)).ok
    assert compare_tensors(a, b, Bound(0, 0), allow_nonfinite=True).ok
    c = torch.tensor([complex(NAN, 1)], dtype=torch.complex128)  # NaN elsewhere: differs
    assert not compare_tensors(a, c, Bound(0, 0), allow_nonfinite=True).ok


@pytest.mark.parametrize(
    ("complex_dtype", "real_dtype"),
    [(torch.complex128, torch.float64), (torch.complex64, torch.float32)],
)
def test_complex_tensors_get_the_tolerance_of_their_real_dtype(complex_dtype, real_dtype):
    assert Tolerance.for_dtype(complex_dtype) == Tolerance.for_dtype(real_dtype)
    assert Tolerance.for_dtype(complex_dtype) != Tolerance.exact()


def test_default_tolerances_per_dtype():
    f64 = Tolerance.for_dtype(torch.float64)
    assert f64 == Tolerance.uniform(1e-10, 1e-12)
    f32 = Tolerance.for_dtype(torch.float32)
    assert (f32.loss, f32.grad, f32.field, f32.param) == (
        Bound(1e-5, 1e-7),
        Bound(1e-4, 1e-6),
        Bound(1e-5, 3e-6),
        Bound(1e-5, 1e-6),
    )
    assert Tolerance.for_dtype(torch.bfloat16) == Tolerance.uniform(2e-2, 1e-3)
    assert Tolerance.for_dtype(torch.float16) == Tolerance.uniform(2e-2, 1e-3)
    assert Tolerance.for_dtype(torch.int64) == Tolerance.exact() == Tolerance.uniform(0, 0)
    assert f64.with_(grad=(1.0, 2.0)).grad == Bound(1.0, 2.0)
    assert f64.with_(grad=Bound(3.0, 4.0)).bound("grad") == Bound(3.0, 4.0)
    assert f64.with_(grad=(1.0, 2.0)).loss == f64.loss


@pytest.mark.parametrize(("rtol", "atol"), [(-1.0, 0.0), (0.0, -1e-9), (NAN, 0.0)])
def test_a_negative_or_nan_tolerance_is_refused(rtol, atol):
    with pytest.raises(ValueError, match="tolerances must be >= 0"):
        Bound(rtol, atol)


def test_empty_tensors_are_equal():
    d = compare_tensors(torch.zeros(0, 3), torch.zeros(0, 3), Bound(0, 0))
    assert (d.ok, d.count, d.total, d.worst, d.problem) == (True, 0, 0, None, "")


def test_denormals_are_compared_not_flushed():
    tiny = torch.tensor([5e-324], dtype=F64)  # the smallest subnormal
    zero = torch.zeros(1, dtype=F64)
    d = compare_tensors(zero, tiny, Bound(0.0, 0.0))
    assert not d.ok and d.max_abs == 5e-324 and d.max_rel == 1.0
    assert compare_tensors(zero, tiny, Bound(0.0, 1e-300)).ok
    assert compare_tensors(tiny, tiny, Bound(0.0, 0.0)).ok


def test_a_dtype_difference_is_a_problem_not_a_number():
    d = compare_tensors(t(1.0, dtype=torch.float32), t(1.0), Bound(1.0, 1.0))
    assert not d.ok
    assert d.problem == "dtype torch.float32 where the reference has torch.float64"
    assert math.isnan(d.max_abs) and (d.count, d.total, d.worst) == (0, 1, None)


def test_a_shape_difference_is_a_problem_not_a_number():
    d = compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2), Bound(1.0, 1.0))
    assert not d.ok and d.problem == "shape (2, 3) where the reference has (3, 2)"
    assert d.total == 6


def test_integers_are_exact_beyond_float64_precision():
    big = 2**53
    d = compare_tensors(torch.tensor([big + 1, 5]), torch.tensor([big, 5]), Bound(1.0, 1.0))
    assert (d.ok, d.count, d.worst) == (False, 1, 0)
    assert d.max_abs >= 1.0
    assert compare_tensors(torch.tensor([3, 4]), torch.tensor([3, 4]), Bound(0, 0)).ok
    assert not compare_tensors(torch.tensor([True]), torch.tensor([False]), Bound(1, 1)).ok


# ---------------------------------------------------------------- bits


def test_bitwise_equality_sees_one_ulp_and_the_sign_of_zero():
    x = torch.tensor([1.0, 2.0], dtype=torch.float32)
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(3.0))
    assert not bitwise_equal(x, y)
    assert bits_differ(x, y) == 1
    assert bitwise_equal(x, x.clone())
    assert bits_differ(x, x.clone()) == 0
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(x, x.double())
    assert not bitwise_equal(x, x.reshape(2, 1))


def test_the_same_nan_is_bitwise_equal():
    nan = torch.tensor([NAN, 1.0])
    assert bitwise_equal(nan, nan.clone())
    assert bitwise_equal(torch.tensor(NAN), torch.tensor(NAN))  # 0-d


# ---------------------------------------------------------------- hints


def test_scale_hint_names_a_factor_of_the_group_size():
    e = t(1.0, -2.0, 3.0)
    assert scale_hint(4 * e, e, 4).startswith("exactly 4x the reference")
    assert scale_hint(e / 4, e, 4).startswith("exactly 1/4 of the reference")
    assert scale_hint(torch.zeros(3, dtype=F64), e, 4).startswith("all zeros on this rank")
    assert scale_hint(3 * e, e, 4) == ""  # another factor: no telltale
    assert scale_hint(e + t(0.1, 0.0, 0.0), e, 4) == ""  # not a pure factor
    assert scale_hint(4 * e, e, 1) == ""  # one rank: no group to blame
    assert scale_hint(e, torch.zeros(3, dtype=F64), 4) == ""
    assert scale_hint(t(NAN, 1.0, 1.0), e, 4) == ""


E3 = (1.0, -2.0, 3.0)
ZEROS = (
    "all zeros on this rank: is the parameter out of the graph, or its gradient never synchronised?"
)
EE = 14.0  # sum of squares of E3: the hint's residual is relative to it
ORTHO = (2.0, 1.0, 0.0)  # orthogonal to E3
FOUR = "exactly 4x the reference: a reduction counted 4 times"
QUARTER = "exactly 1/4 of the reference: averaged where it should sum"


def _plus(factor: float, left: float) -> tuple[float, ...]:
    """``factor`` x E3 plus a part orthogonal to it of norm ``left`` x |E3|."""
    k = left * (EE / 5.0) ** 0.5  # |ORTHO|^2 = 5
    return tuple(factor * e + k * o for e, o in zip(E3, ORTHO))


@pytest.mark.parametrize(
    ("actual", "expected", "size", "hint"),
    [
        ((4.0, -8.0, 12.0), E3, 4, "exactly 4x the reference: a reduction counted 4 times"),
        ((0.25, -0.5, 0.75), E3, 4, "exactly 1/4 of the reference: averaged where it should sum"),
        ((2.0, -4.0, 6.0), E3, 2, "exactly 2x the reference: a reduction counted 2 times"),
        # float64's window is its gradient tolerance, rtol 1e-10: inside it, and just outside
        # (a logic bug that comes out near 4 is no factor)
        (tuple(4 * (1 + 0.9e-10) * v for v in E3), E3, 4, FOUR),
        (tuple(4 * (1 + 1.1e-10) * v for v in E3), E3, 4, ""),
        (tuple(4 * (1 + 1e-3) * v for v in E3), E3, 4, ""),  # the old window: a near miss
        (tuple(v / 4 * (1 - 0.9e-10) for v in E3), E3, 4, QUARTER),
        (tuple(v / 4 * (1 - 1.1e-10) for v in E3), E3, 4, ""),
        # what is left beside the factor, relative to |e|: 0.9e-10 is still a pure factor,
        # 1.1e-10 is not (ORTHO is orthogonal to E3, so the factor stays exactly 4)
        (_plus(4, 0.9e-10), E3, 4, FOUR),
        (_plus(4, 1.1e-10), E3, 4, ""),
        ((3.0, -6.0, 9.0), E3, 4, ""),  # another factor: no telltale
        ((4.0, -8.0, 12.0), E3, 1, ""),  # one rank: no group to blame
        (
            (0.0, 0.0, 0.0),
            E3,
            4,
            ZEROS,
        ),
        (
            (0.0, 0.0, 0.0),
            E3,
            1,
            ZEROS,
        ),
        (E3, (0.0, 0.0, 0.0), 4, ""),  # nothing to scale
        ((NAN, 1.0, 1.0), E3, 4, ""),
        (E3, (1.0, INF, 1.0), 4, ""),
        ((4.0, -8.0), (*E3[:2], 1.0), 4, ""),  # shapes differ
    ],
)
def test_scale_hint_names_only_an_exact_factor_of_the_group_size(actual, expected, size, hint):
    assert scale_hint(t(*actual), t(*expected), size) == hint


def test_scale_hint_sees_a_factor_in_complex_values():
    e = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex128)
    assert scale_hint(4 * e, e, 4) == "exactly 4x the reference: a reduction counted 4 times"
    assert scale_hint(1j * e, e, 4) == ""  # a rotation is no factor


# ---------------------------------------------------------------- texts


def test_format_table_pads_columns_and_leaves_the_last_free():
    assert format_table(("a", "bb"), [("xyz", "1"), ("p", "qqqq")]) == [
        "a    bb",
        "---  ----",
        "xyz  1",
        "p    qqqq",
    ]
    assert format_table(("a", "b"), [("xyz", "long text")], free_last=True) == [
        "a    b",
        "---  -",
        "xyz  long text",
    ]


def test_a_nonfinite_mismatch_headline_names_the_run_quantity_and_position():
    m = Mismatch(
        "nonfinite",
        "encoder.weight",
        0,
        None,
        where="(2, 1) (3 NaN)",
        count=3,
        total=24,
        run="reference",
        of="grad",
    )
    assert m.headline() == (
        "the reference: nonfinite grad 'encoder.weight' at step 0, 3/24 not finite, "
        "first at (2, 1) (3 NaN)"
    )
    assert mismatch_table([m])[2].split() == [
        "nonfinite",
        "grad",
        "encoder.weight",
        "0",
        "reference",
        "-",
        "-",
        "3/24",
        "(2,",
        "1)",
        "(3",
        "NaN)",
    ]


def test_a_headline_says_the_phase_a_rank_failed_in():
    m = Mismatch("crash", "case", 0, 1, where="process killed by SIGKILL", phase="step 0 forward")
    assert m.headline() == ("rank 1: crash 'case' in step 0 forward: process killed by SIGKILL")
    assert Mismatch("param", "w", None, 2).headline() == "rank 2: param 'w' after build"
    assert Mismatch("loss", "loss", 1, None, 0.5, 0.25).headline() == (
        "all ranks: loss 'loss' at step 1: max abs 0.5, max rel 0.25"
    )


def test_the_table_collapses_ranks_and_keeps_the_worst():
    rows = mismatch_table(
        [
            Mismatch("grad", "w", 0, 1, 0.1, 0.2, "(0,)", 1, 4),
            Mismatch("grad", "w", 0, 2, 0.3, 0.4, "(1,)", 2, 4),
            Mismatch("grad", "w", 0, 3, 0.2, 0.4, "(2,)", 1, 4),
        ]
    )
    assert len(rows) == 3
    assert rows[2].split() == [
        "grad",
        "w",
        "0",
        "1-3",
        "3.00e-01",
        "4.00e-01",
        "2/4",
        "(1,)",
        "(rank",
        "2)",
    ]


def test_an_ok_report_says_equivalent_with_the_worst_errors():
    stats = {q: QuantityStats() for q in ("loss", "grad", "field", "param")}
    stats["grad"].compared, stats["grad"].max_rel = 3, 2e-13
    report = EquivalenceReport("c", 4, 4, "p", 2, "float64", Tolerance.exact(), stats=stats)
    assert report.ok and bool(report)
    assert str(report).endswith("equivalent to the reference (worst relative error: grad 2.0e-13)")
    assert report.worst("grad") == 2e-13 and report.worst("loss") is None
    table = equivalence_table([report.summary_row()])
    assert table[3].split()[-1] == "equivalent"


def test_a_failed_report_has_first_table_and_remedy():
    report = EquivalenceReport(
        "c",
        4,
        4,
        "p",
        2,
        "float64",
        Tolerance.exact(),
        mismatches=[
            Mismatch(
                "nonfinite",
                "loss",
                0,
                None,
                run="reference",
                of="loss",
                where="(1 NaN)",
                count=1,
                total=1,
            )
        ],
    )
    text = str(report)
    assert not report.ok and report.quantities == {"nonfinite"}
    assert "First: the reference: nonfinite loss 'loss' at step 0" in text
    assert "nonfinite: A NaN or inf" in text and "expect_nonfinite = True" in text


def test_stats_keep_the_worst_and_ignore_nan():
    s = QuantityStats()
    for d in (
        compare_tensors(t(1.5), t(1.0), Bound(1, 0.1)),
        compare_tensors(t(1.1), t(1.0), Bound(1, 0.1)),
        compare_tensors(t(1.0), t(1.0, 2.0), Bound(1, 0.1)),  # shape problem: NaN numbers
    ):
        s.add(d)
    assert (s.compared, s.max_abs, s.max_rel) == (3, 0.5, 0.5)


# ---------------------------------------------------------------- the rendered report
# The rendered text is what a user reads in a failing CI log: pinned whole, line by line.


def _stats(**worst: float) -> dict[str, QuantityStats]:
    stats = {q: QuantityStats() for q in ("loss", "grad", "field", "param")}
    for q, rel in worst.items():
        stats[q].compared, stats[q].max_rel = 1, rel
    return stats


def _failed_report(mismatches: list[Mismatch], **kwargs) -> EquivalenceReport:
    return EquivalenceReport(
        "sfno",
        4,
        4,
        "spatial 4",
        1,
        "float32",
        Tolerance.for_dtype(torch.float32),
        mismatches=mismatches,
        **kwargs,
    )


def test_an_ok_report_is_one_line_with_its_layout_and_worst_errors():
    report = EquivalenceReport(
        "sfno",
        4,
        2,
        "lat [8, 8] x lon [32]",
        2,
        "float64",
        None,
        stats=_stats(loss=1e-15, grad=2.5e-13),
    )
    assert (
        str(report)
        == repr(report)
        == (
            "sfno on 4 ranks (spatial 2, lat [8, 8] x lon [32]), 2 steps, float64: equivalent "
            "to the reference (worst relative error: loss 1.0e-15, grad 2.5e-13)"
        )
    )
    # a partition text that only repeats the layout is not said twice; one step is singular
    same = EquivalenceReport("c", 2, 2, "spatial 2", 1, "float64", None, stats=_stats(field=0.0))
    assert str(same) == (
        "c on 2 ranks (spatial 2), 1 step, float64: equivalent to the reference "
        "(worst relative error: field 0.0e+00)"
    )


def test_a_failed_report_reads_first_likely_table_details_tolerance_remedies():
    report = _failed_report(
        [
            Mismatch("grad", "w", 0, 1, 0.1, 0.2, "(0,)", 1, 4, hint="sum it", detail="a\nb\n"),
            Mismatch("grad", "w", 0, 2, 0.3, 0.4, "(1,)", 2, 4),
            Mismatch("crash", "case", None, 3, where="killed by SIGKILL", phase="build"),
        ],
        likely="a halo",
    )
    assert str(report).splitlines() == [
        "sfno on 4 ranks (spatial 4), 1 step, float32: 3 mismatch(es) with the reference",
        "First: rank 1: grad 'w' at step 0: max abs 0.1, max rel 0.2, 1/4 over tolerance, "
        "worst at (0,)",
        "Likely cause: a halo",
        "",
        "quantity  name  step   rank  max abs   max rel   over tol  worst at",
        "--------  ----  -----  ----  --------  --------  --------  --------",
        "grad      w     0      1,2   3.00e-01  4.00e-01  2/4       (1,) (rank 2)",
        "crash     case  build  3     -         -         -         killed by SIGKILL",
        "",
        "rank 1: grad 'w' at step 0: max abs 0.1, max rel 0.2, 1/4 over tolerance, worst at (0,)",
        "  -> sum it",
        "  a",
        "  b",
        "",
        "Tolerance: loss rtol 1e-05 atol 1e-07; grad rtol 0.0001 atol 1e-06; "
        "field rtol 1e-05 atol 3e-06; param rtol 1e-05 atol 1e-06",
        "What to do:",
        f"  grad: {REMEDIES['grad']}",
        f"  crash: {REMEDIES['crash']}",
    ]


def test_a_long_report_is_cut_to_42_table_rows_6_details_and_40_detail_lines():
    many = [
        Mismatch("field", f"f{i:02d}", 0, 0, 1.0, 1.0, "(0,)", 1, 1, detail="x") for i in range(50)
    ]
    many[0].detail = "\n".join(f"line {i}" for i in range(45))
    lines = str(_failed_report(many)).splitlines()
    assert lines[2:4] == ["", "quantity  name  step  rank  max abs   max rel   over tol  worst at"]
    assert lines[44].startswith("field     f39 ")  # 2 header lines + 40 of the 50 rows
    assert lines[45] == "... and 10 more rows"
    details = [i for i, line in enumerate(lines) if line.startswith("rank 0: field 'f")]
    assert len(details) == 6
    assert lines[details[0] + 1 : details[1]] == [f"  line {i}" for i in range(5, 45)] + [""]


def test_a_report_without_tolerance_or_likely_cause_leaves_those_lines_out():
    report = _failed_report([Mismatch("loss", "loss", 0, None, 1.0, 0.5)])
    report.tolerance = None
    assert str(report).splitlines() == [
        "sfno on 4 ranks (spatial 4), 1 step, float32: 1 mismatch(es) with the reference",
        "First: all ranks: loss 'loss' at step 0: max abs 1, max rel 0.5",
        "",
        "quantity  name  step  rank  max abs   max rel   over tol  worst at",
        "--------  ----  ----  ----  --------  --------  --------  --------",
        "loss      loss  0     all   1.00e+00  5.00e-01  -         -",
        "",
        "What to do:",
        f"  loss: {REMEDIES['loss']}",
    ]


def test_the_summary_row_is_every_column_of_the_table():
    report = _failed_report(
        [Mismatch("grad", "w", 0, 1, 1.0, 1.0), Mismatch("batch", "x", 0, 1)],
        stats=_stats(grad=0.5),
        seconds=1.23456,
    )
    assert report.summary_row() == {
        "case": "sfno",
        "ranks": 4,
        "spatial": 4,
        "partition": "spatial 4",
        "dtype": "float32",
        "worst": {"loss": None, "grad": 0.5, "field": None, "param": None},
        "ok": False,
        "problems": ["batch", "grad"],
        "seconds": 1.23,
        "label": "steps 1",
    }


def test_a_rollout_check_is_labelled_with_its_rollout_steps():
    # "steps 2" beside "rollout 150": two checks of one case and partition tell apart
    report = _failed_report([], rollout_steps=150)
    assert report.summary_row()["label"] == "rollout 150"
    assert _failed_report([]).summary_row()["label"] == "steps 1"


def _rows() -> list[dict]:
    ok = EquivalenceReport(
        "sfno",
        4,
        2,
        "lat [8, 8] x lon [32]",
        2,
        "float64",
        None,
        stats=_stats(loss=1e-15, grad=2.5e-13),
    ).summary_row()
    bad = {
        **_failed_report([Mismatch("crash", "c", 0, 1), Mismatch("grad", "w", 0, 1)]).summary_row()
    }
    return [ok, {**bad, "golden": "passed"}]


def test_the_equivalence_table_has_a_line_per_check():
    assert equivalence_table(_rows()) == [
        "worst relative error per quantity, partitioned vs reference:",
        "case  check    ranks  partition              dtype    loss     grad     field  param  "
        "golden  verdict",
        "----  -------  -----  ---------------------  -------  -------  -------  -----  -----  "
        "------  --------------------",
        "sfno  steps 2  4      lat [8, 8] x lon [32]  float64  1.0e-15  2.5e-13  -      -      "
        "-       equivalent",
        "sfno  steps 1  4      spatial 4              float32  -        -        -      -      "
        "passed  MISMATCH: crash,grad",
    ]
    assert equivalence_table([]) == [
        "worst relative error per quantity, partitioned vs reference:",
        "case  check  ranks  partition  dtype  loss  grad  field  param  golden  verdict",
        "----  -----  -----  ---------  -----  ----  ----  -----  -----  ------  -------",
    ]


def test_rows_alike_but_for_their_test_are_named_by_it_without_its_file():
    ok = _rows()[0]
    rows = [{**ok, "test": f"tests/test_a.py::test_{i}[x]"} for i in range(2)]
    table = equivalence_table(rows)
    assert [re.split(r"\s{2,}", line)[:3] for line in table[1:]] == [
        ["test", "case", "check"],
        ["---------", "----", "-------"],
        ["test_0[x]", "sfno", "steps 2"],
        ["test_1[x]", "sfno", "steps 2"],
    ]
    # told apart by their checks: no test column, the table stays narrow
    apart = [rows[0], {**rows[1], "label": "rollout 3"}]
    assert equivalence_table(apart)[1].startswith("case  check")


def test_a_width_shortens_only_the_partition_and_only_as_much_as_needed():
    full = equivalence_table(_rows())
    longest = max(map(len, full))
    fitted = equivalence_table(_rows(), width=longest - 4)
    assert max(map(len, fitted)) == longest - 4
    assert re.split(r"\s{2,}", fitted[3])[3] == "lat [8, 8] x l..."  # 21 -> 17 characters
    assert equivalence_table(_rows(), width=longest) == full
    # never below 12 characters, even when the line cannot fit
    assert re.split(r"\s{2,}", equivalence_table(_rows(), width=10)[3])[3] == "lat [8, 8..."
    assert [
        re.split(r"\s{2,}", line)[:3] for line in equivalence_table(_rows(), show_ranks=False)[1:]
    ] == [
        ["case", "check", "partition"],
        ["----", "-------", "---------------------"],
        ["sfno", "steps 2", "lat [8, 8] x lon [32]"],
        ["sfno", "steps 1", "spatial 4"],
    ]


# ---------------------------------------------------------------- the numbers of a Difference


def test_empty_tensors_compare_as_a_clean_difference():
    empty = torch.zeros(0, dtype=F64)
    assert compare_tensors(empty, empty, Bound(0, 0)) == Difference(True, 0.0, 0.0, 0, 0, None)


def test_tensors_that_cannot_be_compared_count_every_element_as_different():
    d = compare_tensors(t(1.0, 2.0), t(1.0, 2.0, 3.0), Bound(1, 1))
    assert (d.ok, d.count, d.total, d.worst) == (False, 0, 3, None)
    assert math.isnan(d.max_abs) and math.isnan(d.max_rel)
    assert d.problem == "shape (2,) where the reference has (3,)"


def test_the_worst_element_is_the_one_furthest_over_its_own_bound():
    # element 0 differs most (0.5) but its bound is 1.0; element 1 differs by 0.4 over 0.01
    d = compare_tensors(t(100.5, 1.4), t(100.0, 1.0), Bound(rtol=0.01, atol=0.0))
    assert (d.worst, d.count, d.max_abs) == (1, 1, 0.5)


def test_a_reference_exactly_at_atol_is_left_out_of_the_relative_error():
    d = compare_tensors(t(0.25 + 2**-10), t(0.25), Bound(rtol=0.0, atol=0.25))
    assert (d.max_abs, d.max_rel) == (2**-10, 0.0)
    d = compare_tensors(t(0.5 + 2**-10), t(0.5), Bound(rtol=0.0, atol=0.25))
    assert d.max_rel == 2**-10 / 0.5


@pytest.mark.parametrize(
    ("dtype", "big"),
    [(torch.float16, 60000.0), (torch.float32, 3e38), (torch.complex64, 3e38)],
)
def test_differences_are_taken_in_double_precision_so_they_cannot_overflow(dtype, big):
    # big - (-big) overflows in the tensors' own dtype; the comparison must not see an inf
    d = compare_tensors(
        torch.tensor([big], dtype=dtype), torch.tensor([-big], dtype=dtype), Bound(0, 0)
    )
    expected = float(torch.tensor(big, dtype=dtype).real.double()) * 2
    assert (d.max_abs, d.nonfinite, d.count) == (expected, 0, 1)


@pytest.mark.parametrize(
    ("actual", "expected", "max_abs", "max_rel", "count"),
    [
        ((5, 1), (3, 1), 2.0, 2 / 3, 1),
        ((3, 1), (3, 1), 0.0, 0.0, 0),
        ((3, 0), (1, 0), 2.0, 2.0, 1),  # |reference| < 1: relative to 1, not to a tiny number
        ((1, 10), (0, 4), 6.0, 1.5, 2),
    ],
)
def test_integers_report_their_differences(actual, expected, max_abs, max_rel, count):
    d = compare_tensors(torch.tensor(actual), torch.tensor(expected), Bound(0, 0))
    assert (d.ok, d.max_abs, d.max_rel, d.count, d.total) == (
        count == 0,
        max_abs,
        max_rel,
        count,
        2,
    )


def test_allowed_complex_nonfinite_values_are_matched_per_position():
    a = torch.tensor([complex(NAN, 1), 1 + 1j, 2 + 2j], dtype=torch.complex128)
    e = torch.tensor([complex(NAN, 1), 1 + 1j, 2 + 3j], dtype=torch.complex128)
    d = compare_tensors(a, e, Bound(0, 0), allow_nonfinite=True)
    assert (d.count, d.nonfinite, d.worst) == (1, 0, 2)


def test_bits_differ_counts_elements_not_bytes():
    a = t(1.0, 2.0, 3.0)
    b = t(1.0, -2.0, math.nextafter(3.0, 4.0))
    assert bits_differ(a, b) == 2
    assert bits_differ(a, a.clone()) == 0
    assert (
        bits_differ(
            torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1, 0, 0], dtype=torch.uint8)
        )
        == 2
    )


def test_a_scale_of_one_on_a_single_rank_is_no_hint():
    assert scale_hint(t(*E3), t(*E3), 1) == ""


# ---------------------------------------------------------------- edges of the rendering


def test_a_table_of_41_rows_says_the_one_left_out():
    rows = [Mismatch("field", f"f{i:02d}", 0, 0, 1.0, 1.0, "(0,)", 1, 1) for i in range(41)]
    lines = str(_failed_report(rows)).splitlines()
    assert lines[44].startswith("field     f39 ") and lines[45] == "... and 1 more rows"


def test_a_table_of_exactly_40_rows_is_shown_whole():
    rows = [Mismatch("field", f"f{i:02d}", 0, 0, 1.0, 1.0, "(0,)", 1, 1) for i in range(40)]
    lines = str(_failed_report(rows)).splitlines()
    assert lines[44].startswith("field     f39 ") and lines[45] == ""


def test_a_detail_keeps_its_indentation():
    m = Mismatch("error", "case", 0, 1, where="ValueError", detail='  File "m.py"\nValueError\n')
    assert str(_failed_report([m])).splitlines()[7:10] == [
        "rank 1: error 'case' at step 0: ValueError",
        '    File "m.py"',
        "  ValueError",
    ]


def test_a_failure_without_a_summary_has_no_dangling_colon():
    assert (
        Mismatch("crash", "case", 0, 1, phase="build").headline() == "rank 1: crash 'case' in build"
    )


def test_ranks_tied_for_the_worst_keep_the_first_and_a_rank_in_the_position_is_not_repeated():
    rows = mismatch_table(
        [
            Mismatch("grad", "w", 0, 1, 0.5, 0.5, "(0,)", 1, 4),
            Mismatch("grad", "w", 0, 2, 0.5, 0.5, "(1,)", 1, 4),
            Mismatch("field", "y", 0, 1, 0.5, 0.5, "(3,) of rank 1", 1, 4),
            Mismatch("field", "y", 0, 2, 0.1, 0.5, "(0,) of rank 2", 1, 4),
        ]
    )
    assert rows[2].endswith("(0,) (rank 1)")
    assert rows[3].endswith("(3,) of rank 1")


def test_raise_if_failed_raises_an_assertion_error_carrying_the_whole_report():
    report = _failed_report([Mismatch("loss", "loss", 0, None, 1.0, 0.5)])
    with pytest.raises(AssertionError) as info:
        report.raise_if_failed()
    assert isinstance(info.value, EquivalenceFailure) and isinstance(info.value, HarnessError)
    assert str(info.value) == str(report) and info.value.report is report
    assert str(info.value).splitlines()[-1].startswith("  loss: ")  # to its last line
    # pickled (to an xdist controller) it keeps its text
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(report) and str(again.report) == str(report)


def test_raise_if_failed_is_silent_on_a_passing_report():
    report = _failed_report([])
    assert report.ok and report.raise_if_failed() is None


def test_a_quantity_is_its_text_wherever_text_was_used():
    import pickle

    from harness.compare import FAILURES, NUMERIC, REMEDIES, Quantity

    assert Quantity.GRAD == "grad" and f"{Quantity.GRAD}" == "grad"
    assert REMEDIES["grad"] is REMEDIES[Quantity.GRAD]
    assert set(REMEDIES) == set(Quantity)  # a remedy for every quantity, none for another
    assert Tolerance.for_dtype(torch.float64).bound(Quantity.FIELD).rtol == 1e-10
    assert set(NUMERIC) | set(FAILURES) < set(Quantity)
    # a Mismatch given the text holds the member, and keeps it across processes (a rank's)
    m = Mismatch("grad", "w", 0, 1)
    assert m.quantity is Quantity.GRAD
    assert pickle.loads(pickle.dumps(m)).quantity is Quantity.GRAD
    with pytest.raises(ValueError, match="'gard' is not a valid Quantity"):
        Mismatch("gard", "w", 0, 1)


# ---------------------------------------------------------------- DTensor-like values


class Mesh:
    """A device mesh as DTensor's placements read it: its shape, names, this rank's
    coordinate (no process group needed)."""

    def __init__(self, shape, coordinate, names=None):
        self.shape, self.coordinate, self.mesh_dim_names = tuple(shape), list(coordinate), names

    def get_coordinate(self):
        return self.coordinate

    def size(self, mesh_dim):
        return self.shape[mesh_dim]


class Distributed(torch.Tensor):
    """A DTensor look-alike: ``.shape`` the global one (its own storage, zeros), ``to_local()``
    the block given, ``placements``/``device_mesh``/``_spec`` as given; ``full_tensor()``
    returns ``whole`` and counts the gathers."""

    @staticmethod
    def __new__(cls, whole, local, placements=None, mesh=None, spec=None):
        out = torch.Tensor._make_subclass(cls, torch.zeros_like(whole))
        out.local, out.whole, out.gathers = local, whole, []
        if placements is not None:
            out.placements, out.device_mesh = tuple(placements), mesh
        if spec is not None:
            out._spec = spec
        return out

    def to_local(self):
        return self.local

    def full_tensor(self):
        self.gathers.append(1)
        return self.whole


def dshard(whole, placements, shape, coordinate, names=None, span=(None, 0, 0)):
    """A DTensor-like holding ``whole``'s block ``span`` = (dim, start, size)."""
    dim, start, size = span
    local = whole if dim is None else whole.narrow(dim, start, size)
    return Distributed(whole, local, placements, Mesh(shape, coordinate, names))


def test_a_replicated_dtensor_is_its_local_values_whole_with_no_gather():
    from torch.distributed.tensor import Replicate

    whole = t(1.0, 2.0, 3.0)
    value = dshard(whole, [Replicate()], (2,), (1,), ("spatial",))
    at = placed(value)
    assert (at.dim, at.gathered, type(at.values)) == (None, False, torch.Tensor)
    assert torch.equal(at.values, whole) and value.gathers == []
    assert at.how == "Distributed (Replicate()) on a 2 mesh ('spatial',)"


@pytest.mark.parametrize(
    ("placements", "shape", "coordinate", "span"),
    [
        ("RS0", (1, 2), (0, 0), (0, 0, 3)),  # 5 rows over 2: torch.chunk gives 3 + 2
        ("RS0", (1, 2), (0, 1), (0, 3, 2)),
        ("S0S0", (2, 2), (1, 0), (0, 3, 1)),  # rows 3..4 (5 over 2), then 1 of them (2 over 2)
        ("S0S0", (2, 2), (1, 1), (0, 4, 1)),
        ("S1", (3,), (1,), (1, 2, 2)),  # 4 columns over 3: chunks of 2, the third empty
        ("S1", (3,), (2,), (1, 4, 0)),
        ("S0", (4,), (3,), (0, 5, 0)),  # 5 rows over 4: chunks of 2 end at rank 2's one row
    ],
    ids=[
        "first",
        "uneven-last",
        "nested",
        "nested-last",
        "columns",
        "columns-empty",
        "past-the-end",
    ],
)
def test_a_dtensor_shard_is_the_block_torch_chunk_gives_its_coordinate(
    placements, shape, coordinate, span
):
    from torch.distributed.tensor import Replicate, Shard

    kinds = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    parts = [kinds[k] for k in re.findall(r"R|S\d", placements)]
    whole = torch.arange(20, dtype=F64).reshape(5, 4)
    value = dshard(whole, parts, shape, coordinate, span=span)
    assert block(value) == span
    at = placed(value)
    assert at.index.tolist() == list(range(span[1], span[1] + span[2]))
    assert torch.equal(at.values, whole.index_select(span[0], at.index)) and not value.gathers


def test_a_dtensor_shard_holding_other_values_than_its_placements_say_keeps_their_positions():
    from torch.distributed.tensor import Shard

    whole = torch.arange(5, dtype=F64)
    value = Distributed(whole, whole[:4], [Shard(0)], Mesh((2,), (1,)))  # 4 values, not 2
    assert block(value) == (0, 3, 2)  # the comparison says the shard has the wrong shape


def test_partial_sums_and_two_sharded_dims_are_gathered_whole_once():
    from torch.distributed.tensor import Partial, Shard

    whole = torch.arange(6, dtype=F64).reshape(2, 3)
    partial = Distributed(whole, whole / 2, [Partial()], Mesh((2,), (0,)))
    both = Distributed(whole, whole[:1, :2], [Shard(0), Shard(1)], Mesh((2, 2), (0, 0)))
    for value in (partial, both):
        assert block(value) is None
        at = placed(value)
        assert at.gathered and at.dim is None and torch.equal(at.values, whole)
        assert value.gathers == [1]


def test_a_shardtensor_spec_places_uneven_shards_by_its_own_offsets():
    from torch.distributed.tensor import Shard

    class Spec:  # physicsnemo's ShardTensorSpec: every shard's shape, offsets per mesh dim
        def __init__(self):
            self._sharding_shapes = {0: (torch.Size([1, 4]), torch.Size([4, 4]))}

        def offsets(self, mesh_dim):
            return 1

    whole = torch.arange(20, dtype=F64).reshape(5, 4)
    value = Distributed(whole, whole[1:], [Shard(0)], Mesh((2,), (1,)), Spec())
    assert block(value) == (0, 1, 4)  # torch.chunk would say rows 3..4


def test_a_subclass_without_placements_is_gathered_and_one_without_either_read_as_is():
    whole = t(1.0, 2.0)
    value = Distributed(whole, whole[:1])
    assert placed(value).gathered and torch.equal(placed(value).values, whole)

    class Tagged(torch.Tensor):
        pass

    tagged = torch.Tensor._make_subclass(Tagged, whole)
    assert type(plain(tagged)) is torch.Tensor and torch.equal(plain(tagged), whole)
    assert placed(tagged).how == "" and not is_distributed(tagged)


def test_dtensor_like_values_are_compared_by_the_values_they_hold():
    from torch.distributed.tensor import Shard

    whole = t(1.0, 2.0, 3.0, 4.0)
    value = dshard(whole, [Shard(0)], (2,), (1,), span=(0, 2, 2))
    assert compare_tensors(value, t(3.0, 4.0), Bound(0.0, 0.0)).ok
    d = compare_tensors(value, t(3.0, 5.0), Bound(0.0, 0.0))
    assert (d.ok, d.max_abs, d.count, d.worst) == (False, 1.0, 1, 1)
    assert bitwise_equal(value, t(3.0, 4.0)) and bits_differ(value, t(3.0, 5.0)) == 1
    assert nonfinite_counts(Distributed(whole, t(NAN, 1.0))) == (1, 0, 0)


def test_complex_values_with_exact_zeros_compare_without_an_infinite_relative_error():
    c = torch.complex128
    expected = torch.tensor([1 + 0j, 0j, 0j, 1e-3j], dtype=c)
    actual = torch.tensor([1 + 0j, 0j, 1e-3j, 2e-3j], dtype=c)
    d = compare_tensors(actual, expected, Bound(1e-10, 1e-12))
    # the reference's exact zero is judged by atol alone: its error is absolute, not x inf
    assert (d.ok, d.count, d.worst) == (False, 2, 2)  # 2: the larger excess (bound ~0 there)
    assert d.max_abs == pytest.approx(1e-3, rel=1e-12) and d.max_rel == pytest.approx(1.0)
    assert compare_tensors(expected, expected.clone(), Bound(0.0, 0.0)).ok
