"""What a Slurm step says about itself: its tasks, its nodes and where its ranks can meet.

Pure and torch-free. srun starts one task per rank and tells each its place in
``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``, but not where the ranks should meet
(torchrun's ``MASTER_ADDR`` / ``MASTER_PORT``). Every task can work that out alone, and all
come to the same answer: the first host of the step's node list (where Slurm's default block
distribution puts task 0) and a port computed from the job and step ids.

Only a task of a *step* counts (``SLURM_STEP_ID`` set): a batch script sees ``SLURM_PROCID=0``
and ``SLURM_NTASKS`` of its allocation too, but it is one process, not one of the step's
ranks, and runs the harness's own rank pool like any other process.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from harness.errors import ConfigError

#: Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): unprivileged, and below Linux's
#: ephemeral range (32768-60999), from which the kernel picks the ports of outgoing
#: connections, so no client socket of another program can hold one by chance.
PORT_BASE = 15000
PORT_SPAN = 10000


def slurm_hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm host list, in order, as ``scontrol show hostnames`` prints them.

    Bracketed ranges keep the zero padding of their lower bound; several bracket groups in
    one name expand as a product, the last one fastest.

    >>> slurm_hostnames("node[01-04,07],other")
    ['node01', 'node02', 'node03', 'node04', 'node07', 'other']
    >>> slurm_hostnames("vm")
    ['vm']
    >>> slurm_hostnames("n[9-11]")
    ['n9', 'n10', 'n11']
    >>> slurm_hostnames("rack[1-2]-gpu[08-09],login")
    ['rack1-gpu08', 'rack1-gpu09', 'rack2-gpu08', 'rack2-gpu09', 'login']
    >>> slurm_hostnames("node[01-04")
    Traceback (most recent call last):
    ...
    harness.errors.ConfigError: Slurm host list 'node[01-04' has an unclosed '['; expected e.g. 'node[01-04,07],other'
    """  # noqa: E501 - a doctest's output is one line
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        parts: list[list[str]] = []
        rest = item
        while "[" in rest:
            head, _, tail = rest.partition("[")
            body, closed, rest = tail.partition("]")
            if not closed:
                raise _bad_list(nodelist, "has an unclosed '['")
            parts.append([head])
            parts.append(_expand_ranges(body, nodelist))
        if "]" in rest:
            raise _bad_list(nodelist, "has a ']' without its '['")
        parts.append([rest])
        hosts.extend("".join(combo) for combo in itertools.product(*parts))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Split at the commas outside brackets: ``a[1,2],b`` is two items, not three."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    if any(not item.strip() for item in items):
        raise _bad_list(nodelist, "has an empty host name")
    return [item.strip() for item in items]


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise _bad_list(nodelist, f"has a range {part!r} that is not N or N-M")
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise _bad_list(nodelist, f"has a range {part!r} that runs backwards")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def _bad_list(nodelist: str, problem: str) -> ConfigError:
    return ConfigError(
        f"Slurm host list {nodelist!r} {problem}; expected e.g. 'node[01-04,07],other'"
    )


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a job step: ``PORT_BASE + (10 × job id + step id) mod PORT_SPAN``.

    Read the port as the job id's last three digits and then the step id's last digit, so
    that the steps of one job and jobs started one after the other on a shared node get
    ports of their own.

    >>> slurm_port(1, 0), slurm_port(1, 1), slurm_port(2, 0)
    (15010, 15011, 15020)
    >>> slurm_port(4242123, 7)
    16237
    """
    return PORT_BASE + (10 * job_id + step_id) % PORT_SPAN


@dataclass(frozen=True)
class SlurmStep:
    """The srun step this process is one task of."""

    rank: int
    ntasks: int
    local_rank: int
    job_id: int
    step_id: int
    nodelist: str
    nodelist_variable: str

    @property
    def first_host(self) -> str:
        """Where task 0 runs under Slurm's default (block) distribution."""
        return slurm_hostnames(self.nodelist)[0]

    @property
    def port(self) -> int:
        return slurm_port(self.job_id, self.step_id)


_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def slurm_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """The srun step this process is a task of, or ``None`` outside one.

    >>> env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
    ...        "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[3-4]"}
    >>> step = slurm_step(env)
    >>> step.rank, step.ntasks, step.first_host, step.port
    (1, 4, 'n3', 15070)
    >>> slurm_step({**env, "SLURM_STEP_ID": ""}) is None  # a batch script: no step
    True
    """
    needed = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID")
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not step_id or any(not environ.get(name) for name in needed):
        return None
    nodelist_variable = next((name for name in _NODELISTS if environ.get(name)), "")
    try:
        return SlurmStep(
            rank=int(environ["SLURM_PROCID"]),
            ntasks=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            job_id=int(environ["SLURM_JOB_ID"]),
            step_id=int(step_id),
            nodelist=environ.get(nodelist_variable, ""),
            nodelist_variable=nodelist_variable,
        )
    except ValueError:  # not Slurm's own numbers: nothing to derive from
        return None
