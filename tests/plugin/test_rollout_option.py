"""The fixture's rollout: ``spatial.check(case, rollout=N)`` fails naming the first divergent
step, and with ``--spatial-plots`` writes the rollout's error curve."""

from __future__ import annotations

import pytest

ROLLOUT = """
from harness.steppers.sfno import SFNOCase

def test_sfno_eval_local_mean(spatial):
    spatial.check(SFNOCase(nlat=12, nlon=20, h=2, w=2, faults=("eval-local-mean",)), rollout=3)

def test_sfno_training_only(spatial):
    spatial.check(SFNOCase(nlat=12, nlon=20, h=2, w=2, faults=("eval-local-mean",)))
"""


def test_a_fixture_rollout_names_the_first_divergent_step_and_plots_its_curve(pytester):
    pytest.importorskip("matplotlib")
    pytester.makepyfile(test_roll=ROLLOUT)
    result = pytester.runpytest_subprocess("--spatial-ranks=4", "--spatial-plots=maps")
    result.assert_outcomes(failed=1, passed=1)  # the training-only check passes
    result.stdout.fnmatch_lines(
        [
            "*First divergent step: step 0 of 3, field 'state'*",
            "*Rollout error curve: maps/test_roll.test_sfno_eval_local_mean.rollout.png",
        ]
    )
    png = pytester.path / "maps" / "test_roll.test_sfno_eval_local_mean.rollout.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
