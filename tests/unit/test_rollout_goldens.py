"""Rollout goldens on one process: which steps and values a golden stores of a rollout, and
how a stored step is judged against today's reference (its step's rounding spread, not a
fixed tolerance). The rollouts are the float32 Lorenz-96 ring's (tests/distributed/ring.py)
run serially; the partitioned run's place is taken by the reference itself, so no ranks
are needed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness import GoldenStore, Topology
from harness._records.run import FieldRecord
from harness._records.samples import (
    ROLLOUT_ELEMENTS,
    RolloutSamples,
    parse_rollout_name,
    rollout_golden_steps,
    rollout_name,
    sample_stride,
)
from harness.compare import Bound, Tolerance
from harness.goldens import (
    GoldenChange,
    GoldenStatus,
    check_report,
    diff_tensors,
    rollout_bounds,
)
from harness.rollout import FACTOR, MEMBERS, judge_rollout, run_prediction
from tests.distributed.ring import RingCase

STEPS = 150  # where float32 rounding of the ring has grown ~1000x (ring.py)
F32 = Tolerance.for_dtype(torch.float32).field


# ---------------------------------------------------------------------- what is stored


def test_the_stored_steps_double_from_the_first_and_end_at_the_last():
    assert rollout_golden_steps(150) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 149]
    assert rollout_golden_steps(1) == [0]
    assert rollout_golden_steps(2) == [0, 1]
    assert rollout_golden_steps(8) == [0, 1, 2, 4, 7]
    assert rollout_golden_steps(9) == [0, 1, 2, 4, 8]
    assert rollout_golden_steps(0) == []


def test_a_large_field_is_strided_to_the_cap_walking_across_its_columns():
    # 2 x 3 x 12 x 20 = 1440 values: stride 2 keeps 720 <= 1024, but 2 divides the 20
    # longitudes (every sample would sit on even ones): 3 is the smallest coprime stride
    assert sample_stride((2, 3, 12, 20)) == 3
    assert sample_stride((4, 256)) == 1  # exactly the cap: every value
    assert sample_stride((4, 257)) == 2  # 1028 values: one over
    assert sample_stride((721, 1440)) == 1019  # coprime with 1440, 1019 values kept
    assert sample_stride(()) == 1  # a scalar
    for shape in [(2, 3, 12, 20), (721, 1440), (5, 48, 64), (3000,)]:
        s = sample_stride(shape)
        kept = len(range(0, math.prod(shape), s))
        assert kept <= ROLLOUT_ELEMENTS and math.gcd(s, shape[-1]) == 1


def test_samples_hold_the_stored_steps_of_every_positional_field_strided_where_large():
    big = torch.arange(2 * 3 * 12 * 20, dtype=torch.float32).reshape(2, 3, 12, 20)
    keyed = FieldRecord(torch.zeros(4), None, 0, keys=torch.arange(4)[:, None])
    reference = [
        {"grid": FieldRecord(big + k), "energy": FieldRecord(torch.tensor([k, -k])), "t": keyed}
        for k in range(5)
    ]
    samples = RolloutSamples.of(reference)
    assert list(samples.tensors) == [
        rollout_name(k, n) for k in (0, 1, 2, 4) for n in ("grid", "energy")
    ]
    grid4 = samples.tensors["rollout/step4/grid"]
    assert torch.equal(grid4, (big + 4).reshape(-1)[::3])  # 480 values, one in 3
    assert torch.equal(samples.tensors["rollout/step2/energy"], torch.tensor([2, -2]))
    assert samples.provenance() == {
        "rollout_steps": 5,
        "rollout_stored_steps": [0, 1, 2, 4],
        "rollout_sampling": [
            "grid: (2, 3, 12, 20) float32, flattened, one value in 3 (480 of 1440)",
            "energy: (2,) int64, every value",
        ],
    }
    assert parse_rollout_name("rollout/step16/a/b") == (16, "a/b")
    assert parse_rollout_name("step0/field/state") is None


# ---------------------------------------------------------------------- how it is judged


@pytest.fixture(scope="module")
def ring():
    """Today's reference rollout of the ring, its ensemble, the record judging it (the
    reference standing in for the ranks) and its samples; and a rollout of the same ring
    whose start differs by rounding, as a reference recorded on another machine or torch
    build does (a nudge no ensemble member uses)."""
    case, single = RingCase(), Topology.single()
    reference = run_prediction(case, single, STEPS, 0)
    members = [run_prediction(case, single, STEPS, 0, member=j) for j in range(MEMBERS)]
    record = judge_rollout(reference, members, [reference], F32, spatial_size=1)
    record.samples = RolloutSamples.of(reference)
    elsewhere = RolloutSamples.of(run_prediction(case, single, STEPS, 0, member=MEMBERS + 3))
    return record, elsewhere


def _report(record, training_scale=1.0, ok=True):
    return SimpleNamespace(
        ok=ok,
        reference={"step0/loss": torch.tensor(2.5, dtype=torch.float32) * training_scale},
        case="ring",
        ranks=2,
        spatial_size=2,
        partition="arcs",
        dtype="float32",
        steps=1,
        rollout=record,
    )


def test_a_golden_recorded_where_rounding_differed_passes_at_every_step_by_its_spread(ring):
    record, elsewhere = ring
    steps = rollout_bounds(record, F32)
    assert set(steps) == set(record.samples.tensors)
    # the same trajectory up to rounding grown by chaos: within each step's bound ...
    assert diff_tensors(record.samples.tensors, elsewhere.tensors, F32, steps=steps) == []
    # ... where the fixed float32 field tolerance passes the first steps and fails the
    # rest (measured: from step 8 of the stored ones on)
    fixed = diff_tensors(record.samples.tensors, elsewhere.tensors, F32)
    failed = sorted({parse_rollout_name(line.split(":")[0].strip())[0] for line in fixed})
    assert failed and failed[-1] == STEPS - 1 and failed[0] > 1, failed


def test_a_changed_step_fails_naming_the_step_the_field_and_its_spread(ring):
    record, _ = ring
    steps = rollout_bounds(record, F32)
    golden = dict(record.samples.tensors)
    bound = steps["rollout/step8/state"]
    # 3x the bound at step 8: a change rounding cannot explain
    golden["rollout/step8/state"] = golden["rollout/step8/state"] + 3 * bound.limit
    [line] = diff_tensors(record.samples.tensors, golden, F32, steps=steps)
    assert line.startswith("  rollout/step8/state: rollout step 8 of 150, field 'state': max abs ")
    assert f"over the bound {bound.limit:.3g} ({FACTOR:g}x the rounding spread " in line
    assert f"of {MEMBERS} nudged reruns at this step" in line
    # the bound is the rollout check's own envelope there, with the golden's field floor
    point = next(p for p in record.curve if (p.step, p.name) == (8, "state"))
    assert bound.limit == max(FACTOR * point.spread, F32.atol + F32.rtol * point.scale)


def test_the_golden_policy_stores_and_judges_the_rollout_beside_the_training_tensors(
    tmp_path, ring
):
    record, elsewhere = ring
    path = tmp_path / "g.pt"
    written = check_report(GoldenStore(tmp_path, update=True), path, _report(record))
    assert written.status is GoldenStatus.WRITTEN
    golden = GoldenStore(tmp_path).load(path)
    assert set(golden["tensors"]) == {"step0/loss", *record.samples.tensors}
    assert golden["provenance"]["rollout_steps"] == STEPS
    assert golden["provenance"]["rollout_sampling"] == [
        "state: (2, 40) float32, every value",
        "energy: (2,) float32, every value",
    ]
    assert check_report(GoldenStore(tmp_path), path, _report(record)).status == "passed"
    # recorded "elsewhere": its rollout within each step's spread passes too
    data = torch.load(path, weights_only=True)
    data["tensors"].update(elsewhere.tensors)
    torch.save(data, path)
    assert check_report(GoldenStore(tmp_path), path, _report(record)).status == "passed"
    # the training tensors are judged as before: the fixed float32 field tolerance
    moved = check_report(GoldenStore(tmp_path), path, _report(record, training_scale=1.001))
    assert moved.status == "failed" and moved.lines[0].startswith("  step0/loss: 1/1 over")


def test_a_golden_without_a_rollout_part_is_a_clear_failure_saying_to_update(tmp_path, ring):
    record, _ = ring
    path = tmp_path / "g.pt"
    training = _report(None)  # a golden recorded before rollout goldens (or without rollout=)
    check_report(GoldenStore(tmp_path, update=True), path, training)
    assert check_report(GoldenStore(tmp_path), path, training).status == "passed"
    result = check_report(GoldenStore(tmp_path), path, _report(record))
    assert result.status is GoldenStatus.FAILED
    assert result.lines[0] == (
        "  the golden has no rollout part, and this check rolls out 150 steps (the golden was "
        "recorded without rollout=, or before rollout goldens): run pytest with "
        "--update-goldens, review the diff and commit the goldens to record the rollout's "
        "per-step fields."
    )
    assert not any("produced but not in the golden" in line for line in result.lines)
    # and an update records it: the rollout's tensors are what was added
    updated = check_report(GoldenStore(tmp_path, update=True), path, _report(record))
    assert updated.status is GoldenStatus.UPDATED
    assert set(updated.change.added) == set(record.samples.tensors)
    assert updated.change.changed == () and updated.change.unchanged == 1


def test_the_update_summary_counts_rollout_tensors_by_their_steps_bound(tmp_path, ring):
    record, elsewhere = ring
    path = tmp_path / "g.pt"
    check_report(GoldenStore(tmp_path, update=True), path, _report(record))
    data = torch.load(path, weights_only=True)
    data["tensors"].update(elsewhere.tensors)  # rounding only: not a change
    bound = rollout_bounds(record, F32)["rollout/step16/energy"]
    data["tensors"]["rollout/step16/energy"] += 5 * bound.limit
    data["tensors"]["rollout/step2/gone"] = torch.zeros(2)
    del data["tensors"]["rollout/step149/state"]
    torch.save(data, path)
    result = check_report(GoldenStore(tmp_path, update=True), path, _report(record))
    change = result.change
    assert change.changed == ("rollout/step16/energy",)
    assert change.added == ("rollout/step149/state",)
    assert change.removed == ("rollout/step2/gone",)
    assert change.unchanged == 19  # 20 rollout tensors and the loss: 1 changed, 1 added
    lines = change.lines("g.pt", result.status)
    assert lines[0].startswith(
        "updated g.pt: 1 changed, 1 added, 1 removed, 19 unchanged; largest change "
        "rollout/step16/energy: max abs "
    )
    # said as how many times its step's bound (5x, give or take float32's rounding of +=)
    said = lines[1].removeprefix("  changed: rollout/step16/energy (")
    assert said.endswith("x its step's bound)")
    assert float(said.split("x")[0]) == pytest.approx(5.0, rel=1e-2)


def test_a_step_the_rollout_did_not_judge_is_held_to_the_fixed_tolerance():
    reference = [{"x": FieldRecord(torch.full((3,), float(k)))} for k in range(3)]
    samples = RolloutSamples.of(reference)
    record = SimpleNamespace(curve=[], samples=samples, steps=3, factor=FACTOR, members=4)
    assert rollout_bounds(record, F32) == {}
    golden = dict(samples.tensors, **{"rollout/step2/x": torch.full((3,), 2.001)})
    [line] = diff_tensors(samples.tensors, golden, F32, steps=rollout_bounds(record, F32))
    assert line.startswith("  rollout/step2/x: 3/3 over tolerance (rtol 1e-05")


def test_goldens_order_a_rollouts_tensors_by_step():
    new = {rollout_name(k, "x"): torch.zeros(1) for k in (0, 2, 16, 128)}
    assert GoldenChange.between(new, None, Bound(0, 0)).added == (
        "rollout/step0/x",
        "rollout/step2/x",
        "rollout/step16/x",
        "rollout/step128/x",
    )


def test_each_stored_steps_bound_is_factor_times_its_spread_or_its_fields_floor():
    from harness._records.rollout import RolloutPoint

    # hand-made: field 'x' of scale 1000 where rounding moved nothing (step 0) and where it
    # moved 1e-2 (step 1); a factor other than the check's, so it must come from the record.
    # Changes are 0.9x and 1.2x a bound: far outside float32's rounding of ~1000 (6e-5)
    reference = [{"x": FieldRecord(torch.full((3,), 1000.0 + k))} for k in range(2)]
    samples = RolloutSamples.of(reference)
    curve = [
        RolloutPoint(0, "x", 0.0, 0.0, 0.0, 1000.0),
        RolloutPoint(1, "x", 0.0, 1e-2, 0.0, 1001.0),
    ]
    record = SimpleNamespace(curve=curve, samples=samples, steps=2, factor=7.0, members=3)
    bounds = rollout_bounds(record, F32)
    floor = F32.atol + F32.rtol * 1000.0  # its relative term dominates: 1e-2 vs 3e-6
    limit = 7.0 * 1e-2  # over step 1's floor (1.001e-2)
    assert bounds["rollout/step0/x"].limit == pytest.approx(floor)
    assert bounds["rollout/step1/x"].limit == pytest.approx(limit)
    golden = dict(samples.tensors)
    golden["rollout/step0/x"] = golden["rollout/step0/x"] + 0.9 * floor
    golden["rollout/step1/x"] = golden["rollout/step1/x"] + 0.9 * limit
    assert diff_tensors(samples.tensors, golden, F32, steps=bounds) == []
    golden["rollout/step0/x"] = samples.tensors["rollout/step0/x"] + 1.2 * floor
    golden["rollout/step1/x"] = samples.tensors["rollout/step1/x"] + 1.2 * limit
    lines = diff_tensors(samples.tensors, golden, F32, steps=bounds)
    assert [line.split(":")[0].strip() for line in lines] == ["rollout/step0/x", "rollout/step1/x"]
    assert "7x the rounding spread 0.01 of 3 nudged reruns" in lines[1]


def test_goldens_order_a_rollouts_tensors_by_step_then_field_after_the_rest():
    names = [rollout_name(k, f) for k in (16, 2) for f in ("b", "a")] + ["w", "loss"]
    assert GoldenChange.between(dict.fromkeys(names, torch.zeros(1)), None, F32).added == (
        "loss",
        "w",
        "rollout/step2/a",
        "rollout/step2/b",
        "rollout/step16/a",
        "rollout/step16/b",
    )
