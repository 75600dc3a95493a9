"""A failing rollout is located: its first divergent step is rerun with hooks on every module
(``harness.equivalence._locating_rollout``) and the report names the module, the call and the
position
where the partitioned run departs, at that rollout step."""

from __future__ import annotations

import pytest
import torch

import harness.equivalence._locating_rollout as locate_rollout
from harness import check_equivalence
from harness.collectives import all_gather_uneven, spatial_sum, sync_gradients
from harness.steppers.catalogue import inference_matrix
from tests.distributed.ring import Lorenz96, N, RingCase

pytestmark = pytest.mark.assumes_ranks(4)

ROLLOUT = 6  # the bugs enter at steps 0 and 1: a short rollout shows each
FAULTS = {(s, f): (make, kw) for s, make, kw, _, f, _ in inference_matrix(4)}


def sfno(fault: str):
    make, kwargs = FAULTS[("sfno", fault)]
    return make(**kwargs, faults=(fault,))


class Halo(torch.nn.Module):
    """The ring's arc padded with two values of each neighbour (periodic), exchanged through
    every rank's edges; ``stale``: in eval mode the padding each Runge-Kutta stage received
    at the first step is kept and reused (ring.py's stale halo, in a module of its own)."""

    def __init__(self, stale: bool) -> None:
        super().__init__()
        self.stale = stale
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, topo, stage: int) -> torch.Tensor:
        if self.stale and not self.training and stage in self.kept:
            left, right = self.kept[stage]
        else:
            edges = torch.cat([x[..., :2], x[..., -2:]], dim=-1)
            every = all_gather_uneven(edges, topo, dim=-1).unflatten(-1, (topo.spatial_size, 4))
            me, s = topo.spatial_rank, topo.spatial_size
            left, right = every[..., (me - 1) % s, 2:], every[..., (me + 1) % s, :2]
            if self.stale and not self.training:
                self.kept[stage] = (left, right)
        return torch.cat([left, x, right], dim=-1)


class HaloLorenz96(Lorenz96):
    """Lorenz-96 whose halo exchange is the module ``exchange``, called once per stage:
    four calls per step, so locating must cut the calls at the step's boundary."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__(fault)
        self.exchange = Halo(fault == "stale-halo")

    def tendency(self, x: torch.Tensor, topo, stage: int) -> torch.Tensor:
        ext = self.exchange(x, topo, stage)  # positions start - 2 .. stop + 1
        xm2, xm1, xp1 = ext[..., :-4], ext[..., 1:-3], ext[..., 3:-1]
        mean = spatial_sum(x.sum(dim=-1, keepdim=True), topo) / N
        return (xp1 - xm2) * xm1 - self.damping * x + self.forcing + self.coupling * (mean - x)


class HaloRingCase(RingCase):
    """The ring with its halo exchange in a module (module level: the ranks import it)."""

    def build(self, topo):
        model = HaloLorenz96(self.fault)
        sync_gradients(model, topo)
        return model


def test_a_stale_halo_in_predict_is_located_at_the_halo_modules_first_call_of_step_1(spatial):
    report = check_equivalence(
        HaloRingCase("stale-halo"), ranks=4, pool=spatial.pool(4), rollout=ROLLOUT
    )
    assert report.quantities == {"rollout"}, report  # the verdict is the rollout's
    found = report.first_divergence
    assert found is not None, report
    # the first of the step's four calls: its calls are counted from step 1's first on
    assert (found.module, found.quantity, found.step) == ("exchange", "output", 1), report
    assert (found.call, found.calls) == (0, 4), report
    assert report.location is not None and report.location.step == 1
    assert "variable" in found.where  # the ring's position, as its partition names it
    assert (
        "First divergence: forward of 'exchange' (Halo) (call 1 of 4), rollout step 1 of "
        f"{ROLLOUT}: inputs match" in str(report)
    ), report


def test_the_rings_stale_halo_is_located_in_the_model_at_rollout_step_1(spatial):
    report = check_equivalence(RingCase("stale-halo"), ranks=4, pool=spatial.pool(4), rollout=20)
    found = report.first_divergence
    assert found is not None, report
    assert (found.module, found.quantity, found.step) == ("", "output", 1), report
    assert found.where.startswith("[") and "variable" in found.where, found
    assert "First divergence: forward of '' (Lorenz96), rollout step 1 of 20" in str(report)


def test_sfnos_cached_global_mean_is_located_in_the_stepper_at_rollout_step_1(spatial):
    report = check_equivalence(
        sfno("inference-cached-mean"), ranks=4, pool=spatial.pool(4), rollout=ROLLOUT
    )
    found = report.first_divergence
    assert found is not None, report
    # the mean is the stepper's own code: what it feeds the SHT departs, what it was fed not
    assert (found.module, found.module_type, found.step) == ("", "SFNOStepper", 1), report
    assert found.quantity == "input of 'sht'", found
    assert "lat" in found.where and "lon" in found.where, found
    assert f"First divergence: forward of '' (SFNOStepper), rollout step 1 of {ROLLOUT}" in str(
        report
    )


def test_sfnos_noise_seeded_per_rank_is_located_where_it_is_drawn_at_rollout_step_0(spatial):
    report = check_equivalence(
        sfno("inference-noise-per-rank"), ranks=4, pool=spatial.pool(4), rollout=ROLLOUT
    )
    found = report.first_divergence
    assert found is not None, report
    # the stepper draws the noise and feeds it, with the state, to its encoder
    assert (found.module, found.quantity, found.step) == ("", "input of 'encoder'", 0), report
    assert f"rollout step 0 of {ROLLOUT}: input of 'encoder'" in str(report)


def test_a_step_counter_kept_per_rank_is_located_in_predicts_own_code(spatial):
    report = check_equivalence(
        sfno("step-counter-per-rank"), ranks=4, pool=spatial.pool(4), rollout=ROLLOUT
    )
    found = report.first_divergence
    assert found is not None, report
    # the forcing is added by predict's loop, before the model's call: no module made it
    assert (found.module, found.quantity, found.step) == (None, "input of ''", 1), report
    assert found.name == locate_rollout.PREDICT_CODE, found
    text = str(report)
    assert f"First divergence: forward of {locate_rollout.PREDICT_CODE}, rollout step 1" in text
    assert "look at what predict" in text  # the remedy speaks of predict, not of a batch


def test_a_correct_rollout_is_not_located(spatial):
    report = check_equivalence(HaloRingCase(), ranks=4, pool=spatial.pool(4), rollout=ROLLOUT)
    assert report.ok, report
    assert report.location is None and report.first_divergence is None
    assert "First divergence" not in str(report)


def test_a_rollout_locating_that_raises_is_a_not_located_line_under_the_verdict(
    spatial, monkeypatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(locate_rollout, "first_divergence", broken)
    report = check_equivalence(RingCase("stale-halo"), ranks=4, pool=spatial.pool(4), rollout=4)
    assert report.quantities == {"rollout"} and report.rollout.first.step == 1, report
    assert report.first_divergence is None
    assert (
        "First divergence: not located: rollout step 1 of 4: judging the hooked rerun raised "
        "RuntimeError: boom" in str(report)
    ), report


def test_a_rollout_whose_departure_is_under_locatings_floors_says_so_and_the_verdict_stands(
    spatial, monkeypatch
):
    real = locate_rollout.first_divergence
    # no quantity departs: what a bug inside the envelope's 10x but under 1000x floors gives
    monkeypatch.setattr(
        locate_rollout,
        "first_divergence",
        lambda *args, **kwargs: real(*args, **{**kwargs, "depart": float("inf")}),
    )
    report = check_equivalence(RingCase("stale-halo"), ranks=4, pool=spatial.pool(4), rollout=4)
    assert report.quantities == {"rollout"}, report
    assert report.first_divergence is None
    assert report.location is not None and report.location.compared > 0, report
    assert (
        "First divergence: not located: rollout step 1 of 4 rerun with hooks on every module: "
        "no module's input or output, nor a field, departs beyond 1000x its noise floor"
        in str(report)
    ), report
