"""The session's summary tells everything that ran: one labelled row per check, sweep and
Hypothesis test, and a progress line while a sweep runs."""

from __future__ import annotations

import itertools
import re

# four tests whose checks share the case and its partition text: only the label tells them apart
FOUR = """
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from harness import Outputs, Shard, SpatialCase, check_equivalence, data_share
from harness.collectives import reduce_loss, sync_gradients

class Scale(SpatialCase):
    # 2 samples of 8 points: the samples split over data groups, the points over space
    dtype = torch.float64

    def build(self, topo):
        model = torch.nn.Linear(1, 1)
        sync_gradients(model, topo)
        return model

    def batch(self, topo, step):
        x = torch.randn(2, 8, 1)[data_share(2, topo)]
        n = 8 // topo.spatial_size
        return x[:, topo.spatial_rank * n:(topo.spatial_rank + 1) * n]

    def forward(self, model, x, topo):
        y = model(x)
        loss = reduce_loss((y ** 2).sum(), topo) / x.shape[0]  # a mean over samples
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        n = x.shape[1]
        idx = torch.arange(topo.spatial_rank * n, (topo.spatial_rank + 1) * n)
        return Outputs(loss, {"y": Shard(y, idx, dim=1)})

def test_plain(spatial):
    spatial.check(Scale(), ranks=2)

def test_sweep(spatial):
    spatial.check_layouts(Scale(), max_ranks=2)

def test_direct(spatial):
    check_equivalence(Scale(), ranks=2, pool=spatial.pool(2)).raise_if_failed()

@settings(
    max_examples=3,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.integers(0, 2))
def test_drawn(spatial, n):
    check_equivalence(Scale(), ranks=2, pool=spatial.pool(2)).raise_if_failed()
"""


def _rows(text: str) -> list[str]:
    """The equivalence table's rows (after its header and rule)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "spatial equivalence" in line)
    rows = []
    for line in lines[start + 4 :]:
        if not line.strip() or line.startswith("="):
            break
        rows.append(line)
    return rows


def test_every_check_sweep_and_hypothesis_test_has_a_labelled_row(pytester):
    pytester.makepyfile(test_four=FOUR)
    result = pytester.runpytest_subprocess("--spatial-ranks=2", "-p", "no:randomly", "-v")
    result.assert_outcomes(passed=4)
    rows = _rows(result.stdout.str())
    labels = sorted(re.split(r"\s{2,}", row)[2] for row in rows)
    # a sweep of max_ranks=2 (mesh_dims 1): 1 rank; 2 data groups of 1; spatial 2
    assert labels == ["examples 3", "layouts 3 of 3 (covering)", "steps 2", "steps 2"], rows
    assert len(set(rows)) == 4  # distinguishable, though case and partition are alike
    # -v: the sweep says how far it is while it runs, a line per layout as it ends (the
    # world sizes run side by side: the 2-rank layouts may end first), counted 1, 2, 3
    out = result.stdout.str()
    lines = [x for x in out.splitlines() if x.startswith("Scale: layouts: ")]
    assert [x.split()[2] for x in lines] == ["1", "2", "3"], lines
    assert sorted(x.split("of 3) ")[1] for x in lines) == [
        "(1 rank: grid 1: pass)",
        "(2 ranks: grid 1, 2 data groups: pass)",
        "(2 ranks: grid 2: pass)",
    ]
    assert out.index("test_sweep") < out.index(lines[0])


def test_under_xdist_the_controller_has_every_row_and_no_worker_writes_progress(pytester):
    pytester.makepyfile(test_four=FOUR)
    result = pytester.runpytest_subprocess(
        "--spatial-ranks=2", "-p", "no:randomly", "-v", "-n", "2"
    )
    result.assert_outcomes(passed=4)
    labels = sorted(re.split(r"\s{2,}", row)[2] for row in _rows(result.stdout.str()))
    assert labels == ["examples 3", "layouts 3 of 3 (covering)", "steps 2", "steps 2"]
    # a worker's line would land between the controller's result lines, or nowhere
    assert "layouts: 1 (covering" not in result.stdout.str()


def test_a_hypothesis_tests_examples_fold_into_one_row_failing_if_any_failed():
    from harness.plugin.summary import fold_rows

    def row(partition: str, grad: float | None, ok: bool) -> dict:
        worst = {"loss": 1e-16, "grad": grad, "field": None, "param": None}
        problems = [] if ok else ["grad"]
        return {"case": "Scale", "ranks": 4, "spatial": 4, "partition": partition,
                "dtype": "float64", "worst": worst, "ok": ok, "problems": problems,
                "seconds": 0.5, "label": "steps 2", "test": "t.py::test_drawn"}  # fmt: skip

    folded = fold_rows(
        [row("2x2", 1e-15, True), row("4x1", 0.3, False), row("2x2", None, True)], "examples 3"
    )
    assert folded == {
        "case": "Scale",
        "ranks": 4,
        "spatial": 4,
        "partition": "2 partitions",
        "dtype": "float64",
        "worst": {"loss": 1e-16, "grad": 0.3, "field": None, "param": None},
        "ok": False,
        "problems": ["grad"],
        "seconds": 1.5,
        "label": "examples 3",
        "test": "t.py::test_drawn",
    }


ROLLOUT = """
from harness.steppers.healpix import HealpixCase

def test_rollout(spatial):
    spatial.check(HealpixCase(), rollout=40)
"""


def test_a_long_rollout_says_which_step_it_is_in_while_it_runs_where_someone_watches(pytester):
    # read every 20 ms instead of every 5 s, so a rollout of 40 steps says where it is
    pytester.makeconftest("import harness.plugin.summary as s\ns.ROLLOUT_EVERY = 0.02\n")
    pytester.makepyfile(test_roll=ROLLOUT)
    watched = pytester.runpytest_subprocess("--spatial-ranks=2", "-v")
    watched.assert_outcomes(passed=1)
    # rank 0's rollout phases, each said once as it changes (its predict returns every step
    # at the end, and calls the model functionally: no step or call count to show)
    said = re.findall(r"^healpix: (rollout.*)$", watched.stdout.str(), flags=re.M)
    assert "rollout predict (rollout of 40 steps)" in said, watched.stdout.str()
    assert all(a != b for a, b in itertools.pairwise(said))
    quiet = pytester.runpytest_subprocess("--spatial-ranks=2")  # no terminal, no -v: no lines
    quiet.assert_outcomes(passed=1)
    assert "healpix: rollout" not in quiet.stdout.str()


def test_a_rollout_phase_reads_as_its_step_its_model_calls_or_as_it_is():
    from harness.plugin.summary import _rollout_phase

    assert _rollout_phase("rollout step 6 predict", 40) == "rollout: step 7 of 40"
    calls = "rollout predict (3 model calls so far, rollout of 40 steps)"
    assert _rollout_phase(calls, 40) == "rollout: 3 model calls, of 40 steps"
    assert _rollout_phase("rollout build", 40) == "rollout build"
    assert _rollout_phase("step 1 backward", 40) == ""  # the training before it: no line
