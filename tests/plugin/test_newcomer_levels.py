"""A newcomer's multi-level HEALPix model (a list of ``CellPartition``s, one per level), run
as the README writes it: ``--spatial-plots=DIR``. The failing check gets an error map per
level, never an empty ``Error maps:`` header; the summary has a row for each check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tests.distributed.healpix_levels as levels

TESTS = """
from model import LevelsCase

def test_levels_pass(spatial):
    spatial.check(LevelsCase())

def test_levels_local_mean(spatial):
    spatial.check(LevelsCase("local-mean"), steps=1)
"""


def test_a_failing_multi_level_model_gets_a_map_per_level_and_a_summary_row_per_check(pytester):
    pytest.importorskip("matplotlib")
    pytester.makepyfile(model=Path(levels.__file__).read_text(), test_levels=TESTS)
    result = pytester.runpytest_subprocess("--spatial-ranks=4", "--spatial-plots=maps")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    maps = sorted(p.name for p in (pytester.path / "maps").glob("*.png"))
    # the fine level's forecast (nside 4) and the coarse level's latent field (nside 2)
    assert maps == [
        "test_levels.test_levels_local_mean.forecast.step0.png",
        "test_levels.test_levels_local_mean.latent.step0.png",
    ], out
    listed = re.search(r"Error maps:\n((?:  \S.*\n)+)", out)
    assert listed is not None, out  # the header is followed by its maps, never empty
    assert "Not plotted" not in out
    table = out.split("spatial equivalence")[-1].splitlines()
    rows = [line.split()[:2] for line in table if line.startswith("healpix-levels")]
    # one summary row per check: the failing one (1 step) and the passing one (2 steps)
    assert sorted(rows) == [["healpix-levels", "steps"], ["healpix-levels-local-mean", "steps"]]
