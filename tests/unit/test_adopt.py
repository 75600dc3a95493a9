"""harness.adopt in one process: the undo stack, physicsnemo's manager, the reference's side.

The ranks' side (DeviceMesh, the group check, warm ranks left clean) is in
tests/distributed/test_adopt.py.
"""

from __future__ import annotations

import sys
import types
from typing import Any, ClassVar

import pytest
import torch

import harness
from harness import Outputs, SpatialCase, Topology, adopt
from harness._rank.run import run_case
from harness.adopt import GroupMismatch, adopt_distributed_manager, check_group, patch, undo
from harness.errors import ConfigError


class FakeManager:
    """physicsnemo's ``DistributedManager`` design: every instance shares one class dict."""

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __new__(cls) -> FakeManager:
        obj = super().__new__(cls)
        obj.__dict__ = cls._shared_state
        return obj

    def group(self, name: str | None = None) -> Any:
        return self._groups[name] if name is not None else None


@pytest.fixture(autouse=True)
def _clean_stack() -> Any:
    assert adopt.pending() == 0, "an earlier test left adoptions behind"
    yield
    undo()
    FakeManager._shared_state.clear()


class Owner:
    @staticmethod
    def helper() -> str:
        return "real"


class Child(Owner):
    pass


def test_patch_puts_back_module_globals_staticmethods_and_absent_names() -> None:
    module = types.ModuleType("model_groups")
    module.SPATIAL_GROUP = "theirs"  # type: ignore[attr-defined]
    patch(module, "SPATIAL_GROUP", "harness's")
    patch(module, "NEVER_SET", 1)
    patch(Owner, "helper", staticmethod(lambda: "patched"))
    patch(Child, "helper", staticmethod(lambda: "child"))  # inherited: not Child's own
    assert (module.SPATIAL_GROUP, Owner.helper(), Child.helper()) == (
        "harness's",
        "patched",
        "child",
    )
    assert adopt.pending() == 4
    undo()
    assert module.SPATIAL_GROUP == "theirs" and not hasattr(module, "NEVER_SET")
    assert isinstance(vars(Owner)["helper"], staticmethod) and Owner.helper() == "real"
    assert "helper" not in vars(Child) and Child.helper() == "real"
    assert adopt.pending() == 0


def test_undo_runs_last_first_and_every_action_even_after_one_raises() -> None:
    done: list[str] = []

    def broken() -> None:
        done.append("broken")
        raise RuntimeError("cannot put it back")

    adopt.on_undo(lambda: done.append("first"))
    adopt.on_undo(broken)
    adopt.on_undo(lambda: done.append("last"))
    with pytest.raises(RuntimeError, match="cannot put it back"):
        undo()
    assert done == ["last", "broken", "first"] and adopt.pending() == 0


def test_adopted_undoes_only_what_its_block_adopted() -> None:
    module = types.ModuleType("cache")
    module.GROUP = "a"  # type: ignore[attr-defined]
    patch(module, "GROUP", "b")
    with adopt.adopted():
        patch(module, "GROUP", "c")
        assert module.GROUP == "c"
    assert module.GROUP == "b" and adopt.pending() == 1


GROUP_CACHE = types.ModuleType("group_cache")  # a model's module that caches its group
GROUP_CACHE.GROUP = "the model's own"  # type: ignore[attr-defined]


class ForgetsItsTeardown(SpatialCase):
    """Adopts into a module cache in build and never undoes it."""

    dtype = torch.float64

    def build(self, topo: Topology) -> torch.nn.Module:
        patch(GROUP_CACHE, "GROUP", topo.spatial_group)
        return torch.nn.Linear(2, 1)

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(3, 2)

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        assert GROUP_CACHE.GROUP is topo.spatial_group  # type: ignore[attr-defined]
        return Outputs(model(batch).sum())


def test_a_run_undoes_what_it_adopted_but_never_what_its_caller_adopted() -> None:
    module = types.ModuleType("callers")
    module.VALUE = "before"  # type: ignore[attr-defined]
    patch(module, "VALUE", "the caller's own adoption")
    run_case(ForgetsItsTeardown(), Topology.single(), steps=1, lr=0.1, seed=0)
    assert GROUP_CACHE.GROUP == "the model's own"  # type: ignore[attr-defined]
    assert module.VALUE == "the caller's own adoption" and adopt.pending() == 1


def test_the_reference_gets_an_initialised_one_process_manager_and_its_state_back() -> None:
    FakeManager._shared_state.update(_rank=7, _mine="kept")
    assert adopt_distributed_manager(Topology.single(), FakeManager) is FakeManager
    manager = FakeManager()
    assert (manager._is_initialized, manager._distributed) == (True, False)
    assert (manager._rank, manager._world_size, manager._device) == (0, 1, torch.device("cpu"))
    assert manager.group("spatial") is None and manager.group("data") is None
    undo()
    assert FakeManager._shared_state == {"_rank": 7, "_mine": "kept"}
    assert manager.__dict__ is FakeManager._shared_state  # put back in place, not replaced


def test_named_groups_are_the_topologys_and_a_wrong_name_says_which_exist() -> None:
    adopt_distributed_manager(Topology.single(), FakeManager, groups={"model_parallel": "spatial"})
    assert list(FakeManager()._groups) == ["model_parallel"]
    with pytest.raises(ConfigError, match=r"unknown topology group 'h'.*'spatial', 'data'"):
        adopt_distributed_manager(Topology.single(), FakeManager, groups={"h": "h"})
    assert adopt.pending() == 1  # the refused one left nothing to undo


def test_without_physicsnemo_the_adoption_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "physicsnemo", None)
    monkeypatch.setitem(sys.modules, "physicsnemo.distributed", None)
    with pytest.raises(ConfigError, match=r"pip install nvidia-physicsnemo.*pass the manager"):
        adopt_distributed_manager(Topology.single())
    with pytest.raises(ConfigError, match="keeps no _shared_state dict"):
        adopt_distributed_manager(Topology.single(), object)
    assert adopt.pending() == 0  # nothing half-adopted


def test_the_reference_passes_with_no_group_and_names_a_wrong_of() -> None:
    check_group(None, Topology.single(), "model_comm_group")
    with pytest.raises(ConfigError, match=r"check_group\(of='spatal'\)"):
        check_group(None, Topology.single(), of="spatal")


def test_a_reference_given_a_group_it_cannot_hold_gets_one_line() -> None:
    with pytest.raises(GroupMismatch, match=r"^model_comm_group on the reference holds ranks \?"):
        check_group(object(), Topology.single(), "model_comm_group")


def test_the_group_check_and_its_error_are_public() -> None:
    assert harness.check_group is check_group and issubclass(harness.GroupMismatch, ConfigError)
    assert Topology.single().data_ranks == [0] and Topology.single().spatial_ranks == [0]
