"""harness.adopt on the ranks: models that own their groups get the harness's, a model whose
groups hold other ranks gets one clear line, and the warm ranks are handed on clean."""

from __future__ import annotations

import types
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from harness import Outputs, SpatialCase, Topology, check_equivalence
from harness.adopt import (
    GroupMismatch,
    adopt_distributed_manager,
    check_group,
    device_mesh,
    group_ranks,
    patch,
    pending,
    undo,
)
from harness.collectives import reduce_loss
from harness.topology import cached_groups

RANKS = 4


class Manager:
    """A stand-in for physicsnemo's ``DistributedManager`` (not installed in CI): the same
    shared-state design, and the methods a model asks it."""

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __new__(cls) -> Manager:
        obj = super().__new__(cls)
        obj.__dict__ = cls._shared_state
        return obj

    @classmethod
    def is_initialized(cls) -> bool:
        return bool(cls._shared_state.get("_is_initialized", False))

    @classmethod
    def initialize(cls) -> None:
        if not cls.is_initialized():  # physicsnemo would init_process_group here
            raise RuntimeError("the manager would create a process group of its own")

    def group(self, name: str | None = None) -> Any:
        return None if name is None else self._groups[name]


#: a module that caches its groups in globals, as WeatherGenerator's does
GROUPS = types.ModuleType("model_groups")
GROUPS.spatial = None  # type: ignore[attr-defined]


def model_state() -> dict[str, Any]:
    """What the model's libraries hold on this rank between runs."""
    return {
        "manager": dict(Manager._shared_state),
        "cached group": GROUPS.spatial,  # type: ignore[attr-defined]
        "pending": pending(),
    }


CLEAN = {"manager": {}, "cached group": None, "pending": 0}


class OwnsItsGroups(SpatialCase):
    """A model that takes its spatial group from a physicsnemo-style manager and a module
    cache, never as an argument: a spatially split linear layer, summed over the group."""

    dtype = torch.float64
    teardown_undoes = True

    def build(self, topo: Topology) -> torch.nn.Module:
        adopt_distributed_manager(topo, Manager)
        patch(GROUPS, "spatial", topo.spatial_group)
        Manager.initialize()  # returns at once: the harness's world is adopted
        group = Manager().group("spatial")
        check_group(group, topo, "the model's spatial group")
        return _split_linear(group)

    def teardown(self, model: torch.nn.Module | None, topo: Topology) -> None:
        if self.teardown_undoes:
            undo()

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        x = torch.randn(3, 8)
        if topo.spatial_group is None:
            return x
        return x.chunk(topo.spatial_size, dim=1)[topo.spatial_rank]

    def forward(self, model: torch.nn.Module, x: Any, topo: Topology) -> Outputs:
        group = GROUPS.spatial  # type: ignore[attr-defined]
        w = model.weight
        if group is not None:  # this rank's columns of the weight, its share of x @ w.T
            w = w.chunk(topo.spatial_size, dim=1)[topo.spatial_rank]
        part = x @ w.T
        if group is not None:
            part = _AllReduce.apply(part, group)
        return Outputs(reduce_loss(part.square().sum(), Topology.single()))


def _split_linear(group: Any) -> torch.nn.Module:
    model = torch.nn.Linear(8, 1, bias=False)
    if group is not None:  # each rank's gradient is its columns' only: sum them
        model.weight.register_hook(lambda g: _all_reduced(g, group))
    return model


def _all_reduced(grad: torch.Tensor, group: Any) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class _AllReduce(torch.autograd.Function):
    """Sum over ``group`` forward; identity backward (the output is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def test_a_model_that_owns_its_groups_runs_on_the_harnesss_and_hands_the_ranks_on_clean(
    spatial: Any,
) -> None:
    assert spatial.run(model_state) == [CLEAN] * RANKS
    spatial.check(OwnsItsGroups(), spatial_size=2)
    assert spatial.run(model_state) == [CLEAN] * RANKS
    assert model_state() == CLEAN  # the reference's process too


def test_adoptions_a_teardown_forgets_are_undone_by_the_harness(spatial: Any) -> None:
    case = OwnsItsGroups()
    case.teardown_undoes = False
    spatial.check(case)
    assert spatial.run(model_state) == [CLEAN] * RANKS
    assert model_state() == CLEAN


def manager_on_a_rank() -> dict[str, Any]:
    topo = Topology.create(spatial_size=2)
    adopt_distributed_manager(topo, Manager, groups={"model_parallel": "spatial", "dp": "data"})
    m = Manager()
    seen = {
        "rank": (m._rank, m._world_size, m._distributed, m._initialization_method),
        "groups": m._groups["model_parallel"] is topo.spatial_group
        and m._groups["dp"] is topo.data_group,
        "ranks": m._group_ranks,
    }
    undo()
    return seen


def test_the_manager_holds_the_harnesss_world_and_groups_by_the_models_names(
    spatial: Any,
) -> None:
    seen = spatial.run(manager_on_a_rank)
    for rank, got in enumerate(seen):
        assert got["rank"] == (rank, RANKS, True, "harness")
        assert got["groups"] is True
        spatial_ranks = [0, 1] if rank < 2 else [2, 3]
        assert got["ranks"] == {"model_parallel": spatial_ranks, "dp": [rank % 2, rank % 2 + 2]}


def mesh_on_a_rank(spatial_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    topo = Topology.create(spatial_size=spatial_size)
    mesh = device_mesh(topo)
    # DTensor on the spatial dimension: every rank's shard, gathered on the harness's group
    field = torch.arange(8.0) + 100 * topo.data_rank  # the same within a spatial group
    sharded = distribute_tensor(field, mesh["spatial"], [Shard(0)])
    return {
        "groups": (mesh.get_group("spatial") is topo.spatial_group)
        and (mesh.get_group("data") is topo.data_group),
        "coordinate": list(mesh.get_coordinate()),
        "local": sharded.to_local().tolist(),
        "gathered": sharded.redistribute(mesh["spatial"], [Replicate()]).to_local().tolist(),
    }


@pytest.mark.parametrize("spatial_size", [2, 4], ids=["s2xd2", "s4"])
def test_a_device_mesh_over_the_harnesss_groups_shards_and_gathers_on_them(
    spatial: Any, spatial_size: int
) -> None:
    for rank, got in enumerate(spatial.run(mesh_on_a_rank, spatial_size)):
        data_rank, spatial_rank = divmod(rank, spatial_size)
        assert got["groups"] is True
        assert got["coordinate"] == [data_rank, spatial_rank]
        chunk = 8 // spatial_size
        start = spatial_rank * chunk + 100 * data_rank
        assert got["local"] == [float(v) for v in range(start, start + chunk)]
        assert got["gathered"] == [float(v + 100 * data_rank) for v in range(8)]


def groups_of(layout: str) -> list[list[int]]:
    """The spatial groups a model builds: right, strided (the data groups' ranks) or ragged
    (ranks 2 and 3 alone)."""
    return {
        "right": [[0, 1], [2, 3]],
        "strided": [[0, 2], [1, 3]],
        "ragged": [[0, 1], [2], [3]],
    }[layout]


def model_group(layout: str) -> Any:
    lists = groups_of(layout)
    groups = cached_groups(("test_adopt", layout), lists)
    rank = dist.get_rank()
    return next(g for g, ranks in zip(groups, lists, strict=True) if rank in ranks)


def check_a_models_group(layout: str) -> str:
    topo = Topology.create(spatial_size=2)
    group = model_group(layout)
    try:
        check_group(group, topo, "model_comm_group")
        check_group(topo.data_group, topo, "the data group", of="data")
        check_group(dist.group.WORLD, topo, "the world", of="world")
    except GroupMismatch as exc:
        assert group_ranks(group) is not None
        return str(exc)
    return "ok"


def test_the_right_groups_pass_the_check_on_every_rank(spatial: Any) -> None:
    assert spatial.run(check_a_models_group, "right") == ["ok"] * RANKS


def test_a_group_of_the_wrong_ranks_is_one_line_naming_the_ranks_and_the_fix(
    spatial: Any,
) -> None:
    line = (
        "model_comm_group does not hold the ranks the topology says on rank 0, 1, 2, 3: "
        "rank 0 holds [0, 2], the topology's spatial group is [0, 1]; "
        "rank 1 holds [1, 3], the topology's spatial group is [0, 1] (and 2 more ranks); "
        "build it from topo.spatial_ranks, or hand the model the harness's own group "
        "(harness.adopt)"
    )
    assert spatial.run(check_a_models_group, "strided") == [line] * RANKS


def test_a_rank_whose_group_is_right_still_raises_with_the_ranks_whose_group_is_not(
    spatial: Any,
) -> None:
    # ranks 0 and 1 hold the right group; deciding together, they stop with 2 and 3
    # instead of waiting for them in the model's first collective
    line = (
        "model_comm_group does not hold the ranks the topology says on rank 2, 3: "
        "rank 2 holds [2], the topology's spatial group is [2, 3]; "
        "rank 3 holds [3], the topology's spatial group is [2, 3]; "
        "build it from topo.spatial_ranks, or hand the model the harness's own group "
        "(harness.adopt)"
    )
    assert spatial.run(check_a_models_group, "ragged") == [line] * RANKS


class BuildsItsOwnGroup(OwnsItsGroups):
    """Builds its spatial group itself, from the wrong ranks (the data groups' layout)."""

    def build(self, topo: Topology) -> torch.nn.Module:
        group = None if topo.spatial_group is None else model_group("strided")
        patch(GROUPS, "spatial", group)
        check_group(group, topo, "the model's spatial group")
        return _split_linear(group)


def test_a_case_whose_model_group_differs_from_the_topology_gets_that_line_in_the_report(
    spatial: Any,
) -> None:
    report = check_equivalence(
        BuildsItsOwnGroup(), ranks=RANKS, spatial_size=2, pool=spatial.pool()
    )
    assert not report.ok
    assert {m.quantity for m in report.mismatches} == {"error"}
    assert {m.rank for m in report.mismatches} == set(range(RANKS))  # nobody left waiting
    assert all(m.phase == "build" for m in report.mismatches)
    assert (
        "GroupMismatch: the model's spatial group does not hold the ranks the topology says "
        "on rank 0, 1, 2, 3: rank 0 holds [0, 2]" in str(report)
    )
    assert spatial.run(model_state) == [CLEAN] * RANKS


class ChecksItsGroupButSplitsNothing(SpatialCase):
    """Every rank computes the whole problem alone; only build's group check talks."""

    dtype = torch.float64

    def build(self, topo: Topology) -> torch.nn.Module:
        check_group(topo.spatial_group, topo, "the model's spatial group")
        return torch.nn.Linear(3, 2)

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(4, 3)

    def forward(self, model: torch.nn.Module, x: Any, topo: Topology) -> Outputs:
        y = model(x)
        return Outputs(y.square().mean(), {"y": y})


def test_the_group_checks_own_agreement_does_not_hide_a_vacuous_check(spatial: Any) -> None:
    report = check_equivalence(ChecksItsGroupButSplitsNothing(), ranks=RANKS, pool=spatial.pool())
    assert [m.quantity for m in report.mismatches] == ["vacuous"]
