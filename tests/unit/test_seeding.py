"""``harness._base.compat.manual_seed``: what ``torch.manual_seed`` does for the process,
without queueing seeds (each with a formatted stack) for accelerators that cannot exist."""

from __future__ import annotations

import pytest
import torch

from harness._base import compat


def test_it_seeds_the_cpu_generator_as_torch_does():
    compat.manual_seed(1234)
    ours = torch.rand(5), torch.randint(0, 10**9, (3,))
    torch.manual_seed(1234)
    assert torch.equal(ours[0], torch.rand(5)) and torch.equal(
        ours[1], torch.randint(0, 10**9, (3,))
    )


@pytest.mark.parametrize("possible", [False, True])
def test_torch_manual_seed_runs_exactly_where_an_accelerator_could(possible, monkeypatch):
    called = []
    monkeypatch.setattr(compat, "_ACCELERATORS", [possible])
    monkeypatch.setattr(torch, "manual_seed", lambda seed: called.append(seed))
    compat.manual_seed(7)
    assert called == ([7] if possible else [])


def test_a_custom_device_or_an_unreadable_registry_counts_as_an_accelerator(monkeypatch):
    monkeypatch.setattr(compat, "_ACCELERATORS", [])
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    assert compat._accelerators_possible()
    monkeypatch.setattr(compat, "_ACCELERATORS", [])

    def gone():
        raise AttributeError("internal removed")

    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", gone)
    assert compat._accelerators_possible()
