"""The rollout judgement (harness.rollout) and the autocast ratio rule
(harness.equivalence._autocast) on
hand-made records, and ``run_prediction`` on one process: no ranks needed."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from harness import ConfigError, Outputs, SpatialCase, Topology
from harness._records.run import FieldRecord, RunRecord, StepRecord
from harness.compare import Bound
from harness.equivalence._autocast import RATIO, guard, judge_autocast
from harness.rollout import FACTOR, NUDGE_ULPS, judge_rollout, run_prediction

BOUND = Bound(rtol=1e-10, atol=1e-12)  # float64's: the floor where rounding spread is ~0
N, RANKS = 8, 2


def whole(values):
    return {"state": FieldRecord(values.clone())}


def shards(values):
    """The same field split over RANKS ranks along its last dim."""
    parts = values.tensor_split(RANKS, dim=-1)
    starts = [0, parts[0].shape[-1]]
    return [
        {"state": FieldRecord(p.clone(), torch.arange(s, s + p.shape[-1]), -1)}
        for p, s in zip(parts, starts)
    ]


def rollout(steps):
    """A reference whose values are k + 1 at step k; members ``spread[k]`` away at step k."""
    return [torch.full((2, N), float(k + 1), dtype=torch.float64) for k in range(steps)]


def judge(ref, spreads, errors, bound=BOUND):
    reference = [whole(v) for v in ref]
    members = [
        [whole(v + s) for v, s in zip(ref, spreads)],
        [whole(v - s) for v, s in zip(ref, spreads)],
    ]
    per_step = [shards(v + e) for v, e in zip(ref, errors)]
    ranks = [[step[r] for step in per_step] for r in range(RANKS)]
    return judge_rollout(reference, members, ranks, bound, spatial_size=RANKS)


def test_a_correct_rollout_passes_however_far_its_rounding_has_grown():
    ref = rollout(3)
    record = judge(ref, spreads=[1e-12, 1e-6, 1.0], errors=[0.0, 5e-6, 4.0])
    assert record.first is None and not record.mismatches
    assert [p.ratio for p in record.curve] == pytest.approx([0.0, 5.0, 4.0])
    assert record.lines()[0].startswith("Rollout: 3 steps within 10x the rounding spread")


def test_a_step_beyond_factor_times_the_spread_is_named_as_the_first_divergent_step():
    ref = rollout(4)
    # 20x the spread at step 1, and (as a bug does) further on at the later steps
    record = judge(ref, spreads=[1e-6] * 4, errors=[1e-7, 2e-5, 1e-3, 1e-3])
    first = record.first
    assert (first.step, first.name) == (1, "state")
    assert first.ratio == pytest.approx(20.0)
    [m] = record.mismatches  # one row: where it enters, not every later step
    assert (m.quantity, m.name, m.step) == ("rollout", "state", 1)
    assert record.lines()[0] == (
        "First divergent step: step 1 of 4, field 'state': max abs 2e-05, 20x the rounding "
        "spread (1e-06 over 2 nudged reruns; bound 10x, at least the check's field "
        "tolerance 1e-05)"
    )


def test_where_rounding_moves_nothing_the_checks_fixed_tolerance_is_the_floor():
    ref = rollout(2)
    record = judge(ref, spreads=[0.0, 0.0], errors=[1e-12, 1e-6])
    assert [p.divergent for p in record.curve] == [False, True]
    assert math.isinf(record.first.ratio)
    assert "infx the rounding spread" in record.lines()[0]


def test_a_non_finite_reference_step_is_a_finding_and_ends_its_fields_comparison():
    ref = rollout(3)
    ref[1][0, 0] = math.nan
    record = judge(ref, spreads=[1e-6] * 3, errors=[0.0] * 3)
    [m] = record.mismatches
    assert (m.quantity, m.run, m.step) == ("nonfinite", "reference", 1)
    assert [p.step for p in record.curve] == [0]  # steps 1 and 2 not judged


def test_a_non_finite_value_on_the_ranks_is_divergent():
    ref = rollout(2)
    record = judge(ref, spreads=[1e-6] * 2, errors=[0.0, math.nan])
    assert record.first.step == 1 and math.isinf(record.first.error)


def test_a_shard_that_leaves_positions_uncovered_fails_as_coverage_at_its_step():
    ref = rollout(2)
    reference = [whole(v) for v in ref]
    per_step = [shards(v) for v in ref]
    per_step[1][1]["state"].index = per_step[1][1]["state"].index - 1  # rank 1 one position off
    ranks = [[step[r] for step in per_step] for r in range(RANKS)]
    record = judge_rollout(reference, [reference], ranks, BOUND, spatial_size=RANKS)
    assert {m.quantity for m in record.mismatches} == {"coverage"}
    assert record.mismatches[0].step == 1
    assert record.mismatches[0].where.startswith("rollout step 1 of 2: ")


def test_a_keyed_field_of_a_rollout_is_listed_as_not_compared():
    keys = torch.arange(N)
    keyed = FieldRecord(torch.zeros(N), None, 0, keys=keys[:, None])
    reference = [{"tokens": keyed}]
    ranks = [[{"tokens": keyed}], [{"tokens": keyed}]]
    record = judge_rollout(reference, [reference], ranks, BOUND, spatial_size=RANKS)
    assert record.curve == [] and record.first is None
    assert record.lines() == [
        "Not compared: field 'tokens' of the rollout is keyed (Shard.keyed): rollouts compare "
        "positional shards and whole tensors"
    ]


# ---------------------------------------------------------------------- run_prediction


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.gain * x


class TinyCase(SpatialCase):
    dtype = torch.float64
    seen: ClassVar[list[tuple[bool, bool]]] = []

    def __init__(self, steps_returned=None) -> None:
        self.steps_returned = steps_returned

    def build(self, topo):
        return Scale()

    def batch(self, topo, step):
        return {"x": torch.ones(16)}

    def forward(self, model, batch, topo):
        out = model(batch["x"])
        return Outputs(out.sum(), {"x": out})

    def predict(self, model, batch, topo, steps):
        TinyCase.seen.append((model.training, torch.is_grad_enabled()))
        x, out = batch["x"], []
        for _ in range(self.steps_returned or steps):
            x = model(x)
            out.append({"x": x})
        return out


def test_predict_runs_in_eval_mode_under_no_grad_on_the_model_as_built():
    TinyCase.seen.clear()
    records = run_prediction(TinyCase(), Topology.single(), 3, 0)
    assert TinyCase.seen == [(False, False)]
    assert [float(r["x"].values[0]) for r in records] == [0.5, 0.25, 0.125]  # gain as built
    assert torch.is_grad_enabled()  # the caller's grad mode is back


def test_a_nudged_rerun_moves_its_inputs_by_a_few_units_of_rounding():
    reference = run_prediction(TinyCase(), Topology.single(), 1, 0)
    member = run_prediction(TinyCase(), Topology.single(), 1, 0, member=0)
    rel = (member[0]["x"].values / reference[0]["x"].values - 1).abs()
    eps = torch.finfo(torch.float64).eps
    # parameter and input each nudged by NUDGE_ULPS (where their signs differ the nudges
    # cancel): the product moves by at most twice that
    assert 0 < float(rel.max()) <= 2 * NUDGE_ULPS * eps * 1.01


def test_predict_returning_the_wrong_number_of_steps_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"returned 2 step\(s\) for a rollout of 3; return one"):
        run_prediction(TinyCase(steps_returned=2), Topology.single(), 3, 0)


def test_the_default_predict_says_the_case_has_none_and_how_to_add_one():
    with pytest.raises(ConfigError, match=r"TinyCase has no predict.*define predict\(self, model"):
        SpatialCase.predict(TinyCase(), Scale(), {}, Topology.single(), 2)


# ---------------------------------------------------------------------- the ratio rule


def run(loss, grad, param, out):
    step = StepRecord(
        loss=torch.tensor(loss, dtype=torch.float64),
        grads={"w": torch.tensor([grad], dtype=torch.float64)},
        fields={"out": FieldRecord(torch.tensor([out], dtype=torch.float64))},
        params={"w": torch.tensor([param], dtype=torch.float64)},
    )
    return RunRecord(init={"w": torch.tensor([0.0], dtype=torch.float64)}, steps=[step])


def test_the_partitioned_run_may_be_up_to_ratio_times_further_from_high_precision_than_serial():
    from harness.compare import Tolerance

    tol = Tolerance.for_dtype(torch.float64)
    high, serial = run(1.0, 1.0, 1.0, 1.0), run(1.01, 1.01, 1.01, 1.01)
    inside = run(1.0 + 0.01 * (RATIO - 0.5), 1.0, 1.0, 1.0)
    found, largest = judge_autocast(high, serial, [inside], tol, spatial_size=1)
    assert not found and largest == pytest.approx(RATIO - 0.5)
    outside = run(1.0, 1.0 + 0.01 * (RATIO + 0.5), 1.0, 1.0)
    found, _ = judge_autocast(high, serial, [outside], tol, spatial_size=1)
    assert [(m.quantity, m.name, m.step) for m in found] == [("grad", "w", 0)]
    assert found[0].where.startswith("4.5x the serial bfloat16 run's distance")


def test_where_autocast_changed_nothing_the_partitioned_run_must_match_at_high_precision():
    from harness.compare import Tolerance

    tol = Tolerance.for_dtype(torch.float64)
    high = run(1.0, 1.0, 1.0, 1.0)
    found, _ = judge_autocast(high, high, [run(1.0, 1.0, 1.0, 1.0 + 1e-6)], tol, spatial_size=1)
    assert [m.quantity for m in found] == ["field"] and math.isinf(found[0].max_rel)


def test_a_nan_in_the_high_precision_run_and_on_the_ranks_is_never_within_the_ratio():
    from harness.compare import Tolerance

    tol = Tolerance.for_dtype(torch.float64)
    nan = float("nan")
    # the serial run is infinitely far too: RATIO x inf must not let an inf distance pass
    found, _ = judge_autocast(
        run(1.0, nan, 1.0, 1.0),
        run(1.0, 1.0, 1.0, 1.0),
        [run(1.0, nan, 1.0, 1.0)],
        tol,
        spatial_size=1,
    )
    assert ("grad", "w", 0) in [(m.quantity, m.name, m.step) for m in found]


def test_an_autocast_check_whose_parameters_never_moved_is_vacuous():
    assert guard(run(1.0, 1.0, 0.5, 1.0), "case") == []
    [m] = guard(run(1.0, 1.0, 0.0, 1.0), "case")  # the parameter is still its initial 0.0
    assert m.quantity == "vacuous" and "no parameter moved in training" in m.where
    [m] = guard(run(0.0, 1.0, 0.5, 1.0), "case")
    assert "the loss is zero at every step" in m.where


def test_factor_and_ratio_are_the_documented_ones():
    # docs/rollouts.md states them; a change must change the doc too
    assert (FACTOR, RATIO) == (10.0, 4.0)


def test_a_members_batch_is_nudged_in_every_floating_tensor_and_nothing_else():
    from dataclasses import dataclass

    from harness._rank.predict import _Nudge

    @dataclass
    class Batch:
        state: torch.Tensor
        cells: torch.Tensor

    x = torch.ones(64, dtype=torch.float64)
    nudged = _Nudge(0).batch({"a": Batch(x, torch.arange(4)), "b": [x, (x,)]})
    eps = torch.finfo(torch.float64).eps
    for t in (nudged["a"].state, nudged["b"][0], nudged["b"][1][0]):
        moved = (t - x).abs()
        assert float(moved.min()) > 0 and float(moved.max()) <= NUDGE_ULPS * eps * 1.01
    assert torch.equal(nudged["a"].cells, torch.arange(4))  # indexes are not rounding


def test_the_rollout_plot_is_a_png_of_every_fields_curve(tmp_path):
    pytest.importorskip("matplotlib")
    from harness.rollout import plot_rollout

    record = judge(rollout(4), spreads=[1e-6] * 4, errors=[0.0, 2e-5, 1e-3, 1e-3])
    path = plot_rollout(record, tmp_path / "curve.png", title="ring")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_serial_run_that_lands_next_to_high_precision_by_chance_does_not_shrink_the_bound():
    from harness.compare import Tolerance

    tol = Tolerance.for_dtype(torch.float64)
    u = torch.finfo(torch.bfloat16).eps / 2
    high = run(1.0, 1.0, 1.0, 1.0)
    serial = run(1.0 + 1e-6, 1.0 + 1e-6, 1.0 + 1e-6, 1.0 + 1e-6)  # far inside one rounding
    found, _ = judge_autocast(high, serial, [run(1.0 + 3 * u, 1.0, 1.0, 1.0)], tol, spatial_size=1)
    assert found == []  # three bf16 roundings of the loss: within RATIO of one
    found, _ = judge_autocast(high, serial, [run(1.0 + 5 * u, 1.0, 1.0, 1.0)], tol, spatial_size=1)
    assert [m.quantity for m in found] == ["loss"]


# ---------------------------------------------------------------------- the envelope, closer


def judge_members(ref, distances, error, bound=BOUND, ranks=None):
    """One step: members ``distances`` away from the reference (each its own distance, its
    own sign per value), the ranks ``error`` away."""
    signs = torch.where(torch.arange(ref.numel()).reshape(ref.shape) % 2 == 0, 1.0, -1.0)
    members = [[whole(ref + d * signs.to(ref.dtype))] for d in distances]
    per_rank = ranks if ranks is not None else [[s] for s in shards(ref + error)]
    return judge_rollout([whole(ref)], members, per_rank, bound, spatial_size=len(per_rank))


def test_the_spread_is_the_furthest_of_members_at_different_distances():
    ref = torch.linspace(1.0, 2.0, 2 * N, dtype=torch.float64).reshape(2, N)
    # four members, the furthest neither first nor last: 25e-6 is within 10x the furthest
    # (3e-6) but beyond 10x any other
    record = judge_members(ref, [1e-6, 2e-6, 3e-6, 0.5e-6], 25e-6)
    [point] = record.curve
    assert point.spread == pytest.approx(3e-6, rel=1e-9)
    assert record.first is None and not record.mismatches
    record = judge_members(ref, [1e-6, 2e-6, 3e-6, 0.5e-6], 35e-6)
    assert record.first is not None and record.first.ratio == pytest.approx(35 / 3)


def test_the_fixed_floor_scales_with_the_largest_value_of_the_field():
    # values from -5 to 1 (one of them 0): the floor is atol + rtol * 5
    ref = torch.linspace(-5.0, 1.0, 2 * N + 1, dtype=torch.float64)[:-1].reshape(2, N)
    ref[0, 3] = 0.0
    floor = BOUND.atol + BOUND.rtol * 5.0
    record = judge_members(ref, [0.0, 0.0], 0.9 * floor)
    [point] = record.curve
    assert point.scale == 5.0 and point.envelope == pytest.approx(floor)
    assert record.first is None
    assert judge_members(ref, [0.0, 0.0], 1.1 * floor).first is not None


def test_each_data_groups_shards_are_compared_with_that_groups_samples():
    # 4 ranks: 2 data groups of 2 spatial ranks, each group holding one row of the reference
    ref = torch.stack([torch.arange(N, dtype=torch.float64), -torch.arange(N) - 1.0])
    ranks = [[fields] for g in range(2) for fields in shards(ref[g : g + 1])]
    record = judge_rollout([whole(ref)], [[whole(ref)]], ranks, BOUND, spatial_size=2)
    assert record.first is None and not record.mismatches and record.curve[0].error == 0
    ranks[3][0]["state"].values[0, 0] += 1.0  # group 1's second shard off by 1
    record = judge_rollout([whole(ref)], [[whole(ref)]], ranks, BOUND, spatial_size=2)
    assert record.first is not None and record.first.error == 1.0


def test_a_member_of_another_shape_leaves_the_spread_unknown_from_that_step_on():
    ref = rollout(2)
    members = [[whole(v) for v in ref], [whole(ref[0]), whole(ref[1][:, :-1])]]
    per_step = [shards(v) for v in ref]
    ranks = [[step[r] for step in per_step] for r in range(RANKS)]
    record = judge_rollout([whole(v) for v in ref], members, ranks, BOUND, spatial_size=RANKS)
    assert [p.step for p in record.curve] == [0]  # step 1 unjudged, not judged by a floor
    assert record.not_compared == [
        "field 'state' from step 1 on: a nudged rerun of the reference was not finite "
        "there, so the rounding spread is unknown"
    ]


def test_a_field_whose_coverage_broke_is_not_also_judged_by_value():
    ref = rollout(1)
    reference = [whole(v) for v in ref]
    per_step = [shards(v) for v in ref]
    per_step[0][1]["state"] = FieldRecord(
        per_step[0][1]["state"].values[:, :-1] + 1.0, torch.arange(N // 2, N - 1), -1
    )
    ranks = [[step[r] for step in per_step] for r in range(RANKS)]
    record = judge_rollout(reference, [reference], ranks, BOUND, spatial_size=RANKS)
    assert [m.quantity for m in record.mismatches] == ["coverage"]
    assert record.curve == [] and record.first is None


def test_a_field_keyed_on_the_ranks_only_is_listed_as_not_compared():
    keys = torch.arange(N)
    keyed = FieldRecord(torch.zeros(N), None, 0, keys=keys[:, None])
    reference = [{"tokens": FieldRecord(torch.zeros(N))}]
    ranks = [[{"tokens": keyed}], [{"tokens": keyed}]]
    record = judge_rollout(reference, [reference], ranks, BOUND, spatial_size=RANKS)
    assert record.curve == [] and record.first is None
    assert record.lines()[0].startswith("Not compared: field 'tokens' of the rollout is keyed")


def test_the_divergent_steps_relative_error_is_over_the_fields_largest_value():
    ref = rollout(2)  # step 1's values are all 2.0
    record = judge(ref, spreads=[1e-6] * 2, errors=[0.0, 1e-3])
    [m] = record.mismatches
    assert m.max_abs == pytest.approx(1e-3) and m.max_rel == pytest.approx(1e-3 / 2.0)


# ---------------------------------------------------------------------- the ensemble's nudge


class Linear(SpatialCase):
    """A float32 linear map: what bf16 autocast changes (a matmul), rolled out on one
    process; every ``predict`` call records what it was given."""

    dtype = torch.float32
    calls: ClassVar[list[dict[str, object]]] = []

    def build(self, topo):
        return torch.nn.Linear(8, 8)

    def batch(self, topo, step):
        return {"x": torch.randn(64, 8)}

    def forward(self, model, batch, topo):
        out = model(batch["x"])
        return Outputs(out.square().mean(), {"out": out})

    def predict(self, model, batch, topo, steps):
        Linear.calls.append(
            {
                "weight": model.weight.detach().clone(),
                "x": batch["x"].clone(),
                "autocast": torch.is_autocast_enabled("cpu"),
            }
        )
        x, out = batch["x"], []
        for _ in range(steps):
            x = model(x)
            out.append({"x": x})
        return out


def _moved(nudged, built):
    """Each value's relative move, and the float32 unit it is counted in."""
    return (nudged.double() / built.double() - 1).abs(), torch.finfo(torch.float32).eps


def test_a_member_nudges_the_parameters_and_the_batch_each_by_a_few_units_of_its_dtype():
    Linear.calls.clear()
    run_prediction(Linear(), Topology.single(), 1, 0)
    run_prediction(Linear(), Topology.single(), 1, 0, member=0)
    built, member = Linear.calls
    for name in ("weight", "x"):
        moved, eps = _moved(member[name], built[name])
        # every value moved by at least one unit of float32 (the dtype it is nudged in: a
        # nudge sized by a finer dtype's eps rounds away), at most NUDGE_ULPS units and the
        # rounding of the product to float32 (half a unit in the last place: <= eps relative)
        assert float(moved.min()) >= eps / 2, name
        assert float(moved.max()) <= (NUDGE_ULPS + 1) * eps, name
        # up for some values, down for others: a random sign, not a scaling
        up = member[name] > built[name]
        assert 0 < int(up.sum()) < up.numel(), name


def test_every_member_is_nudged_its_own_way():
    Linear.calls.clear()
    for j in range(3):
        run_prediction(Linear(), Topology.single(), 1, 0, member=j)
    for name in ("weight", "x"):
        seen = [c[name] for c in Linear.calls]
        assert not any(torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1 :])


def test_predict_runs_under_the_autocast_asked_for_and_not_otherwise():
    Linear.calls.clear()
    plain = run_prediction(Linear(), Topology.single(), 2, 0)
    amp = run_prediction(Linear(), Topology.single(), 2, 0, autocast=torch.bfloat16)
    assert [c["autocast"] for c in Linear.calls] == [False, True]
    assert plain[1]["x"].values.dtype == torch.float32
    assert amp[1]["x"].values.dtype == torch.bfloat16  # the matmul ran at bf16


def test_a_rollout_check_runs_distinct_members_and_the_ranks_all_under_its_autocast(in_process):
    from harness.rollout import MEMBERS, check_rollout

    Linear.calls.clear()
    record = check_rollout(
        Linear(),
        in_process,
        spatial_size=1,
        steps=2,
        seed=0,
        bound=BOUND,
        autocast=torch.bfloat16,
    )
    assert record.members == MEMBERS and record.autocast == "bfloat16"
    # the reference under autocast, then without it (bf16's own rounding, measured), then
    # MEMBERS members and the one rank under autocast again
    assert [c["autocast"] for c in Linear.calls] == [True, False] + [True] * (MEMBERS + 1)
    batches = [c["x"] for c in Linear.calls]
    assert torch.equal(batches[0], batches[-1])  # the rank's batch is the reference's
    assert torch.equal(batches[0], batches[1])  # the high-precision run's too
    members = batches[2:-1]
    assert not any(torch.equal(a, batches[0]) for a in members)
    assert not any(torch.equal(a, b) for i, a in enumerate(members) for b in members[i + 1 :])
    assert record.first is None and not record.mismatches


def test_predict_returning_more_steps_than_asked_or_an_empty_step_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"returned 4 step\(s\) for a rollout of 3; return one"):
        run_prediction(TinyCase(steps_returned=4), Topology.single(), 3, 0)

    class Empty(TinyCase):
        def predict(self, model, batch, topo, steps):
            return [{"x": batch["x"]}, {}]

    with pytest.raises(ConfigError, match=r"step 1 of the rollout is an empty dict; give each"):
        run_prediction(Empty(), Topology.single(), 2, 0)
