"""A sweep's layouts side by side: the layouts of each world size in turn on that size's
pool, the pools of several sizes at once, every verdict reached in the calling thread.

One layout at a time leaves part of the cores idle while gloo's ranks wait on each other
(measured on 2 cores: a HEALPix sweep one at a time keeps 71 % of them busy, SFNO 79 %),
and a sweep's layouts of 1, 2, 3 and 4 ranks are independent runs on separate pools. Run
them side by side and the idle share goes (88 % and 91 %): HEALPix 0.57x the time, SFNO
0.83x, where the CPU gloo spends per collective already fills the cores
(``benchmarks/layouts_cost.py`` measures it against one after another).

Only the ranks' runs overlap. Each is started in a thread of this process
(``harness.pool.overlap.Background``) and judged here, in the caller's thread, as it ends:
the judging and everything serial a check does (a float32 check's nudged reruns of the
reference, a rollout's serial run, the autocast serial run) set torch's process-wide default
dtype and seeds, so two of them must never run at once, and here they never do. A layout
whose run cannot start ahead (under autocast its serial run goes first; a runner whose
ranks run in this very process) runs here, whole, while the others' ranks run.

How many ranks run at once is capped (``rank_budget``): ``RANKS_PER_CORE`` per core this
process may use (per pytest-xdist worker, the cores shared among them), and never fewer
than the largest layout, so the largest world sizes start first: they are the longest lane.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

from harness._base.cpus import share

if TYPE_CHECKING:
    from harness.pool.overlap import Background
    from harness.report import EquivalenceReport

__all__ = ["RANKS_PER_CORE", "rank_budget", "side_by_side"]

#: ranks running at once per core: a 1-, 2-, 3- and 4-rank layout on 2 cores (10 ranks)
#: took 0.75-0.8x their time one after another (SFNO, HEALPix; ``benchmarks/layouts_cost.py``)
RANKS_PER_CORE = 5


class _Layout(Protocol):
    @property
    def world_size(self) -> int: ...


L = TypeVar("L", bound=_Layout)


def rank_budget(largest: int) -> int:
    """How many ranks a sweep runs at once: ``RANKS_PER_CORE`` per core of this process's
    share (the cores over pytest-xdist's workers), at least ``largest`` (one layout)."""
    return max(largest, RANKS_PER_CORE * share())


def side_by_side(
    todo: list[L],
    start: Callable[[L, int, Callable[[Background], None]], Background | None],
    judge: Callable[[L, Background | None], EquivalenceReport],
    budget: int,
) -> Iterator[tuple[L, EquivalenceReport]]:
    """Each layout of ``todo`` with its report, in the order the runs end: ``start(layout,
    ranks_at_once, done)`` starts its ranks' run (``done`` told as it ends; ``None`` where it
    cannot start ahead), ``judge(layout, started)`` gives its report (``None``: the whole
    check here). The layouts of
    one world size one after another (its pool runs one at a time), smallest first; those
    of other sizes beside them, largest first, while the ranks running stay within
    ``budget`` (one layout always runs). No run outlives the generator: closed early, or
    raising, it waits for the runs under way."""
    waiting: dict[int, deque[L]] = {}
    for layout in todo:
        waiting.setdefault(layout.world_size, deque()).append(layout)
    ended: queue.SimpleQueue[Background] = queue.SimpleQueue()
    running: dict[Background, L] = {}
    try:
        while waiting or running:
            # start what may start, then judge the first run that ends: its pool's next
            # layout is started before it is judged, so the judging overlaps that run
            while (now := _next(waiting, running, budget)) is not None:
                layout, at_once = now
                started = start(layout, at_once, ended.put)
                if started is None:  # the whole check here, beside the runs under way
                    yield layout, judge(layout, None)
                else:
                    running[started] = layout
            if running:
                done = ended.get()
                layout = running.pop(done)
                started_next = _next(waiting, running, budget, only=layout.world_size)
                if started_next is not None:
                    after, at_once = started_next
                    following = start(after, at_once, ended.put)
                    if following is not None:
                        running[following] = after
                    else:  # judged in turn, after this one
                        waiting.setdefault(after.world_size, deque()).appendleft(after)
                yield layout, judge(layout, done)
    finally:
        for started in running:
            started.join()


def _next(
    waiting: dict[int, deque[L]], running: dict[Background, L], budget: int, only: int = 0
) -> tuple[L, int] | None:
    """The next layout to start (taken off ``waiting``) and the ranks running with it: of
    the largest world size with none running, while within ``budget`` (or none running at
    all: with ``budget`` 0, one at a time, the smallest first); ``only``: of that world
    size only."""
    busy = sum(x.world_size for x in running.values())
    sizes = {x.world_size for x in running.values()}
    for size in sorted(waiting, reverse=budget > 0):
        if only and size != only:
            continue
        if size in sizes or (running and busy + size > budget):
            continue
        layout = waiting[size].popleft()
        if not waiting[size]:
            del waiting[size]
        return layout, busy + size
    return None
