"""A sweep's layouts side by side (``harness.layouts._lanes``), with stand-in runs (threads
that sleep): the layouts of one world size never overlap, those of other sizes do within
the rank budget, every layout is judged once and in the calling thread, a world size's next
layout starts before the last is judged, and no run outlives the sweep."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import pytest

from harness.layouts import Layout, layouts
from harness.layouts._lanes import RANKS_PER_CORE, rank_budget, side_by_side

#: set once the first runs met at a ``Lanes.barrier``
MET = threading.Event()


class FakeRun:
    """A layout's run: a thread that sleeps ``seconds`` (after meeting the others at
    ``barrier``, if given and not yet passed), then tells ``done``."""

    def __init__(self, layout: Layout, seconds: float, done, log: list, barrier=None) -> None:
        self.layout = layout

        def run() -> None:
            log.append(("run", layout, time.monotonic()))
            if barrier is not None and not barrier.broken and not MET.is_set():
                try:
                    barrier.wait(timeout=10)
                    MET.set()  # later runs go straight on
                    log.append(("met", layout, time.monotonic()))
                except threading.BrokenBarrierError:
                    pass
            time.sleep(seconds)
            log.append(("ended", layout, time.monotonic()))
            done(self)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()


@dataclass
class Lanes:
    """``start`` and ``judge`` for ``side_by_side``, logging what happened when."""

    seconds: float = 0.02
    ahead: bool = True  # start() can start a run (else every layout is judged whole)
    fail_on: Layout | None = None
    barrier: threading.Barrier | None = None  # the first runs to start meet here

    def __post_init__(self) -> None:
        self.log: list = []
        self.runs: list[FakeRun] = []
        self.at_once: dict[Layout, int] = {}

    def start(self, layout, at_once, done):
        self.at_once[layout] = at_once
        self.log.append(("start", layout, time.monotonic()))
        if not self.ahead:
            return None
        run = FakeRun(layout, self.seconds, done, self.log, self.barrier)
        self.runs.append(run)
        return run

    def judge(self, layout, started):
        assert threading.current_thread() is threading.main_thread()
        assert started is None or started.layout == layout
        if layout == self.fail_on:
            raise RuntimeError("judging failed")
        self.log.append(("judge", layout, time.monotonic()))
        return f"report of {layout}"

    def spans(self) -> dict[Layout, tuple[float, float]]:
        begin = {x: t for what, x, t in self.log if what == "run"}
        return {x: (begin[x], t) for what, x, t in self.log if what == "ended"}


SWEEP = [x for x in layouts(4, 2) if x.data_size == 1 or x.world_size == 2]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_every_layout_is_judged_once_with_its_own_report():
    lanes = Lanes()
    got = list(side_by_side(SWEEP, lanes.start, lanes.judge, budget=10))
    assert sorted(x.order for x, _ in got) == sorted(x.order for x in SWEEP)
    assert all(report == f"report of {x}" for x, report in got)


def test_one_world_size_runs_one_layout_at_a_time_and_other_sizes_beside_it():
    # the first layout of every size runs at once (10 ranks: 4 + 3 + 2 + 1): the four
    # first runs meet at a barrier, which one at a time they never would (it times out)
    MET.clear()
    lanes = Lanes(seconds=0.01, barrier=threading.Barrier(4))
    list(side_by_side(SWEEP, lanes.start, lanes.judge, budget=10))
    met = [x for what, x, _ in lanes.log if what == "met"]
    firsts = {next(x for x in SWEEP if x.world_size == w) for w in (1, 2, 3, 4)}
    assert set(met) == firsts
    spans = lanes.spans()
    for a, b in ((a, b) for a in spans for b in spans if a != b):
        if a.world_size == b.world_size:
            assert not overlap(spans[a], spans[b]), (a, b)


def test_a_world_sizes_next_layout_starts_before_the_last_one_is_judged():
    lanes = Lanes()
    list(side_by_side(SWEEP, lanes.start, lanes.judge, budget=10))
    order = [(what, x) for what, x, _ in sorted(lanes.log, key=lambda e: e[2])]
    fours = [x for x in SWEEP if x.world_size == 4]
    for first, second in itertools.pairwise(fours):
        assert order.index(("start", second)) < order.index(("judge", first))


@pytest.mark.parametrize("budget", [4, 5, 7])
def test_the_ranks_running_stay_within_the_budget(budget):
    lanes = Lanes(seconds=0.01)
    list(side_by_side(SWEEP, lanes.start, lanes.judge, budget=budget))
    spans = lanes.spans()
    for x, (begin, _) in spans.items():  # the ranks running as each run began
        running = sum(y.world_size for y, (b, e) in spans.items() if b <= begin < e)
        assert running <= budget, (x, running)
    assert max(lanes.at_once.values()) <= budget


def test_budget_zero_runs_one_layout_at_a_time_smallest_first():
    lanes = Lanes(seconds=0.005)
    got = [x for x, _ in side_by_side(SWEEP, lanes.start, lanes.judge, budget=0)]
    # within a world size the order is the sweep's; sizes smallest first
    assert [x.world_size for x in got] == sorted(x.world_size for x in SWEEP)
    spans = list(lanes.spans().values())
    assert not any(overlap(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :])


def test_a_layout_that_cannot_start_ahead_is_judged_whole_here():
    lanes = Lanes(ahead=False)
    got = list(side_by_side(SWEEP[:4], lanes.start, lanes.judge, budget=10))
    assert [x for x, _ in got] == sorted(SWEEP[:4], key=lambda x: -x.world_size)
    assert not lanes.runs


def test_no_run_outlives_a_sweep_whose_judging_raises():
    fours = [x for x in SWEEP if x.world_size == 4]
    lanes = Lanes(seconds=0.05, fail_on=fours[0])
    with pytest.raises(RuntimeError, match="judging failed"):
        list(side_by_side(SWEEP, lanes.start, lanes.judge, budget=10))
    assert lanes.runs and not any(r.thread.is_alive() for r in lanes.runs)


def test_no_run_outlives_a_sweep_stopped_early():
    lanes = Lanes(seconds=0.05)
    sweep = side_by_side(SWEEP, lanes.start, lanes.judge, budget=10)
    next(sweep)
    sweep.close()
    assert len(lanes.runs) > 1 and not any(r.thread.is_alive() for r in lanes.runs)


def test_the_rank_budget_is_per_core_of_this_workers_share(monkeypatch):
    import harness._base.cpus as cpus

    monkeypatch.setattr(cpus, "cores", lambda: 4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert rank_budget(4) == 4 * RANKS_PER_CORE
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert rank_budget(4) == 2 * RANKS_PER_CORE
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")  # more workers than cores
    assert rank_budget(4) == max(4, RANKS_PER_CORE)
    assert rank_budget(40) == 40  # one layout always runs
