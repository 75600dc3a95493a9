"""External-launcher mode: pytest itself was started on every rank by torchrun or srun.

Then there is no pool to spawn: the process group exists (or is created from the
launcher's environment), and ``run(fn)`` calls ``fn`` in place on every rank. Results and
failures are exchanged with ``all_gather_object`` so that every rank returns, or raises,
the same thing: no rank is left waiting in a collective because another one failed an
assert. This is how the same tests run across nodes and on NCCL.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
Under srun, ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID`` stand in for the first
three; export ``MASTER_ADDR`` and ``MASTER_PORT`` yourself.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from harness.errors import ConfigError, RankProblem, exception_summary, failure_from

_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def launcher_env(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """Rank, world size and local rank set by torchrun or srun, or ``None`` if not launched.

    >>> launcher_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    {'rank': 1, 'world_size': 4, 'local_rank': 1}
    >>> launcher_env({}) is None
    True
    """
    env = os.environ if environ is None else environ
    values = {}
    for key, slurm in _SLURM.items():
        raw = env.get(key, env.get(slurm) if "MASTER_ADDR" in env else None)
        if raw is None:
            return None
        values[key.lower()] = int(raw)
    return values


class LauncherRunner:
    """Runs a function in place on every rank of the launcher's process group.

    A ``harness.pool.Runner``, like ``RankPool``: ``world_size``, ``run(fn, *args,
    timeout=None, **kwargs)`` and ``last_outputs``.
    """

    def __init__(self, *, timeout: float = 120.0) -> None:
        import torch
        import torch.distributed as dist

        env = launcher_env()
        if env is None:
            raise ConfigError(
                "LauncherRunner needs RANK, WORLD_SIZE and LOCAL_RANK (torchrun sets them)"
            )
        self.created = False
        if not dist.is_initialized():
            use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
            if use_cuda:  # one GPU per rank, NCCL between them
                torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
            dist.init_process_group(
                "nccl" if use_cuda else "gloo",
                rank=env["rank"],
                world_size=env["world_size"],
                timeout=datetime.timedelta(seconds=max(timeout, 30)),
            )
            self.created = True
        self.backend = str(dist.get_backend())
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # Object collectives need a CPU group; under NCCL make one with gloo.
        self._objects = dist.new_group(backend="gloo") if self.backend != "gloo" else None
        self.last_outputs: list[str] = [""] * self.world_size
        self.timeout = timeout

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._objects)
        return out

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn`` here, on every rank; every rank gets all results or the same failure.

        A ``BaseException`` from ``fn`` (``pytest.fail``, ``pytest.skip``, ``SystemExit``) is
        a failure like any other: agreed on by every rank, so no rank goes on out of step.
        Only ``KeyboardInterrupt`` leaves at once (the launcher interrupts every rank).
        """
        try:
            status: tuple[bool, Any] = (True, fn(*args, **kwargs))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - shared with the other ranks
            status = (False, (exception_summary(exc), traceback.format_exc()))
        statuses = self.gather(status)
        problems = [
            RankProblem(r, "error", s[1][0], s[1][1]) for r, s in enumerate(statuses) if not s[0]
        ]
        if problems:
            raise failure_from(problems, self.world_size, timeout or self.timeout)
        return [s[1] for s in statuses]

    def close(self) -> None:
        import torch.distributed as dist

        if self.created and dist.is_initialized():
            dist.destroy_process_group()


class WorldSizeMismatch(ConfigError):
    """A test asked for a number of ranks other than the launcher started."""


class LauncherRegistry:
    """Stands in for ``PoolRegistry`` under a launcher: one runner, one world size."""

    start_method = "launcher"

    def __init__(self, runner: LauncherRunner) -> None:
        self.runner = runner
        self.default_ranks = runner.world_size
        self.timeout = runner.timeout

    def get(self, world_size: int) -> LauncherRunner:
        if world_size != self.runner.world_size:
            raise WorldSizeMismatch(
                f"needs {world_size} ranks; the launcher started {self.runner.world_size}"
            )
        return self.runner

    def close(self) -> None:
        self.runner.close()
