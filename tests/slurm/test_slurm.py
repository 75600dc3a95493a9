"""The launcher mode under a real one-node Slurm: srun with nothing exported is one job.

The module starts its own cluster from Debian's ``slurm-wlm`` (``slurmctld`` and ``slurmd``
on this host, a minimal ``slurm.conf`` in a temporary directory, ``auth/none``), once per
pytest process that runs these tests (under xdist, once per worker that draws one: every
cluster has its own ports, directories and job ids), and stops it afterwards with every
process it started. Skipped, with the reason, where the binaries are not installed or the
cluster cannot be root's. CI installs them (``apt-get install slurm-wlm``) and runs this.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.pool._slurm import PORT_BASE, PORT_SPAN, slurm_hostnames, slurm_port

# Each test starts pytest on four tasks itself; under torchrun/srun it would run once per rank.
pytestmark = pytest.mark.spatial_pool

BINARIES = ("slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel", "scontrol")
# The daemons live in sbin, which a user's PATH may leave out.
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
STARTUP_S = 180  # a daemon or srun that is slow under load is waited for, never failed
#: srun's own guard against a hang, not a start deadline: four tasks that import torch took
#: 3.5 min to start on a 2-core machine at load 30 (each task's rendezvous has its deadline)
HANG_S = 1800

INNER = """
import json, os
import torch, torch.distributed as dist
from harness._rank.dtypes import collective_dtypes
from harness.steppers.mlp import CoupledMLPCase

def where():
    keys = ("MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")
    return {"pid": os.getpid(), "rank": dist.get_rank(), "world": dist.get_world_size(),
            **{key: os.environ.get(key) for key in keys}}

def total():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def test_one_group_of_four_processes(spatial):
    seen = spatial.run(where)
    out = os.path.join(os.environ["HARNESS_SLURM_OUT"], f"task{os.environ['SLURM_PROCID']}.json")
    with open(out, "w") as f:
        json.dump(seen, f)

def test_equivalence_in_place(spatial):
    spatial.check(CoupledMLPCase(npos=9))

def test_fails_on_rank_1():
    assert dist.get_rank() != 1, "rank 1 is unhappy"

def float32_sum():
    dist.all_reduce(torch.ones(2, dtype=torch.float32))
    return collective_dtypes(torch.float64)

def test_the_dtype_watch_sees_a_float32_all_reduce_on_every_task(spatial):
    seen = spatial.run(float32_sum)
    assert all(s["float32"].startswith("an all_reduce at test_inner.py:") for s in seen), seen

def test_after(spatial):
    assert spatial.run(total) == [4.0] * 4
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


class Cluster:
    """A one-node Slurm of this test module's own, and srun in it."""

    def __init__(self, root: Path, tag: str) -> None:
        self.root = root
        self.tag = tag
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        """This environment without any outer job's Slurm or rendezvous variables."""
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "PYTEST_XDIST_"))
            and key not in ("MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST")
        }
        env.update(PATH=SEARCH, SLURM_CONF=str(self.conf), HARNESS_SLURM_TAG=self.tag, **extra)
        return env

    def write_conf(self) -> None:
        user = "root"
        # Ids per xdist worker: two clusters' jobs never derive the same rendezvous port.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw-1")[2:]
        first_job = 100 * (int(worker) + 2) if worker.lstrip("-").isdigit() else 100
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName=harness{self.tag[:6]}",
                    f"SlurmctldHost={self.host}(127.0.0.1)",
                    f"SlurmUser={user}",
                    f"SlurmdUser={user}",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    f"FirstJobId={first_job}",
                    "AuthType=auth/none",
                    "CredType=cred/none",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "MailProg=/bin/true",
                    "SelectType=select/linear",
                    "ReturnToService=2",
                    "KillWait=2",
                    # 4 CPUs whatever the host has: four tasks fit on CI's two cores.
                    "SlurmdParameters=config_overrides",
                    f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN",
                    f"PartitionName=harness Nodes={self.host} Default=YES MaxTime=INFINITE "
                    "State=UP OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )

    def start(self) -> None:
        self.write_conf()
        env = self.env()
        for cmd, log in (
            (["slurmctld", "-D", "-f", str(self.conf)], "slurmctld.out"),
            (["slurmd", "-D", "-f", str(self.conf), "-N", self.host], "slurmd.out"),
        ):
            with open(self.root / log, "wb") as out:
                self.daemons.append(
                    subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + STARTUP_S
        state = ""
        while time.monotonic() < deadline:
            if any(daemon.poll() is not None for daemon in self.daemons):
                break
            state = self.slurm(["sinfo", "-h", "-o", "%t"]).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise AssertionError(
            f"the one-node Slurm never became idle (sinfo: {state!r}):\n{self.logs()}"
        )

    def slurm(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=60)

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.root / name).read_text(errors="replace")[-3000:]
            for name in ("slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log")
            if (self.root / name).exists()
        )

    def srun(
        self, ntasks: int, *pytest_args: str, cwd: Path, before: str = "", **env: str
    ) -> subprocess.CompletedProcess[str]:
        """``srun -n ntasks python -m pytest ...`` with MASTER_ADDR/MASTER_PORT as given."""
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
        if before:  # a shell line each task runs first (e.g. one task that never comes)
            command = ["bash", "-c", f'{before}; exec "$@"', "task", *command]
        return subprocess.run(
            ["srun", "--quiet", "-n", str(ntasks), *command],
            cwd=cwd,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )

    def stop(self) -> None:
        """Cancel every job, stop both daemons, and end whatever they left (by pid)."""
        if self.daemons and self.daemons[0].poll() is None:
            self.slurm(["scancel", "--partition", "harness"])
            deadline = time.monotonic() + 30
            while self.slurm(["squeue", "-h"]).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in _tagged_pids(self.tag):  # slurmstepd and tasks of a killed srun
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries this cluster's tag (inherited from its daemons)."""
    needle = f"HARNESS_SLURM_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def slurm() -> Iterator[Cluster]:
    missing = [name for name in BINARIES if shutil.which(name, path=SEARCH) is None]
    if missing:
        pytest.skip(f"slurm-wlm not installed ({', '.join(missing)}): apt-get install slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm runs as root (slurmd starts tasks as their user)")
    root = Path(tempfile.mkdtemp(prefix="harness-slurm-"))
    cluster = Cluster(root, uuid.uuid4().hex)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert not _tagged_pids(cluster.tag), "a Slurm process outlived the cluster"


@pytest.fixture
def inner(tmp_path: Path) -> Path:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "out").mkdir()
    return tmp_path


def _errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]


def test_srun_with_nothing_exported_is_one_four_rank_job_whose_ranks_agree(slurm, inner):
    proc = slurm.srun(
        4, "--spatial-ranks", "4", "test_inner.py", cwd=inner, HARNESS_SLURM_OUT=str(inner / "out")
    )
    out = proc.stdout
    assert proc.returncode != 0, out  # one test fails, on every task
    # One report (only rank 0 prints), not one suite per task on a pool of its own:
    assert out.count("harness: launched ranks 4 (torchrun/srun, in place)") == 1, out
    assert out.count("1 failed, 4 passed") == 1, out + proc.stderr  # the dtype watch too
    assert "failed on rank 1 of 4 (this is rank 0)" in out and "rank 1 is unhappy" in out
    # Every task ran the rank function in the same group of four processes: itself and the
    # other three tasks (on pools of their own, each would list its own four pool ranks).
    seen = [json.loads((inner / "out" / f"task{t}.json").read_text()) for t in range(4)]
    assert all(s == seen[0] for s in seen), seen
    assert [r["rank"] for r in seen[0]] == [0, 1, 2, 3] and len({r["pid"] for r in seen[0]}) == 4
    assert {r["world"] for r in seen[0]} == {4}
    # The derived rendezvous: the step's first host and 15000 + (10 job + step) mod 10000.
    job, step = int(seen[0][0]["SLURM_JOB_ID"]), int(seen[0][0]["SLURM_STEP_ID"])
    port = 15000 + (10 * job + step) % 10000
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in seen[0]} == {(slurm.host, str(port))}
    assert (
        f"rendezvous {slurm.host}:{port} (derived MASTER_ADDR from SLURM_STEP_NODELIST, "
        f"MASTER_PORT from SLURM_JOB_ID {job} and SLURM_STEP_ID {step})"
    ) in out


def test_a_taken_port_stops_every_task_with_one_clear_line_without_a_hang(slurm, inner):
    with socket.socket() as holder:  # another program listens there and never answers
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = slurm.srun(
            4, "--spatial-ranks", "4", "--spatial-timeout", "10", cwd=inner, MASTER_PORT=str(port)
        )
    # srun returned on its own (the holder never answers: a task without a deadline waits
    # until it is killed), every task with exit code 4 and one line:
    assert proc.returncode != 0
    errors = _errors(proc)
    assert len(errors) == 4, proc.stderr
    assert sum(f"rank 0/4 cannot listen on MASTER_PORT {port}" in e for e in errors) == 1
    for rank in (1, 2, 3):
        assert sum(f"rank {rank}/4 could not reach rank 0 at" in e for e in errors) == 1, errors
    assert all("Export a free MASTER_PORT" in e for e in errors)
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_task_that_never_arrives_is_named_by_every_other_task(slurm, inner):
    # The three tasks that do come must all reach the rendezvous within the timeout: on a
    # loaded machine their starts (importing torch) lie a minute or more apart.
    proc = slurm.srun(
        4,
        "--spatial-ranks",
        "4",
        "--spatial-timeout",
        "180",
        cwd=inner,
        before='if [ "$SLURM_PROCID" = 2 ]; then exit 0; fi',
    )
    errors = _errors(proc)
    assert proc.returncode != 0
    assert sorted(e.split(":")[1] for e in errors) == [" rank 0/4", " rank 1/4", " rank 3/4"], (
        proc.stderr
    )
    assert all("rank 2 never arrived at the rendezvous" in e for e in errors), errors
    assert "INTERNALERROR" not in proc.stdout + proc.stderr


def test_fewer_tasks_than_spatial_ranks_is_refused_on_every_task(slurm, inner):
    proc = slurm.srun(2, "--spatial-ranks", "4", "test_inner.py", cwd=inner)
    assert proc.returncode != 0
    assert (
        _errors(proc)
        == [
            "ERROR: --spatial-ranks 4 but the launcher started 2 ranks; use --spatial-ranks 2 or "
            "start 4 ranks"
        ]
        * 2
    ), proc.stderr


@pytest.mark.parametrize(
    "nodelist", ["vm", "node[01-04,07],other", "n[9-11]", "rack[1-2]-gpu[08-09],login"]
)
def test_host_lists_expand_as_scontrol_expands_them(slurm, nodelist):
    proc = slurm.slurm(["scontrol", "show", "hostnames", nodelist])
    assert proc.returncode == 0, proc.stderr
    assert slurm_hostnames(nodelist) == proc.stdout.split()


@pytest.mark.parametrize("job", [1, 999, 4242999, 10**9 - 1])
def test_every_derived_port_lies_in_its_span_and_steps_of_one_job_get_their_own(job):
    # No Slurm needed: the port rule alone. A step id added after the modulo would push
    # job 999's step 12 to 25002, past the span and into what other programs may hold.
    ports = [slurm_port(job, step) for step in range(40)]
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert len(set(ports[:10])) == 10  # steps 0-9 of one job never share a port
    assert slurm_port(job, 0) != slurm_port(job + 1, 0)  # the next job starts elsewhere
