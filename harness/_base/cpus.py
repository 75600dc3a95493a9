"""The CPU cores this process may use, and the torch threads a serial run here gets.

A check's serial runs (the reference, its nudged reruns, the serial rollouts) run in this
process while the ranks run in theirs, each rank with one torch thread. Torch's default is
a thread per core of the machine, which on a machine the ranks already fill only adds
threads that wait for each other: measured on the project's 2-core machine, one warm 4-rank
check with its reference on one thread instead of torch's two spent 0.5x the CPU in this
process (stencil 15.0 -> 7.9 ms, SFNO 85.5 -> 42.5 ms, HEALPix 35.2 -> 21.6 ms) and ended
0.82-0.99x as soon, 0.85-0.96x beside two CPU burners. So the reference, one run of the
whole model, gets the cores the ranks beside it leave (``serial_threads``), never fewer
than one; the nudged reruns and the serial rollouts, many small steps where intra-op
threads cost more than they give, run on one (their ``SERIAL_THREADS``). Each sets them
with ``torch_threads``, which puts torch's own setting back.

Imports nothing of torch at import time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["cores", "serial_threads", "share", "torch_threads"]


def cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this OS
        return os.cpu_count() or 1


def share() -> int:
    """This process's share of its cores: the cores over pytest-xdist's workers, at least 1
    (every worker of ``pytest -n N`` runs its own ranks on the same cores)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    return max(1, cores() // max(1, int(workers))) if workers.isdigit() else cores()


def serial_threads(beside: int) -> int:
    """Torch threads for a serial run in this process while ``beside`` ranks run (each on
    a core of its own, at best): the cores of this process's ``share`` they leave, at least 1.

    >>> serial_threads(beside=10**6)
    1
    """
    return max(1, share() - beside)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``n`` for the block, then put back."""
    import torch

    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
