"""The autocast ratio rule (harness.equivalence._autocast) on hand-made records of several ranks and
several values per tensor, and a rank's run under autocast on one process: no ranks needed.

The ratio rule's basics (one rank, one value) are in tests/unit/test_rollout.py; here what
only shows with more: which rank is judged and named, a field's serial run, the floor of a
tensor of many values, and the guard over several steps."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness import Outputs, SpatialCase, Topology
from harness._records.run import FieldRecord, RunRecord, StepRecord
from harness.compare import Tolerance
from harness.equivalence._autocast import RATIO, guard, judge_autocast, ratio_rule

F64 = Tolerance.for_dtype(torch.float64)  # the high-precision run's: a logic check
RANKS = 4
SIZE = 16  # values per gradient, parameter and field
BASE = torch.linspace(1.0, 2.0, SIZE, dtype=torch.float64)


def step(loss=1.0, grad=0.0, param=0.0, field=0.0):
    """One step whose loss is ``loss`` and whose gradient, parameter and field are BASE
    moved by the given offsets (a float each, or a tensor of SIZE)."""
    return StepRecord(
        loss=torch.tensor(loss, dtype=torch.float64),
        grads={"w": BASE + grad},
        fields={"out": FieldRecord(BASE + field)},
        params={"w": BASE + 1.0 + param},
    )


def record(*steps):
    # the parameter as built: what ``step(param=-1.0)`` holds, bit for bit
    return RunRecord(init={"w": BASE + 1.0 + -1.0}, steps=list(steps))


HIGH = record(step())
SERIAL = record(step(loss=1.01, grad=0.01, param=0.01, field=0.01))  # 0.01 per value off


def ranks(**wrong):
    """RANKS ranks as the high-precision run, but ``wrong[rank]`` (the ``step`` arguments of
    that rank)."""
    return [record(step(**wrong.get(f"r{r}", {}))) for r in range(RANKS)]


def found(records):
    return judge_autocast(HIGH, SERIAL, records, F64, spatial_size=RANKS)[0]


def where(mismatches):
    return [(m.quantity, m.name, m.step, m.rank) for m in mismatches]


def test_a_loss_gradient_or_parameter_wrong_on_one_rank_is_found_on_that_rank():
    far = 0.01 * (RATIO + 1)  # RATIO + 1 times the serial run's distance, per value
    assert found(ranks()) == []
    assert where(found(ranks(r2={"loss": 1.0 + far}))) == [("loss", "loss", 0, 2)]
    assert where(found(ranks(r1={"grad": far}))) == [("grad", "w", 0, 1)]
    assert where(found(ranks(r3={"param": far}))) == [("param", "w", 0, 3)]


def test_of_several_ranks_out_of_bounds_the_mismatch_names_the_worst():
    records = ranks(r1={"loss": 1.0 + 0.01 * (RATIO + 1)}, r2={"loss": 1.0 + 0.01 * (RATIO + 3)})
    [m] = found(records)
    assert m.rank == 2 and m.max_rel == pytest.approx(RATIO + 3)


def test_a_field_is_judged_against_the_serial_runs_own_field():
    # the serial field 0.01 per value from the high-precision one: the ranks' may be up to
    # RATIO times as far
    inside = [record(step(field=0.01 * (RATIO - 1))) for _ in range(RANKS)]
    assert found(inside) == []
    outside = [record(step(field=0.01 * (RATIO + 1))) for _ in range(RANKS)]
    assert where(found(outside)) == [("field", "out", 0, None)]


def test_where_autocast_changed_nothing_the_floor_is_the_elementwise_tolerance_over_every_value():
    # serial == high: only the floor, float64's atol per value, as an L2 norm over SIZE
    # values (atol * sqrt(SIZE)), plus rtol of the tensor's norm
    high = record(
        StepRecord(
            torch.tensor(1.0, dtype=torch.float64),
            fields={"out": FieldRecord(torch.zeros(SIZE, dtype=torch.float64))},
        )
    )
    bound = F64.field

    def field_off(by):
        st = StepRecord(
            torch.tensor(1.0, dtype=torch.float64),
            fields={"out": FieldRecord(torch.full((SIZE,), by, dtype=torch.float64))},
        )
        return judge_autocast(high, high, [record(st)], F64, spatial_size=1)[0]

    # every value within atol: in bounds, though the L2 distance is 3.6x atol
    assert field_off(0.9 * bound.atol) == []
    assert where(field_off(1.1 * bound.atol)) == [("field", "out", 0, None)]


def test_a_loss_zero_at_some_steps_only_and_parameters_moving_late_are_not_vacuous():
    moves_late = record(step(loss=0.0, param=-1.0), step(loss=0.5))  # step 0: still init
    assert guard(moves_late, "case") == []
    [m] = guard(record(step(loss=0.0), step(loss=0.0)), "case")
    assert "the loss is zero at every step" in m.where
    [m] = guard(record(step(param=0.5), step(param=-1.0)), "case")  # back at init at the end
    assert "no parameter moved in training" in m.where


def test_the_ratio_rule_puts_the_guards_finding_first_in_the_report():
    vacuous = record(step(loss=0.0))
    report = SimpleNamespace(
        dtype="float64", tolerance=F64, spatial_size=RANKS, mismatches=["earlier"], notes=[]
    )
    same = [vacuous] * RANKS
    ratio_rule(SimpleNamespace(label="case"), report, vacuous, vacuous, same, torch.bfloat16)
    assert [getattr(m, "quantity", m) for m in report.mismatches] == ["vacuous", "earlier"]
    assert report.dtype == "float64, bfloat16 autocast"
    assert report.notes[0].startswith("autocast bfloat16 changed nothing")


class Linear(SpatialCase):
    """A float32 linear layer: a matmul, which bf16 autocast runs at bf16."""

    dtype = torch.float32

    def build(self, topo):
        return torch.nn.Linear(8, 4)

    def batch(self, topo, step):
        return {"x": torch.randn(32, 8)}

    def forward(self, model, batch, topo):
        out = model(batch["x"])
        return Outputs(out.square().mean(), {"out": out})


def test_a_ranks_training_run_under_autocast_computes_what_the_serial_autocast_run_does(
    monkeypatch,
):
    from harness._rank.run import run_case
    from harness.equivalence._autocast import _autocast_entry, serial_run

    # one rank, in this process: its topology the single process's
    monkeypatch.setattr(Topology, "create", staticmethod(lambda *a, **k: Topology.single()))
    rank = _autocast_entry(torch.bfloat16, Linear(), None, 2, 0.1, 0)
    serial, _, _ = serial_run(Linear(), torch.bfloat16, 2, 0.1, 0)
    high = run_case(Linear(), Topology.single(), 2, 0.1, 0)
    for k in range(2):
        assert torch.equal(rank.steps[k].loss, serial.steps[k].loss)
        assert torch.equal(rank.steps[k].fields["out"].values, serial.steps[k].fields["out"].values)
    assert rank.steps[0].fields["out"].values.dtype == torch.bfloat16
    assert not math.isclose(float(rank.steps[1].loss), float(high.steps[1].loss), rel_tol=1e-6)
