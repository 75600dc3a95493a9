"""External-launcher mode: pytest itself was started on every rank by torchrun or srun.

Then there is no pool to spawn: the process group exists (or is created from the
launcher's environment), and ``run(fn)`` calls ``fn`` in place on every rank. Results and
failures are exchanged with ``all_gather_object`` so that every rank returns, or raises,
the same thing: no rank is left waiting in a collective because another one failed an
assert. This is how the same tests run across nodes and on NCCL.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
Under srun, ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID`` stand in for the first
three, and where ``MASTER_ADDR`` / ``MASTER_PORT`` are not exported every task derives the
same ones from the step (``harness.pool._slurm``). The ranks meet within the timeout or every
task stops with one error saying why (a taken port, a rank that never came): a task that
cannot join never runs the suite on a pool of its own, and never waits for good.

Each run is watched as on a pool's rank (``harness._rank.intercept``: installed once, noting only
during ``run``), so the verdicts resting on it (the dtype watch, vacuity, the group checks'
own count) are the pool's; the deadlock proofs, which need the pool's notice board, are not.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from harness.errors import ConfigError, RankProblem, exception_summary, failure_from
from harness.pool._slurm import SlurmStep, slurm_step

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store, TCPStore

T = TypeVar("T")

_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def launcher_env(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """Rank, world size and local rank set by torchrun or srun, or ``None`` if not launched.

    >>> launcher_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    {'rank': 1, 'world_size': 4, 'local_rank': 1}
    >>> launcher_env({}) is None
    True

    Under srun, a step of several tasks is a launch whether or not ``MASTER_ADDR`` is
    exported (the rendezvous is derived); a single task, or a batch script (no step), is
    not: it runs the harness's own rank pool.
    """
    env = os.environ if environ is None else environ
    step = slurm_step(env)
    from_slurm = "MASTER_ADDR" in env or (step is not None and step.ntasks > 1)
    values = {}
    for key, slurm in _SLURM.items():
        raw = env.get(key, env.get(slurm) if from_slurm else None)
        if raw is None:
            return None
        values[key.lower()] = int(raw)
    return values


@dataclass(frozen=True)
class Rendezvous:
    """Where the launcher's ranks meet (rank 0 listens there), and who said so."""

    addr: str
    port: int
    source: str

    def __str__(self) -> str:
        return f"{self.addr}:{self.port} ({self.source})"


def launcher_rendezvous(environ: Mapping[str, str] | None = None) -> Rendezvous:
    """``MASTER_ADDR`` / ``MASTER_PORT`` as exported, or derived from the srun step.

    >>> str(launcher_rendezvous({"MASTER_ADDR": "n1", "MASTER_PORT": "29500"}))
    'n1:29500 (exported MASTER_ADDR, MASTER_PORT)'
    >>> step = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7",
    ...         "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    >>> print(launcher_rendezvous(step))
    gpu07:15071 (derived MASTER_ADDR from SLURM_STEP_NODELIST, MASTER_PORT from SLURM_JOB_ID 7 and SLURM_STEP_ID 1)
    >>> launcher_rendezvous({"MASTER_ADDR": "n1"})
    Traceback (most recent call last):
    ...
    harness.errors.ConfigError: MASTER_PORT is not set and this is no srun step to derive it from (SLURM_JOB_ID, SLURM_STEP_ID); torchrun sets it: export MASTER_PORT=<a free port on rank 0's host>, e.g. 29500
    """  # noqa: E501 - a doctest's output is one line
    env = os.environ if environ is None else environ
    step = slurm_step(env)
    exported: list[str] = []
    derived: list[str] = []
    addr = _rendezvous_addr(env, step, exported, derived)
    port = _rendezvous_port(env, step, exported, derived)
    said = []
    if exported:
        said.append(f"exported {', '.join(exported)}")
    if derived:
        said.append(f"derived {', '.join(derived)}")
    return Rendezvous(addr, port, "; ".join(said))


def _rendezvous_addr(
    env: Mapping[str, str], step: SlurmStep | None, exported: list[str], derived: list[str]
) -> str:
    """Rank 0's host, exported or derived (noted in ``exported`` / ``derived``)."""
    addr = env.get("MASTER_ADDR", "")
    if addr:
        exported.append("MASTER_ADDR")
    elif step is not None and step.nodelist:
        addr = step.first_host
        derived.append(f"MASTER_ADDR from {step.nodelist_variable}")
        node = env.get("SLURMD_NODENAME", addr)
        if step.rank == 0 and node != addr:  # not a block distribution: the others look there
            raise ConfigError(
                f"task 0 runs on {node}, not on {addr}, the first host of "
                f"{step.nodelist_variable} ({step.nodelist}) where the other tasks will look "
                f"for it; export MASTER_ADDR={node} (or launch with the default block "
                "distribution)"
            )
    else:
        raise ConfigError(
            "MASTER_ADDR is not set and this is no srun step with a node list to derive it "
            "from (SLURM_STEP_NODELIST or SLURM_JOB_NODELIST); torchrun sets it: export "
            "MASTER_ADDR=<the host of rank 0>"
        )
    return addr


def _rendezvous_port(
    env: Mapping[str, str], step: SlurmStep | None, exported: list[str], derived: list[str]
) -> int:
    """Rank 0's port, exported or derived (noted in ``exported`` / ``derived``)."""
    raw_port = env.get("MASTER_PORT", "")
    if raw_port:
        exported.append("MASTER_PORT")
        if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
            raise ConfigError(
                f"MASTER_PORT must be a port number (1-65535), got {raw_port!r}; export a "
                "free port on rank 0's host, e.g. MASTER_PORT=29500, or unset it under srun "
                "to derive one from the job"
            )
        port = int(raw_port)
    elif step is not None:
        port = step.port
        derived.append(
            f"MASTER_PORT from SLURM_JOB_ID {step.job_id} and SLURM_STEP_ID {step.step_id}"
        )
    else:
        raise ConfigError(
            "MASTER_PORT is not set and this is no srun step to derive it from (SLURM_JOB_ID, "
            "SLURM_STEP_ID); torchrun sets it: export MASTER_PORT=<a free port on rank 0's "
            "host>, e.g. 29500"
        )
    return port


_ARRIVED = "harness/_launcher/arrived/{}"
_GAVE_UP = "harness/_launcher/gave-up"  # rank 0's list of the ranks that never came
_TOLD = "harness/_launcher/told/{}"  # a rank read it: rank 0 (the store) may go


def meet(rendezvous: Rendezvous, rank: int, world_size: int, timeout: float) -> TCPStore:
    """Every rank at ``rendezvous`` within ``timeout`` seconds: the ``TCPStore`` they share.

    Or a ``ConfigError`` on each rank, by its deadline, that says what went wrong where it
    can see it: rank 0 that the port is taken (at once: the store cannot listen; it offers a
    free one), the others that rank 0 cannot be reached, everyone which ranks never arrived.
    torch's own client can wait past its timeout when another program holds the port (it
    connects, then waits for an answer that never comes), so the connection is made under a
    deadline of ours.
    """
    from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

    deadline = time.monotonic() + timeout
    # torch's timeout a little past ours: the message that comes first is this module's.
    slack = datetime.timedelta(seconds=timeout + 30)
    try:
        store = _before(
            deadline,
            lambda: TCPStore(
                rendezvous.addr,
                rendezvous.port,
                world_size,
                is_master=rank == 0,
                timeout=slack,
                wait_for_workers=False,
            ),
        )
    except TimeoutError:
        raise ConfigError(
            f"rank {rank}/{world_size} could not reach rank 0 at {rendezvous} within "
            f"{timeout:g} s: rank 0 failed (its error says why: a taken port?), never started, "
            "or another program holds the port. Export a free MASTER_PORT (and MASTER_ADDR, "
            "the host of rank 0), or raise --spatial-timeout if tasks start slowly"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch's store errors, said in one line
        if rank == 0 and "EADDRINUSE" in str(exc):
            raise _port_taken(rendezvous, world_size, timeout) from None
        raise ConfigError(
            f"rank {rank}/{world_size} could not join the rendezvous at {rendezvous}: "
            f"{exception_summary(exc)}. Export MASTER_ADDR (the host of rank 0) and a free "
            "MASTER_PORT"
        ) from None
    try:
        _all_arrive(store, rendezvous, rank, world_size, timeout, deadline)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - rank 0 (the store) went away
        raise ConfigError(
            f"rank {rank}/{world_size} lost rank 0 during the rendezvous at {rendezvous}: "
            f"{exception_summary(exc)}; see rank 0's error"
        ) from None
    return store


def _all_arrive(
    store: Store,
    rendezvous: Rendezvous,
    rank: int,
    world_size: int,
    timeout: float,
    deadline: float,
) -> None:
    """Every rank's arrival key in the store by ``deadline``, or one error naming the absent.

    Rank 0's verdict is everyone's: at its deadline it posts which ranks are missing and
    keeps the store up until the others have read it (or a few seconds), so that no rank
    reads "lost rank 0" where the cause is a rank that never came.
    """
    keys = [_ARRIVED.format(r) for r in range(world_size)]
    store.set(keys[rank], "1")
    missing: list[int] | None = None
    # Polled, not store.wait: a wait that times out logs a warning on every rank.
    while not store.check(keys):
        if rank != 0 and store.check([_GAVE_UP]):
            missing = json.loads(store.get(_GAVE_UP))
            store.set(_TOLD.format(rank), "1")
            break
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if rank == 0:
                store.set(_GAVE_UP, json.dumps(missing))
                present = [_TOLD.format(r) for r in range(1, world_size) if r not in missing]
                linger = time.monotonic() + 5
                while not store.check(present) and time.monotonic() < linger:
                    time.sleep(0.05)
            break
        time.sleep(0.05)
    if missing is not None:
        ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        raise ConfigError(
            f"rank {rank}/{world_size}: {ranks} never arrived at the rendezvous at "
            f"{rendezvous} within {timeout:g} s. Every task of the step must run this same "
            "pytest command: see that task's output (did it crash, or run something else?)"
        )


def _before(deadline: float, make: Callable[[], T]) -> T:
    """``make()``, or ``TimeoutError`` at ``deadline`` (the thread is left behind, daemon)."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(make())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="harness-rendezvous", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if error:
        raise error[0]
    if not result:
        raise TimeoutError
    return result[0]


def _port_taken(rendezvous: Rendezvous, world_size: int, timeout: float) -> ConfigError:
    free = next((p for p in range(rendezvous.port + 1, rendezvous.port + 100) if _free(p)), None)
    offer = f", e.g. MASTER_PORT={free} (free here now)" if free else ""
    return ConfigError(
        f"rank 0/{world_size} cannot listen on MASTER_PORT {rendezvous.port} at {rendezvous}: "
        f"another program on {socket.gethostname()} holds it, and the other ranks give up "
        f"waiting for rank 0 after {timeout:g} s (--spatial-timeout). Export a free "
        f"MASTER_PORT{offer}"
    )


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


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
        self.rendezvous: Rendezvous | None = None  # None: the group was there already
        if not dist.is_initialized():
            self.rendezvous = launcher_rendezvous()
            # Derived ones exported, so that code reading them finds where the group met.
            os.environ.setdefault("MASTER_ADDR", self.rendezvous.addr)
            os.environ.setdefault("MASTER_PORT", str(self.rendezvous.port))
            store = None  # torchrun's agent holds the store: env:// joins it
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                store = meet(self.rendezvous, env["rank"], env["world_size"], timeout)
            use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
            if use_cuda:  # one GPU per rank, NCCL between them
                torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
            try:
                dist.init_process_group(
                    "nccl" if use_cuda else "gloo",
                    store=store,
                    rank=env["rank"],
                    world_size=env["world_size"],
                    timeout=datetime.timedelta(seconds=max(timeout, 30)),
                )
            except Exception as exc:  # noqa: BLE001 - torch's rendezvous errors, in one line
                raise ConfigError(
                    f"rank {env['rank']}/{env['world_size']} could not form the launcher's "
                    f"process group at {self.rendezvous}: {exception_summary(exc)}. Export "
                    "MASTER_ADDR (the host of rank 0) and a free MASTER_PORT; every task must "
                    "run the same command"
                ) from None
            self._store = store  # rank 0's store serves the group as long as it lives
            self.created = True
        self.backend = str(dist.get_backend())
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # Object collectives need a CPU group; under NCCL make one with gloo.
        self._objects = dist.new_group(backend="gloo") if self.backend != "gloo" else None
        self.last_outputs: list[str] = [""] * self.world_size
        self.timeout = timeout
        # The pool's watcher of torch.distributed, here too: what the dtype watch, vacuity
        # ("communicated nothing") and the group checks' own count rest on. It wraps
        # ProcessGroup's methods once per process and notes only during a run (see ``run``);
        # outside one, and for this runner's own gathers, it calls straight through.
        from harness._rank import intercept as _intercept

        self._tracker = _intercept.install()

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        import torch.distributed as dist

        out = [obj] * self.world_size  # placeholders: the gather fills every slot
        dist.all_gather_object(out, obj, group=self._objects)
        return out

    def run(
        self, fn: Callable[..., T], *args: object, timeout: float | None = None, **kwargs: object
    ) -> list[T]:
        """Call ``fn`` here, on every rank; every rank gets all results or the same failure.

        A ``BaseException`` from ``fn`` (``pytest.fail``, ``pytest.skip``, ``SystemExit``) is
        a failure like any other: agreed on by every rank, so no rank goes on out of step.
        Only ``KeyboardInterrupt`` leaves at once (the launcher interrupts every rank).
        """
        tracker = self._tracker
        tracker.begin()  # as a pool's rank does: a run's operations, from zero
        try:
            # fn's result, or the failure's (summary, traceback, phase)
            status: tuple[Literal[True], T] | tuple[Literal[False], tuple[str, str, str]] = (
                True,
                fn(*args, **kwargs),
            )
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - shared with the other ranks
            # where in the run it was raised ("build", "step 0 forward"), as the pool says it
            phase = getattr(exc, "harness_phase", None) or ""
            status = (False, (exception_summary(exc), traceback.format_exc(), str(phase)))
        finally:
            tracker.end()  # before the gather below: the harness's own talk is not the run's
        statuses = self.gather(status)
        problems = [
            RankProblem(r, "error", s[1][0], s[1][1], phase=s[1][2])
            for r, s in enumerate(statuses)
            if s[0] is False
        ]
        if problems:
            raise failure_from(problems, self.world_size, timeout or self.timeout)
        return [s[1] for s in statuses if s[0] is True]  # every one: no rank failed

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
                f"needs {world_size} rank{'s' if world_size != 1 else ''}; the launcher started "
                f"{self.runner.world_size}"
            )
        return self.runner

    def close(self) -> None:
        self.runner.close()
