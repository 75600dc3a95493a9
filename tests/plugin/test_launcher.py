"""External-launcher mode: pytest started on every rank by torchrun runs tests in place."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.launcher import launcher_env

TESTS = """
import pytest
import torch, torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st
from harness.steppers.mlp import CoupledMLPCase

def total():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def gathered(n):
    t = torch.ones(n + 1)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)  # refuses (or hangs) if the ranks drew different sizes
    return sum(float(p.sum()) for p in parts)

@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 50))
def test_every_rank_draws_the_same_examples(spatial, n):
    assert spatial.run(gathered, n) == [4.0 * (n + 1)] * 4

def test_run_in_place(spatial):
    assert spatial.launcher
    assert spatial.run(total) == [4.0] * 4

def test_equivalence_in_place(spatial):
    spatial.check(CoupledMLPCase(npos=9))

def test_other_world_size_is_skipped(spatial):
    spatial.run(total, ranks=2)

{extra}

def test_after(spatial):
    assert spatial.run(total) == [4.0] * 4

@pytest.mark.spatial_pool
def test_pool_only():
    raise AssertionError("must be skipped under the launcher")
"""

FAILS_ON_RANK_1 = """
def test_fails_on_rank_1():
    assert dist.get_rank() != 1, "rank 1 is unhappy"
"""


BASE_EXCEPTION_ON_RANK_1 = """
from harness import RankError

def give_up_on_rank_1(how):
    if dist.get_rank() == 1:
        getattr(pytest, how)("rank 1 gives up")
    return dist.get_rank()

@pytest.mark.parametrize("how", ["fail", "skip", "exit"])
def test_a_base_exception_in_a_rank_function_is_agreed_on(spatial, how):
    with pytest.raises(RankError, match="rank 1/4 raised") as info:
        spatial.run(give_up_on_rank_1, how)
    assert "rank 1 gives up" in str(info.value)
"""


def _torchrun(path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=path,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.spatial_pool
def test_torchrun_runs_spatial_tests_in_place_and_only_rank_0_reports(pytester):
    pytester.makepyfile(test_tr=TESTS.format(extra=""))
    proc = _torchrun(pytester.path, "test_tr.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("harness: launched ranks 4 (torchrun/srun, in place)") == 1
    assert proc.stdout.count("4 passed, 2 skipped") == 1
    assert "coupled-mlp" in proc.stdout and "equivalent" in proc.stdout


@pytest.mark.spatial_pool
def test_a_test_failing_on_one_rank_fails_on_every_rank_without_a_hang(pytester):
    pytester.makepyfile(test_tr=TESTS.format(extra=FAILS_ON_RANK_1))
    proc = _torchrun(pytester.path, "test_tr.py")
    assert proc.returncode != 0
    out = proc.stdout
    assert "failed on rank 1 of 4 (this is rank 0)" in out
    assert "rank 1 is unhappy" in out
    assert "1 failed, 4 passed, 2 skipped" in out  # the test after it still ran everywhere


@pytest.mark.spatial_pool
def test_pytest_fail_or_skip_inside_a_rank_function_fails_every_rank_alike(pytester):
    pytester.makepyfile(test_tr=TESTS.format(extra=BASE_EXCEPTION_ON_RANK_1))
    proc = _torchrun(pytester.path, "test_tr.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "7 passed, 2 skipped" in proc.stdout  # and the test after them still ran


@pytest.mark.spatial_pool
def test_xdist_and_a_wrong_rank_count_are_refused_under_the_launcher(pytester):
    pytester.makepyfile(test_tr=TESTS.format(extra=""))
    proc = _torchrun(pytester.path, "--spatial-ranks=2", "test_tr.py")
    assert proc.returncode != 0
    assert "--spatial-ranks 2 but the launcher started 4 ranks" in proc.stderr


def test_launcher_environment_is_read_from_torchrun_or_slurm_variables():
    assert launcher_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == {
        "rank": 2,
        "world_size": 4,
        "local_rank": 0,
    }
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert launcher_env(slurm) is None  # no MASTER_ADDR: a plain srun job, not a launcher
    assert launcher_env({**slurm, "MASTER_ADDR": "n1"}) == {
        "rank": 3,
        "world_size": 8,
        "local_rank": 1,
    }
