"""A check's reference runs while its ranks do: the ranks start first, in other processes,
and the serial reference runs in this one beside them (``harness.equivalence._early``); a
reference that raises meanwhile leaves no thread or rank work behind and the pool warm."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from harness import Topology, check_equivalence
from harness.steppers.mlp import CoupledMLPCase

#: How long a side waits for the other's marker before it gives up. Generous: a loaded
#: 2-core machine may take seconds to schedule the ranks; a check that runs the two one after
#: the other then fails after this long rather than hanging.
PATIENCE = 60.0


def _wait_for(marker: Path, who: str) -> None:
    """Block until ``marker`` exists; raise after ``PATIENCE`` seconds."""
    deadline = time.monotonic() + PATIENCE
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who}: {marker.name} never appeared in {PATIENCE:g} s")
        time.sleep(0.01)


class ReferenceWaitsForRanks(CoupledMLPCase):
    """The coupled MLP whose reference builds only once rank 0 has built: it can pass only
    if the ranks run while the reference does."""

    def __init__(self, folder: Path, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.folder = folder

    def build(self, topo: Topology) -> torch.nn.Module:
        if topo.spatial_group is None:  # the reference, in the calling process
            _wait_for(self.folder / "ranks-built", "the reference")
        elif topo.rank == 0:
            (self.folder / "ranks-built").touch()
        return super().build(topo)


class ReferenceRaisesWhileRanksRun(ReferenceWaitsForRanks):
    """The reference raises once the ranks have built; the ranks go on only after it has
    (the marker it writes just before raising), then keep busy a moment longer, so its
    failure is reported while their run is still under way."""

    def build(self, topo: Topology) -> torch.nn.Module:
        model = super().build(topo)
        if topo.spatial_group is None:
            (self.folder / "reference-raised").touch()
            raise RuntimeError("the reference's build broke")
        _wait_for(self.folder / "reference-raised", f"rank {topo.rank}")
        time.sleep(0.5)  # still running when the check would return without joining them
        return model


def _warm(spatial):  # type: ignore[no-untyped-def]
    """The test's pool, started: its start (seconds on a loaded machine) is not the ranks'
    part that the reference waits ``PATIENCE`` for."""
    pool = spatial.pool(4)
    assert check_equivalence(CoupledMLPCase(npos=37), ranks=4, pool=pool).ok
    return pool


def test_the_reference_runs_while_the_ranks_run(spatial, tmp_path):
    pool = _warm(spatial)
    report = check_equivalence(ReferenceWaitsForRanks(tmp_path, npos=37), ranks=4, pool=pool)
    assert report.ok, report  # a reference run before the ranks raises TimeoutError instead


def test_a_reference_that_raises_while_the_ranks_run_leaves_the_pool_warm_and_clean(
    spatial, tmp_path
):
    pool = _warm(spatial)
    report = check_equivalence(ReferenceRaisesWhileRanksRun(tmp_path, npos=37), ranks=4, pool=pool)
    starts = pool.starts  # the ranks that ran beside the failing reference
    (error,) = report.mismatches
    assert (error.quantity, error.run) == ("error", "reference"), report
    assert "the reference's build broke" in error.where
    # the ranks' run was joined before the verdict: no thread of it outlives the check
    assert not [t for t in threading.enumerate() if t.name == "harness-ranks"]
    # and the pool was neither left busy nor restarted: the next check runs on the same ranks
    assert check_equivalence(CoupledMLPCase(npos=37), ranks=4, pool=pool).ok
    assert pool.starts == starts


def test_an_error_after_the_reference_waits_for_the_ranks_beside_it(spatial, monkeypatch):
    """Between the reference and the ranks' judgement (the tolerance, the calibration
    decision) nothing may leave the ranks' run in flight: the pool must be idle for the
    next check, not still running this one's call."""
    import harness.equivalence as equivalence

    pool = _warm(spatial)

    def broken(*args, **kwargs):
        raise KeyboardInterrupt  # what a user's Ctrl-C would raise there

    monkeypatch.setattr(equivalence, "calibrates", broken)
    with pytest.raises(KeyboardInterrupt):
        check_equivalence(CoupledMLPCase(npos=37), ranks=4, pool=pool)
    assert not [t for t in threading.enumerate() if t.name == "harness-ranks"]
    monkeypatch.undo()
    starts = pool.starts
    assert check_equivalence(CoupledMLPCase(npos=37), ranks=4, pool=pool).ok
    assert pool.starts == starts
