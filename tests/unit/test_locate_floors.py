"""Locating's own rules, without ranks: the nudge that sets each quantity's noise floor, and
the forward-only retry of a model that breaks under the backward hooks.

The nudge is the real one (``Recorder._nudged``), the judge the real ``first_divergence``;
only the reruns are stood in for, by hand-made traces.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.divergence import DEPART, MIN_ULPS
from harness.divergence._trace import Event, Trace
from harness.equivalence import _locating as _locate
from harness.errors import RankFailure, RankProblem
from harness.topology import Topology

F64 = torch.float64
EPS = torch.finfo(F64).eps


def _output(tensor: torch.Tensor) -> Trace:
    return Trace(0, [Event("dec", "Linear", 0, "output", "0", tensor)])


def _nudged(tensor: torch.Tensor) -> torch.Tensor:
    recorder = _locate.Recorder(None, Topology.single(), 0, nudge=True)  # type: ignore[arg-type]
    return recorder._nudged(tensor)


def test_the_nudge_moves_each_value_by_a_few_units_of_rounding_both_ways():
    e = torch.linspace(1, 2, 1000, dtype=F64)
    moved = (_nudged(e) / e - 1) / EPS
    assert 2 <= float(moved.abs().min()) and float(moved.abs().max()) <= 8
    assert bool((moved > 0).any()) and bool((moved < 0).any())  # signs drawn, not a scale


@pytest.mark.parametrize(
    ("ulps", "located"),
    [
        (0.2 * MIN_ULPS * DEPART, False),  # a fifth of the smallest floor's departure
        (2.5 * MIN_ULPS * DEPART, True),  # 4.4e-12 relative: a small real bug
    ],
)
def test_a_small_real_bug_departs_from_the_floor_the_nudge_sets(ulps, located):
    # The floor is the larger of what the nudge moved and MIN_ULPS roundings: a nudge of a
    # few ulps leaves MIN_ULPS as the floor, so a bug DEPART x that floor away is located;
    # a nudge ten times larger would hide it under its own noise.
    e = torch.linspace(1, 2, 64, dtype=F64)
    bug = e.clone()
    bug[17] *= 1 + ulps * EPS
    found = _locate.first_divergence(_output(e), _output(_nudged(e)), [_output(bug)])
    assert (found.first is not None) is located
    if located:
        assert found.first is not None and found.first.module == "dec"


class Pool:
    """A pool whose ranks hand back ``trace``, or fail under the backward hooks."""

    def __init__(self, trace: Trace, *, breaks: bool) -> None:
        self.trace, self.breaks = trace, breaks
        self.calls: list[bool] = []

    def run(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Trace]:
        backward = args[5]
        self.calls.append(backward)
        if backward and self.breaks:
            problem = RankProblem(0, "error", "RuntimeError: a view modified inplace")
            raise RankFailure("rank 0 failed", 2, [problem])
        return [self.trace, self.trace]


@pytest.mark.parametrize("where", ["reference", "ranks"])
def test_a_model_that_breaks_under_the_backward_hooks_is_located_forward_only(monkeypatch, where):
    e = torch.linspace(1, 2, 8, dtype=F64)
    reruns: list[tuple[bool, bool]] = []

    def traced(case, topo, step, lr, seed, nudge, backward, reference_init=None):
        reruns.append((nudge, backward))
        if backward and where == "reference":
            raise RuntimeError("a view modified inplace")
        trace = _output(_nudged(e) if nudge else e)
        trace.forward_only = not backward
        return trace

    monkeypatch.setattr(_locate, "_traced", traced)
    wrong = _output(e * 2)
    wrong.forward_only = True
    pool = Pool(wrong, breaks=where == "ranks")
    found = _locate.locate(None, pool, spatial_size=2, step=0, lr=0.1, seed=0)  # type: ignore[arg-type]
    assert found.problem == ""
    assert found.first is not None and found.first.module == "dec"
    assert found.forward_only
    assert reruns[-2:] == [(False, False), (True, False)]
    assert pool.calls == ([True, False] if where == "ranks" else [False])


def test_a_model_that_breaks_under_every_hook_is_not_located_and_says_why(monkeypatch):
    def traced(*args: Any, **kwargs: Any) -> Trace:
        raise RuntimeError("a view modified inplace")

    monkeypatch.setattr(_locate, "_traced", traced)
    found = _locate.locate(None, Pool(Trace(0), breaks=False), spatial_size=2, step=0, lr=0.1,
                           seed=0)  # type: ignore[arg-type]  # fmt: skip
    assert found.first is None
    assert (
        found.problem
        == "the hooked rerun of the reference raised RuntimeError('a view modified inplace')"
    )
