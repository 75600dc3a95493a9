"""The calibrated judgement's rule on hand-made records: each entry's rounding spread from
nudged reruns, the allowance it gives, and how a check reads it (``harness._judges.spread``,
``harness.equivalence._calibrate``). No ranks: the rule is pure."""

from __future__ import annotations

import math

import pytest
import torch

from harness._judges import compare_runs
from harness._judges.spread import allowance, entry_spread, spreads_of
from harness._records.run import FieldRecord, ParamShard, RunRecord, StepRecord
from harness.compare import Quantity, Tolerance
from harness.equivalence._calibrate import FACTOR, GRAD_FACTOR, calibrates, note
from harness.report import EquivalenceReport

F32 = torch.float32
EPS = float(torch.finfo(F32).eps)


def test_an_entrys_spread_is_its_furthest_member_and_at_least_one_unit_of_rounding():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F32)
    near = r.clone()
    near[0] += 5e-6  # member 0 moves entry 0 by 5e-6
    far = r.clone()
    far[0] -= 2e-5  # member 1 moves it further the other way: the furthest counts
    far[3] += 1e-5
    spread = entry_spread(r, [near, far])
    assert spread.dtype == torch.float64 and spread.shape == r.shape
    assert spread[0] == pytest.approx(2e-5, rel=0.05)  # float32 steps of 2.4e-7 near 1
    assert spread[3] == pytest.approx(1e-5, rel=0.05)
    # entries no member moved: one unit of rounding of the entry (3.0 > the mean 2.5)
    assert float(spread[2]) == pytest.approx(EPS * 3.0)
    # ... and at least one of the tensor's mean magnitude (2.5 > 2.0)
    assert float(spread[1]) == pytest.approx(EPS * 2.5)


def test_an_entry_that_cancels_is_given_the_rounding_of_the_tensors_usual_values():
    # 1e-3 among values of ~1: summed from terms of ~1 that cancel, it rounds like them
    r = torch.tensor([1e-3, 1.0, -1.0, 2.0], dtype=F32)
    spread = entry_spread(r, [r.clone()])
    mean = float(r.abs().double().mean())
    assert float(spread[0]) == pytest.approx(EPS * mean)
    assert float(spread[0]) > 100 * EPS * 1e-3


def test_no_spread_is_measured_where_a_member_is_not_finite_or_not_comparable():
    r = torch.tensor([1.0, 2.0], dtype=F32)
    assert entry_spread(r, [torch.tensor([1.0, math.nan])]) is None
    assert entry_spread(r, [torch.tensor([1.0, math.inf])]) is None
    assert entry_spread(r, [torch.ones(3)]) is None
    assert entry_spread(torch.arange(3), [torch.arange(3)]) is None
    # a NaN the reference shares is no member's doing: the other entries are measured
    both = torch.tensor([1.0, math.nan], dtype=F32)
    assert entry_spread(both, [both.clone()]) is not None


def test_the_allowance_is_the_factor_times_the_spread_and_a_floor_only_where_it_is_zero():
    spread = torch.tensor([1e-7, 0.0, 3e-7], dtype=torch.float64)
    expected = torch.tensor([1.0, 0.0, 4.0], dtype=F32)
    a = allowance(spread, expected, 10.0)
    assert a[0] == pytest.approx(1e-6) and a[2] == pytest.approx(3e-6)
    assert float(a[1]) == pytest.approx(EPS * 4.0)  # one unit of the largest value


def _record(loss: float, grad: torch.Tensor, field: torch.Tensor, param: torch.Tensor) -> RunRecord:
    return RunRecord(
        init={"w": param.clone()},
        steps=[
            StepRecord(
                loss=torch.tensor(loss, dtype=F32),
                grads={"w": grad},
                fields={"out": FieldRecord(field)},
                params={"w": param},
            )
        ],
    )


def _values(n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=F32)


def test_a_few_units_of_rounding_at_small_entries_fail_by_their_spread_not_by_the_tolerance():
    field = _values()
    field[5] = 0.01  # a small entry at a block edge
    ref = _record(1.0, _values(seed=1), field, _values(seed=2))
    member = _record(1.0, _values(seed=1), field.clone(), _values(seed=2))
    wrong = field.clone()
    wrong[5] += 20 * EPS  # 20 units of rounding of 1.0: inside atol 3e-6 + rtol 1e-5 * 0.01
    rank = _record(1.0, _values(seed=1), wrong, _values(seed=2))
    tol = Tolerance.for_dtype(F32)
    assert compare_runs(ref, [rank], tol).mismatches == []  # the fixed tolerance misses it
    spreads = spreads_of(ref, [member], FACTOR)
    found = compare_runs(ref, [rank], tol, spreads=spreads).mismatches
    assert [(m.quantity, m.name) for m in found] == [(Quantity.FIELD, "out")]
    m = found[0]
    assert m.calibrated and m.spread_factor == FACTOR
    # its spread is one unit of the field's mean magnitude (0.01 cancels: it rounds like ~0.8)
    mean = float(field.abs().double().mean())
    assert m.spread_multiple == pytest.approx(20 / mean, rel=0.05)
    assert f"{m.spread_multiple:.3g}x its rounding spread (bound {FACTOR:g}x)" in m.headline()
    assert "over the rounding bound" in m.headline()


def test_an_error_inside_the_members_spread_passes_and_reports_its_multiple():
    field = _values()
    member = field.clone()
    member[7] += 1e-4  # rounding reached 1e-4 there
    rank = field.clone()
    rank[7] += 5e-4  # 5x it: inside FACTOR
    ref = _record(1.0, _values(seed=1), field, _values(seed=2))
    spreads = spreads_of(ref, [_record(1.0, _values(seed=1), member, _values(seed=2))], FACTOR)
    out = compare_runs(
        ref,
        [_record(1.0, _values(seed=1), rank, _values(seed=2))],
        Tolerance.exact(),
        spreads=spreads,
    )
    assert out.mismatches == []  # Tolerance.exact() would fail it: the spread judged it
    assert out.stats[Quantity.FIELD].spread_multiple == pytest.approx(5.0, rel=1e-3)
    rank[7] += FACTOR * 1e-4  # 5 + FACTOR times it: over
    out = compare_runs(
        ref,
        [_record(1.0, _values(seed=1), rank, _values(seed=2))],
        Tolerance.exact(),
        spreads=spreads,
    )
    assert [m.quantity for m in out.mismatches] == [Quantity.FIELD]


def test_gradients_get_their_own_factor():
    grad = _values(seed=1)
    member = grad.clone()
    member[3] += 1e-4
    rank = grad.clone()
    rank[3] += (FACTOR + GRAD_FACTOR) / 2 * 1e-4  # between FACTOR and GRAD_FACTOR spreads
    ref = _record(1.0, grad, _values(), _values(seed=2))
    spreads = spreads_of(
        ref, [_record(1.0, member, _values(), _values(seed=2))], FACTOR, {"grad": GRAD_FACTOR}
    )
    assert spreads.factor_of(Quantity.GRAD) == GRAD_FACTOR
    assert spreads.factor_of(Quantity.FIELD) == FACTOR
    found = compare_runs(
        ref, [_record(1.0, rank, _values(), _values(seed=2))], Tolerance.exact(), spreads=spreads
    ).mismatches
    assert found == []
    same = spreads_of(ref, [_record(1.0, member, _values(), _values(seed=2))], FACTOR)
    found = compare_runs(
        ref, [_record(1.0, rank, _values(), _values(seed=2))], Tolerance.exact(), spreads=same
    ).mismatches
    assert [m.quantity for m in found] == [Quantity.GRAD]


def test_a_data_groups_field_is_judged_by_the_spread_of_its_own_samples():
    # 2 samples x 8 positions; 2 ranks in 2 data groups, each the whole of its sample
    field = torch.ones(2, 8, dtype=F32)
    member = field.clone()
    member[0, 3] += 1e-3  # sample 0's entry moves with rounding; sample 1's does not
    ref = RunRecord(steps=[StepRecord(torch.tensor(1.0), fields={"f": FieldRecord(field)})])
    spreads = spreads_of(
        ref,
        [RunRecord(steps=[StepRecord(torch.tensor(1.0), fields={"f": FieldRecord(member)})])],
        FACTOR,
    )
    moved = torch.ones(1, 8, dtype=F32)
    moved[0, 3] += 5e-3  # 5x sample 0's spread there; 4e4x sample 1's
    ranks = [
        RunRecord(steps=[StepRecord(torch.tensor(1.0), fields={"f": FieldRecord(moved)})]),
        RunRecord(steps=[StepRecord(torch.tensor(1.0), fields={"f": FieldRecord(moved)})]),
    ]
    found = compare_runs(ref, ranks, Tolerance.exact(), spatial_size=1, spreads=spreads)
    assert [(m.quantity, m.rank) for m in found.mismatches] == [(Quantity.FIELD, 1)]


def test_a_sharded_parameter_is_judged_by_the_spread_at_its_shards_positions():
    w = torch.ones(4, dtype=F32)
    member = w.clone()
    member[2] += 1e-3  # only position 2 moves with rounding
    ref = _record(1.0, w.clone(), w.clone(), w.clone())
    spreads = spreads_of(ref, [_record(1.0, member, w.clone(), member)], FACTOR)
    shard = ParamShard(dim=0, index=torch.tensor([2, 3]))
    mine = torch.ones(2, dtype=F32)
    mine[0] += 5e-3  # position 2: 5x its spread, passes; at position 0 it would not
    rank = _record(1.0, mine.clone(), w.clone(), mine.clone())
    rank.param_shards = {"w": shard}
    rank.init = {"w": torch.ones(2, dtype=F32)}
    values = (Quantity.GRAD, Quantity.PARAM)  # one rank covers half: coverage is not this
    found = compare_runs(ref, [rank], Tolerance.exact(), spreads=spreads)
    assert [m.quantity for m in found.mismatches if m.quantity in values] == []
    shard0 = ParamShard(dim=0, index=torch.tensor([0, 1]))
    rank.param_shards = {"w": shard0}
    found = compare_runs(ref, [rank], Tolerance.exact(), spreads=spreads)
    assert {m.quantity for m in found.mismatches if m.quantity in values} == set(values)


@pytest.mark.parametrize(
    ("dtype", "asked", "given", "autocast", "expected"),
    [
        (torch.float32, None, False, None, True),
        (torch.bfloat16, None, False, None, True),
        (torch.complex64, None, False, None, True),
        (torch.float64, None, False, None, False),
        (torch.complex128, None, False, None, False),
        (torch.float32, None, True, None, False),  # a tolerance of the user's wins
        (torch.float32, None, False, torch.bfloat16, False),  # the ratio rule judges autocast
        (torch.float64, True, True, None, True),  # asked for: on
        (torch.float32, False, False, None, False),
        (torch.float32, True, False, torch.bfloat16, False),
    ],
)
def test_a_check_is_calibrated_below_float64_unless_a_tolerance_or_autocast_says_otherwise(
    dtype, asked, given, autocast, expected
):
    assert calibrates(dtype, asked=asked, tolerance_given=given, autocast=autocast) is expected


def test_the_report_says_how_it_was_judged_and_the_worst_multiple_of_each_quantity():
    ref = _record(1.0, _values(seed=1), _values(), _values(seed=2))
    member = _record(1.0, _values(seed=1) * 1.0001, _values(), _values(seed=2))
    spreads = spreads_of(ref, [member], FACTOR, {"grad": GRAD_FACTOR, "param": GRAD_FACTOR})
    rank = _record(1.0, _values(seed=1) * 1.0002, _values(), _values(seed=2))
    out = compare_runs(ref, [rank], Tolerance.for_dtype(F32), spreads=spreads)
    report = EquivalenceReport(
        case="c",
        ranks=1,
        spatial_size=1,
        partition="",
        steps=1,
        dtype="float32",
        tolerance=Tolerance.for_dtype(F32),
        mismatches=out.mismatches,
        stats=out.stats,
    )
    report.notes.append(note(spreads, "float32"))
    assert report.ok
    assert report.spread_multiple("grad") == pytest.approx(2.0, rel=0.01)
    text = str(report)
    assert "worst multiple of the rounding spread: loss 0x, grad 2x, field 0x, param 0x" in text
    assert f"within {FACTOR:g}x (gradients and parameters {GRAD_FACTOR:g}x) its rounding" in text
    plain = EquivalenceReport(
        case="c",
        ranks=1,
        spatial_size=1,
        partition="",
        steps=1,
        dtype="float64",
        tolerance=None,
        stats=compare_runs(ref, [rank], Tolerance.uniform(1, 1)).stats,
    )
    assert plain.spread_text() == "" and "rounding spread" not in str(plain)


def test_the_same_reference_is_calibrated_once_for_every_layout_of_a_sweep(monkeypatch):
    import harness.equivalence._calibrate as calibrate_module

    runs: list[int] = []

    def reruns(case, steps, lr, seed, *, members, **clock):  # type: ignore[no-untyped-def]
        runs.append(members)
        return [_record(1.0, _values(seed=1), _values(), _values(seed=2))] * members

    monkeypatch.setattr(calibrate_module, "spread_runs", reruns)
    monkeypatch.setattr(calibrate_module, "_LAST", None)
    reference = _record(1.0, _values(seed=1), _values(), _values(seed=2))
    case = object()
    first = calibrate_module.calibrate(case, reference, 2, 0.1, 0)
    again = calibrate_module.calibrate(case, reference, 2, 0.1, 0)
    assert again is first and runs == [calibrate_module.MEMBERS]
    # another reference record, or other arguments: measured anew
    calibrate_module.calibrate(case, _record(1.0, _values(), _values(), _values()), 2, 0.1, 0)
    calibrate_module.calibrate(case, reference, 2, 0.1, 1)
    assert len(runs) == 3


def test_spreads_that_cannot_be_measured_leave_the_check_on_its_tolerance(monkeypatch):
    import harness.equivalence._calibrate as calibrate_module

    def reruns(case, steps, lr, seed, *, members, **clock):  # type: ignore[no-untyped-def]
        return [_record(1.0, _values(seed=1), _values(), _values(seed=2))] * members

    def unreadable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise TypeError("a value the spread cannot read")

    monkeypatch.setattr(calibrate_module, "spread_runs", reruns)
    monkeypatch.setattr(calibrate_module, "spreads_of", unreadable)
    monkeypatch.setattr(calibrate_module, "_LAST", None)
    reference = _record(1.0, _values(seed=1), _values(), _values(seed=2))
    out = calibrate_module.calibrate(object(), reference, 2, 0.1, 0)
    assert out.spreads is None
    assert (
        out.problem
        == "the spreads could not be measured (TypeError: a value the spread cannot read)"
    )


def test_complex_entries_are_judged_by_the_modulus_of_their_spread():
    r = torch.tensor([1 + 1j, 0.5 - 2j], dtype=torch.complex64)
    member = r.clone()
    member[1] += 1e-5j
    spread = entry_spread(r, [member])
    assert spread.dtype == torch.float64 and float(spread[1]) == pytest.approx(1e-5, rel=0.05)
    a = allowance(spread, r, 10.0)
    assert float(a[1]) == pytest.approx(1e-4, rel=0.05)
