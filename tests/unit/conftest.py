"""Fixtures shared by the unit tests."""

from __future__ import annotations

from typing import ClassVar

import pytest

from harness import Topology


class InProcess:
    """A runner of one rank that runs the rank's function in this process (as torchrun's
    runner does), its topology the single process's: a check with no pool to wait on."""

    world_size = 1
    last_outputs: ClassVar[list[str]] = []

    def run(self, fn, *args, timeout=None, **kwargs):
        return [fn(*args, **kwargs)]


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setattr(Topology, "create", staticmethod(lambda *a, **k: Topology.single()))
    return InProcess()
