"""What a failed rollout says: the phase and step of a failure in ``predict`` (listed or
yielded steps), a step's bad value named as ``predict``'s, a bad ``Shard`` as one
``ConfigError`` where it is made, and the report's header and step column. One process,
``run_prediction`` on the reference's topology: no ranks needed."""

from __future__ import annotations

import pytest
import torch

from harness import ConfigError, EquivalenceReport, Outputs, Shard, SpatialCase, Topology
from harness.compare import Mismatch
from harness.rollout import run_prediction


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.gain * x


class Rolled(SpatialCase):
    """A rollout of ``gain * x``; ``fail_at`` raises before the model call of that step,
    ``bad`` puts a value of another kind at step 2; ``yields`` gives the steps one by one,
    ``stop`` of them only."""

    name = "rolled"
    dtype = torch.float64

    def __init__(self, fail_at=None, bad=None, yields=False, stop=None, build_none=False):
        self.fail_at, self.bad, self.yields = fail_at, bad, yields
        self.stop, self.build_none = stop, build_none

    def build(self, topo):
        return None if self.build_none else Scale()

    def batch(self, topo, step):
        return torch.ones(4)

    def forward(self, model, batch, topo):
        out = model(batch)
        return Outputs(out.sum(), {"x": out})

    def steps(self, model, x, steps):
        for k in range(steps if self.stop is None else self.stop):
            if k == self.fail_at:
                raise RuntimeError(f"no forcing for step {k}")
            x = model(x)
            yield {"x": self.bad if k == 2 and self.bad is not None else x}

    def predict(self, model, batch, topo, steps):
        given = self.steps(model, batch, steps)
        return given if self.yields else list(given)


def phase_of(case, steps=4, progress=None):
    with pytest.raises((RuntimeError, ConfigError)) as caught:
        run_prediction(case, Topology.single(), steps, 0, progress=progress)
    return caught.value, caught.value.harness_phase


def test_a_raise_inside_a_listing_predict_says_how_many_model_calls_ran_not_build():
    exc, phase = phase_of(Rolled(fail_at=2))
    assert str(exc) == "no forcing for step 2"
    # two calls began (steps 0 and 1); the step itself is the case's to know
    assert phase == "rollout predict (2 model calls so far, rollout of 4 steps)"


def test_a_raise_inside_a_yielding_predict_names_the_step_it_was_computing():
    _, phase = phase_of(Rolled(fail_at=2, yields=True))
    assert phase == "rollout step 2 predict"


def test_build_and_batch_failures_of_a_rollout_are_named_so():
    exc, phase = phase_of(Rolled(build_none=True))
    assert phase == "rollout build" and "rolled.build returned None" in str(exc)


def test_the_board_is_told_each_phase_so_a_hang_shows_where_the_rollout_is():
    told: list[tuple[str, int | None]] = []
    run_prediction(Rolled(), Topology.single(), 2, 0, progress=lambda p, s: told.append((p, s)))
    assert [p for p, _ in told] == [
        "rollout build",
        "rollout batch",
        "rollout predict (rollout of 2 steps)",
        "rollout predict (1 model call so far, rollout of 2 steps)",
        "rollout predict (2 model calls so far, rollout of 2 steps)",
        "rollout step 0 fields",
        "rollout step 1 fields",
        "teardown",
    ]
    # no step number: the board's step is a training step's, and a rollout's would mislead
    assert {s for _, s in told} == {None}


def test_a_yielding_predict_gives_the_records_a_listing_one_does():
    listed = run_prediction(Rolled(), Topology.single(), 3, 0)
    yielded = run_prediction(Rolled(yields=True), Topology.single(), 3, 0)
    assert [float(r["x"].values[0]) for r in yielded] == [0.5, 0.25, 0.125]
    assert [r["x"].values.tolist() for r in listed] == [r["x"].values.tolist() for r in yielded]


def test_a_predict_that_yields_on_is_taken_for_the_steps_asked_and_closed_before_teardown():
    said = []

    class Endless(Rolled):
        def predict(self, model, batch, topo, steps):
            try:
                while True:
                    batch = model(batch)
                    yield {"x": batch}
            finally:
                said.append("closed")

        def teardown(self, model, topo):
            said.append("teardown")

    assert len(run_prediction(Endless(), Topology.single(), 3, 0)) == 3
    assert said == ["closed", "teardown"]  # its own clean-up runs before the case's


def test_a_predict_that_yields_too_few_steps_is_one_clear_error_at_the_missing_step():
    exc, phase = phase_of(Rolled(yields=True, stop=2), steps=3)
    assert isinstance(exc, ConfigError)
    assert str(exc).startswith("rolled.predict yielded 2 step(s) for a rollout of 3; yield one")
    assert phase == "rollout step 2 predict"


@pytest.mark.parametrize("yields", [False, True], ids=["listed", "yielded"])
def test_a_steps_value_of_another_kind_is_named_as_predicts_at_its_step(yields):
    exc, phase = phase_of(Rolled(bad=1.5, yields=yields))
    assert str(exc).startswith(
        "rolled.predict step 2: field 'x' is a float; give a torch.Tensor (the whole field)"
    )
    assert phase == ("rollout step 2 predict" if yields else "rollout step 2 fields")


def test_a_steps_shard_with_a_bad_index_is_named_as_predicts_at_its_step():
    exc, _ = phase_of(Rolled(bad=Shard(torch.ones(4), torch.ones(4), 0)))
    assert str(exc).startswith("rolled.predict step 2: Shard of field 'x' has a float32 index")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Shard([1.0, 2.0], torch.arange(2), 0), "Shard: values is a list; give"),
        (
            lambda: Shard.grid([[1.0]], slice(0, 1), slice(0, 1), 1, 1),
            "Shard.grid: values is a list; give",
        ),
        (lambda: Shard.keyed((1.0,), [0]), "Shard: values is a tuple; give"),
        (lambda: Shard(torch.ones(2), torch.arange(2), dim="x"), "Shard: dim='x' (a str); give"),
        (lambda: Shard(torch.ones(2), torch.arange(2), dim=0.0), "Shard: dim=0.0 (a float); give"),
    ],
    ids=["list", "grid-list", "keyed-tuple", "dim-str", "dim-float"],
)
def test_a_shard_of_values_that_are_no_tensor_is_one_config_error_where_it_is_made(make, message):
    with pytest.raises(ConfigError) as caught:
        make()
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_a_shards_numpy_integer_dim_is_an_int():
    np = pytest.importorskip("numpy")
    assert Shard(torch.ones(2), torch.arange(2), dim=np.int64(0)).dim == 0


# ---------------------------------------------------------------------- the report


def report(*mismatches, rollout_steps=0):
    return EquivalenceReport(
        case="ring",
        ranks=4,
        spatial_size=4,
        partition="",
        steps=2,
        dtype="float32",
        tolerance=None,
        mismatches=list(mismatches),
        rollout_steps=rollout_steps,
    )


def step_cell(m: Mismatch) -> list[str]:
    """The words of the step column of ``m``'s row of the table (the name is "ring")."""
    line = next(x for x in str(report(m)).splitlines() if x.startswith(str(m.quantity)))
    return line.split("  ring  ")[1].split()


@pytest.mark.parametrize(
    ("phase", "cell"),
    [
        ("rollout predict (2 model calls so far, rollout of 4 steps)", "rollout"),
        ("rollout step 2 predict", "rollout 2"),
        ("rollout build", "rollout"),
        ("teardown", "teardown"),
        ("build", "build"),
        ("", "build"),
    ],
)
def test_the_tables_step_says_where_a_failure_was_not_build(phase, cell):
    m = Mismatch("error", "ring", None, 1, where="RuntimeError: no", phase=phase)
    words = step_cell(m)
    assert words[: len(cell.split())] == cell.split()
    assert words[len(cell.split())] == "1"  # then the rank column


def test_a_training_steps_failure_keeps_its_step_number():
    m = Mismatch("error", "ring", 1, 2, where="RuntimeError: no", phase="step 1 forward")
    assert step_cell(m)[:2] == ["1", "2"]


def test_the_header_of_a_check_with_a_rollout_says_both_runs_steps():
    m = Mismatch("error", "ring", None, 1, where="RuntimeError: no", phase="rollout build")
    assert str(report(m, rollout_steps=4)).startswith(
        "ring on 4 ranks (spatial 4), 2 training steps and a rollout of 4, float32: 1 mismatch"
    )
    assert str(report(m)).startswith("ring on 4 ranks (spatial 4), 2 steps, float32: ")


# ---------------------------------------------------------------------- odd shapes


def judged(ref_rows: int, rows: list[int]):
    """One step of field 'state': the reference's ``(ref_rows, 8)``, rank r's shard of
    columns 2r..2r+1 with ``rows[r]`` rows; each member the reference itself."""
    from harness._records.run import FieldRecord
    from harness.compare import Bound
    from harness.rollout import judge_rollout

    ref = [{"state": FieldRecord(torch.ones(ref_rows, 8, dtype=torch.float64))}]
    ranks = [
        [
            {
                "state": FieldRecord(
                    torch.ones(n, 2, dtype=torch.float64), torch.arange(2 * r, 2 * r + 2), -1
                )
            }
        ]
        for r, n in enumerate(rows)
    ]
    return judge_rollout(ref, [ref], ranks, Bound(0.0, 0.0), spatial_size=len(rows))


def test_a_shape_only_rank_0_and_the_reference_share_blames_rank_0_not_the_others():
    record = judged(1, [1, 2, 2, 2])
    [m] = record.mismatches
    assert (m.quantity, m.name, m.step, m.rank) == ("field", "state", 0, 0)
    assert m.where == (
        "rollout step 0 of 1: rank 0 gives shape (1, 2) where ranks 1-3 give (2, 2); the "
        "reference's (1, 8) agrees with rank 0 but for the split dim, so it is no yardstick "
        "here: look at what only rank 0 and the reference run (the reference is spatial "
        "rank 0 of one)"
    )


def test_a_shape_one_rank_changed_alone_is_judged_against_the_reference():
    [m] = judged(2, [2, 2, 1, 2]).mismatches
    assert m.rank == 2 and "where the reference gives torch.float64 (2, 2)" in m.where


def test_ranks_split_evenly_over_two_shapes_are_judged_against_the_reference():
    found = judged(1, [1, 1, 2, 2]).mismatches
    assert sorted(m.rank for m in found) == [2, 3]  # no majority: the reference decides
    found = judged(3, [1, 1, 2, 2]).mismatches
    assert sorted(m.rank for m in found) == [0, 1, 2, 3]  # none is the reference's shape
    assert all("where the reference gives" in m.where for m in found)
