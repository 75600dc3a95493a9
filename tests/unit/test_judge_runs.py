"""compare_runs (harness/_judges/__init__.py) on hand-made records: the whole comparison,
in run order, with its likely cause and its diagnoses, without a rank in sight."""

from __future__ import annotations

import math

import torch

from harness._judges import (
    compare_runs,
)
from harness._records.run import FieldRecord
from harness.compare import NUMERIC, Mismatch, Quantity
from harness.report import EquivalenceReport
from tests.unit._judging import (
    F64,
    NAN,
    TOL,
    field,
    quantities,
    run,
    same,
    shard,
    step,
)


def test_identical_runs_are_equivalent_and_their_errors_zero():
    out = compare_runs(run(), [run(), run(spatial_rank=1)], TOL, spatial_size=2)
    assert out.mismatches == []
    assert {q: s.max_rel for q, s in out.stats.items()} == dict.fromkeys(NUMERIC, 0.0)
    assert out.stats["grad"].compared == 2


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


BUFFER = "modified in place during the step; the reference's was not"


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


# ---------------------------------------------------------------- values of any tensor type


def test_records_holding_dtensor_like_values_are_compared_by_the_values_they_hold():
    from torch.distributed.tensor import Shard as DShard

    from tests.unit._dtensor_like import Distributed, Mesh

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
