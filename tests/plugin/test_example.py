"""The example downstream repository (examples/downstream) end to end, as its CI runs it.

Its tests run in a subprocess, in a copy of the example, with its package on PYTHONPATH
(nothing is installed): first as committed, where they pass against the committed goldens;
then with each of its switchable bugs, where they must fail with the mismatch table.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "downstream"
UNEVEN = (
    "tests/test_equivalence.py::"
    "test_tinyclimate_split_in_latitude_bands_matches_serial[uneven-bands]"
)

pytestmark = pytest.mark.spatial_pool  # starts its own pytest and rank pools


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example") / "downstream"
    shutil.copytree(
        EXAMPLE, root, ignore=shutil.ignore_patterns("__pycache__", ".*_cache", "*.egg-info")
    )
    return root


def _run(root: Path, *args: str, bug: str | None = None) -> subprocess.CompletedProcess[str]:
    # as in a CI log: no terminal size (xdist workers export COLUMNS=80 to their children)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "TINYCLIMATE_")) and k not in ("COLUMNS", "LINES")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root / "src"), os.environ.get("PYTHONPATH")) if p
    )
    if bug:
        env["TINYCLIMATE_BUG"] = bug
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--spatial-ranks", "4", *args]
    return subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180, check=False
    )


def test_the_example_passes_against_its_committed_goldens(example):
    result = _run(example)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert re.search(r"\b4 passed\b", out), out
    assert "3 goldens: 3 passed." in out, out
    table = r"^tinyclimate\s+steps 2\s+4\s+10x16 grid in latitude bands\s.*equivalent$"
    assert re.search(table, out, re.M), out  # case, what ran, ranks, partition, ..., verdict


@pytest.mark.parametrize(
    ("bug", "first_row"),
    [
        # edge rows sent to the wrong neighbour: the output is wrong at the band edges
        pytest.param(
            "halo", r"^field\s+y\s+0\s+all\s.*\(lat \d+, lon \d+\) on rank \d$", id="halo"
        ),
        # the halo exchanged outside autograd: the forward pass is right, gradients are not
        pytest.param(
            "halo-backward", r"^grad\s+encoder\.weight\s+0\s+0-3\s.*\(rank 0\)$", id="halo-backward"
        ),
    ],
)
def test_the_example_fails_with_a_readable_table_when_its_bug_is_on(example, bug, first_row):
    result = _run(example, UNEVEN, bug=bug)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 failed" in out, out
    assert re.search(
        r"^quantity\s+name\s+step\s+rank\s+max abs\s+max rel\s+over tol\s+worst at$", out, re.M
    ), out
    assert re.search(first_row, out, re.M), out
    assert "What to do:" in out
    # the serial run has no halo: its golden still passes, only the equivalence check fails
    assert "1 golden: 1 passed." in out, out
    if bug == "halo-backward":
        assert not re.search(r"^(loss|field)\s+\S+\s+0\s", out, re.M), out


def test_the_examples_tests_kill_every_mutant_of_its_distributed_calls(example):
    result = _run(example, "--spatial-mutants", "--spatial-mutants-min-score", "90")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "spatial mutation score: 28/28 killed" in out, out
    for site in ("parallel.py:68", "parallel.py:72", "parallel.py:141", "parallel.py:148"):
        assert site in out  # the halo's send and receive, the global mean's two all-reduces
    assert "parallel.py:171" in out and "parallel.py:173" in out  # its own gradient hooks


def test_the_examples_survivors_name_what_its_tests_cannot_see(example):
    result = _run(example, "--spatial-mutants", "-k", "not data_parallel")
    out = result.stdout + result.stderr
    assert "spatial mutation score: 20/23 killed" in out, out
    survivors = [line for line in out.splitlines() if " SURVIVED" in line]
    assert len(survivors) == 3 and all(line.startswith("world all_reduce") for line in survivors)
    assert all("the group is the whole world on every layout the tests ran" in s for s in survivors)
