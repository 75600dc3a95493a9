"""Every serial run of a check (the reference, its nudged reruns, the serial rollouts) stops
at the check's timeout, as the ranks' run does, and the report says which part ran out
(``harness._rank.deadline``). In this process: a runner that runs the rank's function in
place (``InProcess``), so nothing here waits on a pool."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch

from harness import Outputs, SpatialCase, Topology, check_equivalence
from harness._rank.deadline import Deadline, RanOut
from harness._rank.predict import run_prediction
from harness._rank.run import run_case
from harness.case.declared import CheckSpec
from harness.compare import Quantity
from harness.equivalence._calibrate import calibrate


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)


class Tiny(SpatialCase):
    """Four numbers through a linear layer; ``slow``: seconds each serial run of a kind
    sleeps per step ("member": nudged rollouts, "rerun": nudged training reruns)."""

    dtype = torch.float32
    builds: ClassVar[list[str]] = []

    def __init__(self, slow: str = "", seconds: float = 0.0) -> None:
        self.slow, self.seconds = slow, seconds

    def build(self, topo):
        torch.manual_seed(0)
        return Scale()

    def batch(self, topo, step):
        return torch.linspace(-1.0, 1.0, 4)

    def forward(self, model, batch, topo):
        out = model(batch)
        if self.slow == "rerun" and _nudged(model):
            time.sleep(self.seconds)
        return Outputs(out.sum(), {"x": out})

    def predict(self, model, batch, topo, steps):
        x, out = batch, []
        for _ in range(steps):
            if self.slow == "member" and _nudged(model):
                time.sleep(self.seconds)
            x = torch.tanh(model(x))
            out.append({"x": x})
        return out


def _nudged(model) -> bool:
    """Whether ``model`` is a nudged rerun's: its weights moved off the seeded ones."""
    torch.manual_seed(0)
    return not torch.equal(model.inner.weight, torch.nn.Linear(4, 4).weight)


def test_a_rollout_of_a_billion_steps_ends_in_a_report_naming_the_serial_reference(in_process):
    # it returns at all (before, it never did), and says which part ran out
    report = check_equivalence(Tiny(), ranks=1, pool=in_process, rollout=10**9, timeout=1.0)
    (out,) = [m for m in report.mismatches if m.quantity is Quantity.TIMEOUT]
    assert out.run == "reference" and out.phase.startswith("rollout")
    text = str(report)
    assert "the serial reference (this process) ran past the check's timeout of 1 s" in text


def test_a_training_reference_of_a_million_steps_is_a_timeout_of_the_reference(in_process):
    report = check_equivalence(
        Tiny(), ranks=1, pool=in_process, steps=10**6, timeout=1.0, calibrate=False
    )
    assert [(m.quantity, m.run) for m in report.mismatches] == [(Quantity.TIMEOUT, "reference")]
    assert report.mismatches[0].phase.startswith("step ")  # where it was when time ran out


def test_nudged_training_reruns_that_run_out_leave_the_verdict_on_the_tolerance(in_process):
    # each nudged rerun sleeps 0.6 s per step: two steps pass the 1 s clock in the first
    report = check_equivalence(Tiny("rerun", 0.6), ranks=1, pool=in_process, timeout=1.0)
    assert report.ok, report
    (line,) = [d for d in report.diagnoses if d.startswith("Not calibrated:")]
    assert "nudged reruns of the reference ran past the check's timeout of 1 s (0 of 4" in line
    assert line.endswith("judged by the tolerance")


def test_nudged_rollouts_that_run_out_judge_by_the_members_done_and_say_so(in_process):
    report = check_equivalence(
        Tiny("member", 0.4), ranks=1, pool=in_process, rollout=3, timeout=1.0, calibrate=False
    )
    assert report.ok, report
    assert report.rollout is not None and report.rollout.members == 0
    assert (
        "Not calibrated: the nudged reruns of the rollout ran past the check's timeout of 1 s "
        "(0 of 4 done); judged by the check's field tolerance alone"
    ) in str(report)


def test_a_rerun_stopped_by_its_clock_leaves_no_spreads_and_says_how_far_it_got():
    case = Tiny()
    reference = run_case(case, Topology.single(), 2, 0.1, 0)
    past = Deadline(at=0.0, seconds=5.0)  # a clock that has run out already
    out = calibrate(CheckSpec(4, 4), case, reference, deadline=past)
    assert out.spreads is None
    assert out.problem == (
        "the nudged reruns of the reference ran past the check's timeout of 5 s (0 of 4 done)"
    )


def test_a_predict_that_never_returns_stops_at_its_next_call_of_any_submodule():
    class Forever(Tiny):
        def predict(self, model, batch, topo, steps):
            while True:  # computes inside predict, and never through the model itself
                model.inner(batch)

    with pytest.raises(RanOut, match=r"ran past the check's timeout of 0\.2 s") as caught:
        run_prediction(Forever(), Topology.single(), 3, 0, deadline=Deadline.after(0.2))
    assert caught.value.harness_phase.startswith("rollout predict")


def test_the_clock_stops_a_run_at_once_when_the_ranks_beside_it_failed():
    clock = Deadline.after(None, stop=lambda: "stopped: the ranks' run beside it failed")
    with pytest.raises(RanOut, match="the ranks' run beside it failed"):
        run_case(Tiny(), Topology.single(), 2, 0.1, 0, progress=clock.progress)
