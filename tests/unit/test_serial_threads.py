"""The torch threads of a serial run in the calling process (``harness._base.cpus``): the
cores of this process's share that the ranks running beside it leave, never fewer than one;
the reference of a check runs with them and puts torch's own setting back."""

from __future__ import annotations

import pytest
import torch

import harness._base.cpus as cpus
from harness import Outputs, SpatialCase
from harness.equivalence import _reference_beside, bounded_reference, spec_of


class Threads(SpatialCase):
    """A tiny case that notes the torch threads its forward runs with."""

    dtype = torch.float64

    def __init__(self) -> None:
        self.seen: list[int] = []

    def build(self, topo):
        return torch.nn.Linear(2, 1)

    def batch(self, topo, step):
        return torch.ones(3, 2)

    def forward(self, model, batch, topo):
        self.seen.append(torch.get_num_threads())
        y = model(batch)
        return Outputs((y**2).mean(), {"y": y})


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cpus, "cores", lambda: 4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)


@pytest.mark.parametrize(("beside", "threads"), [(0, 4), (1, 3), (3, 1), (4, 1), (9, 1)])
def test_a_serial_run_gets_the_cores_the_ranks_leave(four_cores, beside, threads):
    assert cpus.serial_threads(beside) == threads


def test_the_share_is_per_xdist_worker(four_cores, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert cpus.share() == 2 and cpus.serial_threads(1) == 1
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")  # more workers than cores
    assert cpus.share() == 1


def test_torch_threads_are_put_back_even_when_the_block_raises():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    seen = []

    def inside() -> None:
        with cpus.torch_threads(other):
            seen.append(torch.get_num_threads())
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        inside()
    assert seen == [other] and torch.get_num_threads() == before


@pytest.mark.parametrize(("beside", "threads"), [(0, 2), (1, 1), (4, 1)])
def test_the_reference_runs_with_the_threads_its_ranks_leave(monkeypatch, beside, threads):
    monkeypatch.setattr(cpus, "cores", lambda: 2)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    case, before = Threads(), torch.get_num_threads()
    bounded_reference(case, 2, 0.1, 0, None, beside=beside)
    assert case.seen and set(case.seen) == {threads}
    assert torch.get_num_threads() == before


class _Started:
    """A ranks' run under way, as ``run_check`` holds one (``_early``)."""

    def join(self) -> None:
        pass


@pytest.mark.parametrize(("started", "threads"), [(None, 4), (_Started(), 1)])
def test_a_check_reference_beside_its_ranks_leaves_them_their_cores(four_cores, started, threads):
    # four ranks started early run while the reference does: it gets what they leave (1);
    # not started (a case that loads the reference's values), they run after: every core
    case = Threads()
    spec = spec_of(case, ranks=4, spatial_size=4)
    _reference_beside(spec, case, None, started)
    assert case.seen and set(case.seen) == {threads}
