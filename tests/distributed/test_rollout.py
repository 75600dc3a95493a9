"""Inference rollouts judged step by step against the reference's own rounding spread, on a
chaotic float32 ring (tests/distributed/ring.py) split over the ranks."""

from __future__ import annotations

import pytest
import torch

from harness import ConfigError, Tolerance, check_equivalence
from harness.steppers.mlp import CoupledMLPCase
from tests.distributed.ring import RingCase

pytestmark = pytest.mark.assumes_ranks(4)


def test_a_correct_chaotic_float32_rollout_passes_at_150_steps_where_a_fixed_tolerance_fails(
    spatial,
):
    report = spatial.check(RingCase(), rollout=150)
    record = report.rollout
    assert record is not None and record.first is None
    state = record.field_curve("state")
    assert [p.step for p in state] == list(range(150))
    # rounding alone grew by chaos: the ensemble's spread and the partitioned run's own
    # distance from the reference are orders of magnitude larger at the end than at the start
    assert state[-1].spread > 1e3 * state[0].spread
    # ... so far that float32's fixed field tolerance, fine for two training steps, fails a
    # correct rollout: the last step is beyond atol + rtol * |reference|
    fixed = Tolerance.for_dtype(torch.float32).field
    last = state[-1]
    assert last.error > fixed.atol + fixed.rtol * last.scale
    assert "Rollout: 150 steps within 10x the rounding spread" in str(report)


def test_serial_rollouts_run_beside_the_ranks_judge_exactly_what_they_judged_run_before_them(
    spatial, monkeypatch
):
    import harness.rollout as rollout

    case, pool = RingCase("stale-halo"), spatial.pool(4)
    beside = check_equivalence(case, ranks=4, pool=pool, rollout=20).rollout
    monkeypatch.setattr(rollout, "OVERLAP", False)
    before = check_equivalence(case, ranks=4, pool=pool, rollout=20).rollout
    assert beside is not None and before is not None
    # every run is deterministic (seeded, one thread): the same numbers, whatever the order
    assert [(p.step, p.name, p.error, p.spread) for p in beside.curve] == [
        (p.step, p.name, p.error, p.spread) for p in before.curve
    ]
    assert beside.first is not None and beside.first.step == 1


@pytest.mark.parametrize(("fault", "enters"), [("stale-halo", 1), ("local-mean", 0)])
def test_an_inference_only_bug_fails_at_the_step_where_it_enters_naming_the_field(
    spatial, fault, enters
):
    report = check_equivalence(RingCase(fault), ranks=4, pool=spatial.pool(4), rollout=150)
    assert report.quantities == {"rollout"}, report
    first = report.rollout.first
    assert (first.step, first.name) == (enters, "state")
    # every step before it is inside the envelope: the bug is named where it enters
    assert not any(p.divergent for p in report.rollout.curve if p.step < enters)
    text = str(report)
    assert f"First divergent step: step {enters} of 150, field 'state'" in text
    assert first.ratio > 100  # far outside rounding: a bug, not a tolerance question


@pytest.mark.parametrize("fault", ["stale-halo", "local-mean"])
def test_training_only_checks_of_a_case_with_inference_bugs_are_unchanged(spatial, fault):
    report = check_equivalence(RingCase(fault), ranks=4, pool=spatial.pool(4))
    assert report.ok, report
    assert report.rollout is None


def test_the_cases_rollout_steps_asks_for_a_rollout_without_the_argument(spatial):
    report = check_equivalence(
        RingCase("local-mean", rollout_steps=3), ranks=4, pool=spatial.pool(4)
    )
    assert report.rollout is not None and report.rollout.steps == 3
    assert report.rollout.first.step == 0


def test_a_rollout_of_a_case_without_predict_is_one_clear_error(spatial):
    with pytest.raises(ConfigError, match=r"has no predict.*define predict\(self, model, batch"):
        check_equivalence(CoupledMLPCase(), ranks=4, pool=spatial.pool(4), rollout=2)


def test_a_rollout_with_data_groups_compares_each_groups_samples(spatial):
    from harness.steppers.healpix import HealpixCase

    case = HealpixCase(nside=2, batch_size=4)
    report = check_equivalence(case, ranks=4, spatial_size=2, pool=spatial.pool(4), rollout=3)
    assert report.ok, report
    assert [p.step for p in report.rollout.curve] == [0, 1, 2]


class RaisingRing(RingCase):
    """A ring whose predict raises on spatial rank 2 (module level: the ranks import it)."""

    def predict(self, model, batch, topo, steps):
        if topo.spatial_rank == 2:
            raise RuntimeError("no forcing file for this tile")
        return super().predict(model, batch, topo, steps)


class RaisingReferenceRing(RingCase):
    """A ring whose predict raises in the reference only (module level: ranks import it)."""

    def predict(self, model, batch, topo, steps):
        if topo.is_reference:
            raise RuntimeError("the serial forcing reader is broken")
        return super().predict(model, batch, topo, steps)


def test_a_reference_whose_rollout_raises_is_an_error_of_the_reference(spatial):
    report = check_equivalence(RaisingReferenceRing(), ranks=4, pool=spatial.pool(4), rollout=3)
    [error] = [m for m in report.mismatches if m.quantity == "error"]
    assert (error.run, error.phase) == ("reference", "rollout predict"), report
    assert "RuntimeError: the serial forcing reader is broken" in error.where


# rank 2 raises while the others exchange halos: in place that takes pytest with it
@pytest.mark.spatial_pool
def test_a_rank_that_raises_in_predict_is_an_error_naming_the_rank_and_phase(spatial):
    report = check_equivalence(RaisingRing(), ranks=4, pool=spatial.pool(4), rollout=3)
    assert "error" in report.quantities, report
    error = next(m for m in report.mismatches if m.quantity == "error")
    assert error.rank == 2 and error.phase == "rollout predict"
    assert "no forcing file for this tile" in error.detail
