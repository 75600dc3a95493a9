"""A sweep's layouts side by side on real pools (``harness.layouts._lanes``): the runs of
different world sizes overlap, every layout's verdict is the one it gets run alone, and
everything serial (the reference, a float32 check's nudged reruns) stays in the calling
thread, where torch's process-wide default dtype and seeds are set."""

from __future__ import annotations

import threading
import time

import pytest

import harness._rank.run as rank_run
import harness.equivalence._calibrate as calibration
from harness import check_layouts
from harness.layouts import _run as layouts_run
from tests.distributed.halo_tail import HaloTailCase
from tests.distributed.stencil import StencilCase

pytestmark = pytest.mark.spatial_pool  # layouts of 1 to 4 ranks: under a launcher only 4 run


@pytest.fixture
def run_spans(monkeypatch):
    """Each layout's run as (world size, began, ended), as the sweep starts them."""
    spans: list[tuple[int, float, float]] = []
    start = layouts_run.Sweep.start

    def timed(self, layout, at_once, done):
        began = time.monotonic()

        def ended(run, layout=layout):
            spans.append((layout.world_size, began, time.monotonic()))
            done(run)

        return start(self, layout, at_once, ended)

    monkeypatch.setattr(layouts_run.Sweep, "start", timed)
    return spans


def test_runs_of_different_world_sizes_overlap_and_give_each_layouts_own_verdict(
    spatial, run_spans
):
    case = StencilCase("transposed")  # fails on 2 x 2 only
    alone = check_layouts(case, max_ranks=4, pools=spatial.pool, side_by_side=False)
    assert len(run_spans) == len(alone.results) and not overlaps(run_spans)
    run_spans.clear()
    beside = check_layouts(case, max_ranks=4, pools=spatial.pool, locate=False)
    assert [(r.layout, r.status) for r in beside.results] == [
        (r.layout, r.status) for r in alone.results
    ]
    assert beside.smallest_failing == alone.smallest_failing
    assert alone.smallest_failing is not None and alone.smallest_failing.mesh == (2, 2)
    assert len(run_spans) == len(beside.results)
    assert overlaps(run_spans), run_spans
    # one world size's runs never overlap: its pool runs one at a time
    for size in {s for s, _, _ in run_spans}:
        assert not overlaps([x for x in run_spans if x[0] == size])


def overlaps(spans: list[tuple[int, float, float]]) -> list[tuple[int, int]]:
    """The pairs of world sizes whose runs overlapped in time."""
    return [
        (a[0], b[0])
        for i, a in enumerate(spans)
        for b in spans[i + 1 :]
        if a[1] < b[2] and b[1] < a[2]
    ]


def test_serial_runs_of_a_float32_sweep_stay_in_the_calling_thread(spatial, monkeypatch, run_spans):
    threads: list[str] = []
    run_case = rank_run.run_case

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return run_case(*args, **kwargs)

    monkeypatch.setattr(rank_run, "run_case", recorded)
    monkeypatch.setattr(calibration, "run_case", recorded)
    report = check_layouts(HaloTailCase(), max_ranks=4, pools=spatial.pool)
    assert report.ok, report
    assert all("judged by rounding" in str(r.report) for r in report.results)
    # the reference, then the nudged reruns (once: the sweep's layouts share the reference)
    assert len(threads) > 1
    assert set(threads) == {threading.main_thread().name}
    assert len(run_spans) == len(report.results)  # every layout's ranks ran ahead


def test_a_check_judges_the_run_it_is_handed_even_when_it_runs_its_own_reference(spatial):
    from harness.equivalence import bounded_reference, run_check, spec_of, start_ranks

    case, pool = StencilCase(), spatial.pool(2)
    spec = spec_of(case, ranks=2)
    reference = bounded_reference(case, spec.steps, spec.lr, spec.seed, None)
    before = pool.runs
    started = start_ranks(spec, case, pool, reference)
    assert started is not None
    report = run_check(spec, case, pool, None, started)  # the reference runs again here
    assert report.ok, report
    assert pool.runs == before + 1  # the run handed over, not a second one started beside it
