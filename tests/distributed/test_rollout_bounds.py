"""A check bounded in every part: the serial reference, its nudged reruns and the serial
rollouts run in the calling process beside the ranks, and stop at the check's timeout as the
ranks do; the report names the part that ran out (``harness._rank.deadline``)."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
import torch

from harness import Outputs, Topology, check_equivalence
from harness.compare import Quantity
from tests.distributed.ring import RingCase

pytestmark = pytest.mark.assumes_ranks(4)


def test_a_rollout_of_a_billion_steps_ends_in_a_report_naming_the_serial_reference(spatial):
    pool = spatial.pool(4)
    check_equivalence(RingCase(), ranks=4, pool=pool, rollout=2)  # warm: the clock is short
    # a timeout the two training steps meet on a loaded machine; the rollout cannot. It
    # returns at all (before, the serial rollout never did), naming both parts
    report = check_equivalence(RingCase(), ranks=4, pool=pool, rollout=10**9, timeout=8)
    timeouts = [m for m in report.mismatches if m.quantity is Quantity.TIMEOUT]
    (serial,) = [m for m in timeouts if m.run == "reference"]
    assert serial.phase.startswith("rollout predict")
    assert "the serial reference (this process) ran past the check's timeout of 8 s" in str(report)
    # the ranks, rolling out the same billion steps, ran out too: both parts named
    assert {m.rank for m in timeouts if m.run != "reference"} <= {0, 1, 2, 3}
    assert len(timeouts) > 1


class SlowReruns(RingCase):
    """The ring, whose nudged reruns in the calling process (every reference build after
    the first of a check) sleep ``SLEEP`` s per forward: the ranks and the reference are
    quick, the calibration is not."""

    SLEEP = 4.0
    builds: ClassVar[list[int]] = []

    def build(self, topo: Topology) -> torch.nn.Module:
        model = super().build(topo)
        if topo.is_reference:
            SlowReruns.builds.append(1)
            model.slow = len(SlowReruns.builds) > 1  # type: ignore[assignment]
        return model

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        if getattr(model, "slow", False):
            time.sleep(self.SLEEP)
        return super().forward(model, batch, topo)


def test_nudged_reruns_that_run_out_leave_a_not_calibrated_line_and_the_verdict_stands(spatial):
    pool = spatial.pool(4)
    check_equivalence(RingCase(), ranks=4, pool=pool)  # warm: the clock is short
    SlowReruns.builds.clear()
    # two steps of 4 s per rerun: the first rerun passes the 6 s clock in its second step,
    # which the ranks' two quick steps meet on a loaded machine
    report = check_equivalence(SlowReruns(), ranks=4, pool=pool, timeout=6)
    assert report.ok, report  # the ranks agree within float32's tolerance
    (line,) = [d for d in report.diagnoses if d.startswith("Not calibrated:")]
    assert "nudged reruns of the reference ran past the check's timeout of 6 s (0 of 4" in line
    assert line.endswith("judged by the tolerance")
    assert len(SlowReruns.builds) == 2  # the reference and one rerun: the others never began


class RanksRaise(RingCase):
    """The ring, whose ranks raise at once in the rollout while the serial reference would
    roll out for as long as it is let."""

    def predict(self, model: torch.nn.Module, batch: Any, topo: Topology, steps: int) -> Any:
        if not topo.is_reference:
            raise RuntimeError("the ranks' rollout broke")
        return super().predict(model, batch, topo, steps)


def test_serial_rollouts_stop_when_the_ranks_beside_them_failed_and_the_ranks_are_named(spatial):
    pool = spatial.pool(4)
    report = check_equivalence(RanksRaise(), ranks=4, pool=pool, rollout=10**9, timeout=120)
    # the ranks' error, and nothing of the reference: it was stopped, not out of time (on a
    # clock of 120 s, which this test would otherwise wait for)
    assert {m.quantity for m in report.mismatches} == {Quantity.ERROR}, report
    assert all(m.run != "reference" for m in report.mismatches)
    assert "the ranks' rollout broke" in str(report)
