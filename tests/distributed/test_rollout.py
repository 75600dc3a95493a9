"""Inference rollouts judged step by step against the reference's own rounding spread, on a
chaotic float32 ring (tests/distributed/ring.py) split over the ranks."""

from __future__ import annotations

import pytest
import torch

from harness import ConfigError, Shard, Tolerance, check_equivalence
from harness.steppers.mlp import CoupledMLPCase
from tests.distributed.ring import RingCase
from tests.distributed.stencil import StencilCase

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
    # raised before predict called the model: no model call to count
    assert (error.run, error.phase) == ("reference", "rollout predict (rollout of 3 steps)")
    assert "RuntimeError: the serial forcing reader is broken" in error.where


# rank 2 raises while the others exchange halos: in place that takes pytest with it
@pytest.mark.spatial_pool
def test_a_rank_that_raises_in_predict_is_an_error_naming_the_rank_and_phase(spatial):
    report = check_equivalence(RaisingRing(), ranks=4, pool=spatial.pool(4), rollout=3)
    assert "error" in report.quantities, report
    error = next(m for m in report.mismatches if m.quantity == "error")
    assert error.rank == 2 and error.phase == "rollout predict (rollout of 3 steps)"
    assert "no forcing file for this tile" in error.detail
    row = next(line for line in str(report).splitlines() if line.startswith("error"))
    assert row.split()[2] == "rollout", report  # the table's step: not "build"
    assert str(report).startswith(
        "lorenz96-ring on 4 ranks (spatial 4, ring of 40), 2 training steps and a rollout of 3"
    )


class StepwiseRing(RingCase):
    """A ring whose predict yields each step's fields; at step 2, ``how`` goes wrong on
    spatial rank 1: it raises, exits, or waits for a message rank 0 never sends (rank 0
    waits for its halo in turn), or
    the shape of the state changes on spatial rank 0 (the reference is one too)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def predict(self, model, batch, topo, steps):
        import os

        x, _ = batch
        for k in range(steps):
            if k == 2 and topo.spatial_rank == 1 and not topo.is_reference:
                if self.how == "raise":
                    raise RuntimeError("no forcing file for step 2")
                if self.how == "exit":
                    os._exit(3)
                if self.how == "recv":  # from rank 0, which sends nothing: a cycle
                    torch.distributed.recv(torch.zeros(1), src=0)
            x = model(x, topo)
            state = self.shard(x, topo)
            if k == 2 and topo.spatial_rank == 0 and self.how == "shape":
                state = Shard(state.values[:1], state.index, state.dim)
            yield {"state": state}


# rank 1 raises, dies or leaves while the others exchange halos: in place that takes pytest
@pytest.mark.spatial_pool
@pytest.mark.parametrize(
    ("how", "quantity"), [("raise", "error"), ("exit", "crash"), ("recv", "deadlock")]
)
def test_a_rank_failing_in_a_yielding_predict_is_named_with_its_rollout_step(
    spatial, how, quantity
):
    report = check_equivalence(StepwiseRing(how), ranks=4, pool=spatial.pool(4), rollout=4)
    assert report.quantities == {quantity}, report
    culprit = next(m for m in report.mismatches if m.rank == 1)
    assert culprit.phase == "rollout step 2 predict", report
    assert culprit.step is None  # a rollout step is not a training step
    if how == "recv":  # every rank waits, each naming the step it waits in
        assert {m.phase for m in report.mismatches} == {"rollout step 2 predict"}, report
        assert "waits in recv" in culprit.where, report


def test_a_shape_only_rank_0_and_the_reference_get_wrong_is_blamed_on_rank_0(spatial):
    report = check_equivalence(StepwiseRing("shape"), ranks=4, pool=spatial.pool(4), rollout=4)
    [m] = [m for m in report.mismatches if m.quantity == "field"]
    assert (m.name, m.step, m.rank) == ("state", 2, 0), report
    assert "rank 0 gives shape (1, 10) where ranks 1-3 give (2, 10)" in m.where


class LeavingRing(RingCase):
    """A ring whose listing predict returns early on spatial rank 1, padding the missing
    steps with its last state, while its peers wait for its halo at step 2."""

    def predict(self, model, batch, topo, steps):
        out = super().predict(model, batch, topo, 2 if topo.spatial_rank == 1 else steps)
        return out + out[-1:] * (steps - len(out))


@pytest.mark.spatial_pool  # ranks stuck in a collective: the pool replaces them
def test_a_rank_leaving_a_listing_predict_is_named_in_the_rollout_and_the_waiters_by_calls(
    spatial,
):
    report = check_equivalence(LeavingRing(), ranks=4, pool=spatial.pool(4), rollout=4)
    assert report.quantities == {"deadlock"}, report
    by_rank = {m.rank: m.phase for m in report.mismatches}
    # the culprit returned: its phase is the rollout's, not "after build"
    assert by_rank.pop(1) == "rollout of 4 steps", report
    # the others wait inside their third model call: calls, not steps, are what is known
    assert set(by_rank.values()) == {"rollout predict (3 model calls so far, rollout of 4 steps)"}
    assert (
        report.mismatches[0]
        .headline()
        .startswith("rank 1: deadlock 'lorenz96-ring' in rollout of 4 steps: returned after")
    )


class StencilRollout(StencilCase):
    """The stencil model rolled out: each step's output as the training reports it (the
    ``transposed`` fault misplaces it on a 2 x 2 grid, never on 4 x 1)."""

    def predict(self, model, batch, topo, steps):
        x, _ = batch
        out = []
        for _ in range(steps):
            x = model(x)
            out.append({"out": self.forward(model, (x, x), topo).fields["out"]})
        return out


def test_a_rollout_runs_on_the_layout_the_check_asks_for(spatial):
    """The ranks' rollout runs on ``mesh``, as the training does: a bug that shows only on
    a 2 x 2 grid fails the rollout there (on the case's own 4 x 1 grid it would pass)."""
    pool = spatial.pool(4)
    flat = check_equivalence(
        StencilRollout("transposed"), ranks=4, pool=pool, mesh=(4, 1), rollout=2
    )
    assert flat.ok, flat
    square = check_equivalence(
        StencilRollout("transposed"), ranks=4, pool=pool, mesh=(2, 2), rollout=2, locate=False
    )
    assert "rollout" in square.quantities, square  # beside the training's own failure
