"""Which CPU each rank of a pool runs on, where the pool has more ranks than CPUs.

Four gloo ranks on two cores spend most of a collective handing messages between threads
(a rank's main thread, gloo's worker and its socket loop) and, left to the scheduler,
between cores as each thread wakes: measured on the project's 2-core machine, one
``all_reduce`` of 8 floats on 4 ranks took 4.3-5.1 ms unpinned and 2.2-2.5 ms with rank
``r`` pinned to CPU ``r % 2`` (8 ranks: 10.6 ms and 4.1 ms; two 4-rank pools side by side:
5.7-9.7 ms and 2.8-5.9 ms; beside 2 CPU burners: 5.4-6.0 ms and 4.2-4.5 ms). Ring
neighbours on different CPUs hand over on the same core as the thread they wake, and the
cores take turns. Where the ranks fit the CPUs the scheduler places them better than a pin
(2 ranks on 2 cores: 0.9 ms unpinned, 1.4 ms pinned), so only an oversubscribed pool is
pinned (``auto``); the rank pins itself as it starts (``harness._rank.loop``).
``benchmarks/pool_cpus.py`` measures it.

Placement only: a pinned rank runs the same code on the same data. Imports nothing of
torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from harness.errors import ConfigError

#: ``auto``: pin where the pool has more ranks than this process may use CPUs; ``on``:
#: always spread the ranks over the CPUs; ``off``: leave them to the scheduler
PIN_MODES = ("auto", "on", "off")


def check_pin(pin: str) -> str:
    """``pin`` if it is one of ``PIN_MODES``, else a ``ConfigError`` naming them."""
    if pin not in PIN_MODES:
        raise ConfigError(
            f"pin_ranks must be one of {', '.join(PIN_MODES)}, got {pin!r} (auto: pin each "
            "rank to a CPU where the pool has more ranks than CPUs; off: never)"
        )
    return pin


def rank_cpus(
    world_size: int, pin: str, allowed: Sequence[int] | None = None, offset: int | None = None
) -> list[int | None]:
    """The CPU each rank is pinned to (``None``: not pinned), rank ``r`` on the
    ``(offset + r)``-th allowed CPU, round the allowed CPUs (``allowed``: this process's, by
    default; where the OS does not say, nothing is pinned). ``offset`` (default:
    ``worker_offset``) keeps the pools of several pytest-xdist workers from all starting on
    the first CPU: 3-rank pools of two workers on 2 CPUs would put 4 ranks on CPU 0."""
    if offset is None:
        offset = worker_offset(world_size)
    if allowed is None:
        try:
            allowed = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux: the scheduler decides
            allowed = []
    cpus = sorted(allowed)
    oversubscribed = world_size > len(cpus)
    if pin == "off" or len(cpus) < 2 or (pin == "auto" and not oversubscribed):
        return [None] * world_size
    return [cpus[(offset + r) % len(cpus)] for r in range(world_size)]


def worker_offset(world_size: int) -> int:
    """Where this process's pools start on the CPUs: the pytest-xdist worker ``gwN`` at
    ``N * world_size`` (each worker's ranks take the next CPUs in turn), else 0."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = name[2:] if name.startswith("gw") else ""
    return int(index) * world_size if index.isdigit() else 0
