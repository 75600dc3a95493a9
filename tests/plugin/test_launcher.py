"""External-launcher mode: pytest started on every rank by torchrun runs tests in place."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from harness.errors import ConfigError
from harness.pool.launcher import Rendezvous, launcher_env, launcher_rendezvous, meet

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

#: What the pool's watcher of torch.distributed gives a verdict, asked of launched ranks: the
#: dtype watch, "communicated nothing" (vacuity) and the phase a rank raised in.
WATCHED_IN_PLACE = """
from harness import RankError, check_equivalence
from harness._rank.dtypes import collective_dtypes
from harness.steppers.mlp import CoupledMLPCase
from harness.topology import Topology

def float32_sum():
    dist.all_reduce(torch.ones(2, dtype=torch.float32))
    return collective_dtypes(torch.float64)

def test_the_dtype_watch_sees_a_float32_all_reduce_in_place(spatial):
    seen = spatial.run(float32_sum)
    assert all(s["float32"].startswith("an all_reduce at test_tr.py:") for s in seen), seen
    assert spatial.run(collective_dtypes, torch.float64) == [{}] * 4  # a run starts afresh

class Alone(CoupledMLPCase):
    def batch(self, topo, step):
        return super().batch(Topology.single(), step)

    def build(self, topo):
        return super().build(Topology.single())

    def forward(self, model, batch, topo):
        return super().forward(model, batch, Topology.single())

def test_a_check_that_communicates_nothing_is_vacuous_in_place(spatial):
    report = check_equivalence(Alone(), ranks=4, pool=spatial.pool(4))
    assert report.quantities == {"vacuous"}, report

class BadBuild(CoupledMLPCase):
    def build(self, topo):
        if topo.spatial_group is not None:  # on the ranks only: the reference builds
            raise ValueError("no such layer")
        return super().build(topo)

def test_the_phase_a_rank_raised_in_is_in_the_report_in_place(spatial):
    report = check_equivalence(BadBuild(), ranks=4, pool=spatial.pool(4))
    got = sorted((m.rank, m.quantity, m.phase) for m in report.mismatches)
    assert got == [(r, "error", "build") for r in range(4)], report
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
        # A guard against a hang, not a start deadline: four pytest processes that import
        # torch took 3.5 min to start on a 2-core machine at load 30.
        timeout=1800,
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
def test_the_watch_of_torch_distributed_gives_launched_ranks_the_pools_verdicts(pytester):
    pytester.makepyfile(test_tr=TESTS.format(extra=WATCHED_IN_PLACE))
    proc = _torchrun(pytester.path, "test_tr.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "7 passed, 2 skipped" in proc.stdout


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


STEP = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "31",
    "SLURM_STEP_ID": "2",
    "SLURM_STEP_NODELIST": "node[07-08]",
}


def test_an_srun_step_of_several_tasks_is_a_launch_with_nothing_exported():
    assert launcher_env(STEP) == {"rank": 1, "world_size": 4, "local_rank": 1}
    # One task runs the harness's own pool, and so does a batch script (it has no step):
    assert launcher_env({**STEP, "SLURM_NTASKS": "1"}) is None
    assert launcher_env({k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}) is None


def test_the_rendezvous_is_derived_from_the_step_where_not_exported():
    assert launcher_rendezvous(STEP) == Rendezvous(
        "node07",
        15312,
        "derived MASTER_ADDR from SLURM_STEP_NODELIST, MASTER_PORT from SLURM_JOB_ID 31 and "
        "SLURM_STEP_ID 2",
    )
    exported = launcher_rendezvous({**STEP, "MASTER_ADDR": "login", "MASTER_PORT": "29500"})
    assert (exported.addr, exported.port) == ("login", 29500)
    only_port = launcher_rendezvous({**STEP, "MASTER_PORT": "29500"})
    assert (only_port.addr, only_port.port) == ("node07", 29500)
    only_addr = launcher_rendezvous({**STEP, "MASTER_ADDR": "login"})
    assert (only_addr.addr, only_addr.port) == ("login", 15312)
    assert only_addr.source == (
        "exported MASTER_ADDR; derived MASTER_PORT from SLURM_JOB_ID 31 and SLURM_STEP_ID 2"
    )
    job_list = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert launcher_rendezvous({**job_list, "SLURM_JOB_NODELIST": "a,b"}).addr == "a"


def test_task_0_off_the_first_host_is_told_to_export_master_addr():
    task0 = {**STEP, "SLURM_PROCID": "0", "SLURMD_NODENAME": "node08"}
    with pytest.raises(ConfigError, match=r"task 0 runs on node08, not on node07, the first ho"):
        launcher_rendezvous(task0)
    assert launcher_rendezvous({**task0, "MASTER_ADDR": "node08"}).addr == "node08"
    assert launcher_rendezvous({**task0, "SLURMD_NODENAME": "node07"}).addr == "node07"


def test_every_task_of_a_two_node_step_meets_at_task_0s_host_wherever_it_runs():
    # Slurm's block distribution of four tasks on node[07-08]: 0 and 1 on node07, 2 and 3 on
    # node08. Only task 0 off the first host is refused; the others look there for it.
    for task, node in enumerate(["node07", "node07", "node08", "node08"]):
        env = {**STEP, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % 2)}
        env["SLURMD_NODENAME"] = node
        assert launcher_env(env) == {"rank": task, "world_size": 4, "local_rank": task % 2}
        rendezvous = launcher_rendezvous(env)
        assert (rendezvous.addr, rendezvous.port) == ("node07", 15312), (task, node)


@pytest.mark.parametrize("port", ["abc", "0", "70000"])
def test_a_bad_master_port_is_one_clear_error(port):
    with pytest.raises(ConfigError, match=f"MASTER_PORT must be a port number .*got '{port}'"):
        launcher_rendezvous({**STEP, "MASTER_PORT": port})


def test_without_a_step_an_unset_master_addr_names_what_to_export():
    with pytest.raises(ConfigError, match=r"MASTER_ADDR is not set .* export MASTER_ADDR="):
        launcher_rendezvous({"MASTER_PORT": "29500"})


def _meet_all(ranks, world_size, port, timeout=1.0, timeouts=None):
    """meet() for ``ranks`` of a ``world_size``-rank group, each in a thread: error or store."""
    rdv = Rendezvous("127.0.0.1", port, "test")
    results: dict[int, object] = {}

    def one(rank):
        try:
            results[rank] = meet(rdv, rank, world_size, (timeouts or {}).get(rank, timeout))
        except ConfigError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)  # generous; meet's own deadline is ``timeout`` (+5 s linger)
    assert not any(t.is_alive() for t in threads), "meet() waited past its deadline"
    return results


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def test_ranks_that_all_arrive_share_one_store():
    results = _meet_all([0, 1], 2, _port(), timeout=30)
    assert not any(isinstance(r, ConfigError) for r in results.values()), results


def test_a_taken_port_is_refused_on_rank_0_at_once_with_a_free_one_offered():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        (error,) = _meet_all([0], 4, port, timeout=600).values()
    assert time.monotonic() - started < 60  # not the 600 s deadline: at once
    assert isinstance(error, ConfigError)
    assert f"rank 0/4 cannot listen on MASTER_PORT {port} at 127.0.0.1:{port} (test)" in str(error)
    assert re.search(
        r"Export a free MASTER_PORT, e\.g\. MASTER_PORT=\d+ \(free here now\)", str(error)
    )


def test_a_rank_that_reaches_a_port_nobody_answers_on_gives_up_at_its_deadline():
    # In a process of its own: torch's client thread, left behind connected, goes with it.
    code = (
        "import sys\n"
        "from harness.pool.launcher import Rendezvous, meet\n"
        "meet(Rendezvous('127.0.0.1', int(sys.argv[1]), 'test'), 1, 4, 1.0)\n"
    )
    with socket.socket() as holder:  # accepts connections (the backlog) and never answers
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # Without the deadline the rank waits as long as the holder listens: here, 120 s.
        proc = subprocess.run(
            [sys.executable, "-c", code, str(port)], capture_output=True, text=True, timeout=120
        )
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"harness.errors.ConfigError: rank 1/4 could not reach rank 0 at 127.0.0.1:{port} (test) "
        "within 1 s"
    ), proc.stderr


def test_a_rank_that_never_arrives_is_named_by_every_rank_that_did():
    results = _meet_all([0, 1, 3], 4, _port())
    assert sorted(results) == [0, 1, 3]
    for rank, error in results.items():
        assert isinstance(error, ConfigError), (rank, error)
        assert str(error).startswith(f"rank {rank}/4: rank 2 never arrived at the rendezvous")
    results = _meet_all([0], 3, _port())
    assert str(results[0]).startswith("rank 0/3: ranks 1, 2 never arrived")


def test_rank_0s_verdict_on_a_missing_rank_is_everyones_without_waiting_for_their_own():
    started = time.monotonic()
    results = _meet_all([0, 1], 3, _port(), timeouts={0: 1.0, 1: 120.0})
    # Rank 1 would wait its own 120 s (or read "lost rank 0" once rank 0 is gone); it reads
    # rank 0's verdict as soon as rank 0 gives up.
    assert time.monotonic() - started < 60
    assert str(results[1]).startswith("rank 1/3: rank 2 never arrived"), results[1]
    assert str(results[0]).startswith("rank 0/3: rank 2 never arrived"), results[0]


def test_a_launch_whose_group_cannot_form_is_one_usage_error_line(pytester, monkeypatch):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for key, value in {**env, "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(key, value)
        result = pytester.runpytest_subprocess("--spatial-ranks=2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        f"ERROR: rank 0/2 cannot listen on MASTER_PORT {port}"
    ), result.errlines
    assert "INTERNALERROR" not in result.stdout.str()
