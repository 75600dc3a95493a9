"""Models whose values are DTensors (``distribute_module``, the standard way) or another
tensor subclass with ``to_local()`` / ``full_tensor()`` (physicsnemo's ``ShardTensor``, whose
interface ``ShardLike`` below mimics; physicsnemo itself is not a dependency): a correct one
passes, a wrong one is a report with its quantity, never an exception out of the check,
located or not. Also: complex fields with exact zeros, a reference that raises, and
declarations locating cannot read, which fail the check up front as a ``ConfigError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import Outputs, Positions, Shard, SpatialCase, Topology, check_equivalence
from harness.adopt import device_mesh
from harness.collectives import reduce_loss, sync_gradients

RANKS = 2
N, IN, OUT = 8, 4, 3  # 8 positions over 2 ranks; 3 output features: an uneven 2 + 1 split


def _rows(topo: Topology) -> slice:
    k = N // topo.spatial_size
    return slice(topo.spatial_rank * k, (topo.spatial_rank + 1) * k)


class DTensorLinear(SpatialCase):
    """``y = x W^T + b`` with ``W``, ``b`` DTensor parameters of a (data, spatial) mesh.

    ``layout="replicate"``: the positions (rows of ``x``) are split over the spatial group and
    the parameters replicated; their local values are used with ``to_local(grad_placements=
    [Replicate(), Partial()])``, so each rank's gradient is a partial sum that DTensor adds up
    (``fault="no-grad-sync"``: ``to_local()``, which declares the partial sums replicated).
    ``layout="shard"``: every rank sees every position and holds the output features
    ``Shard(0)`` gives it (2 + 1), returning ``y`` as a DTensor ``Shard(1)`` of the field
    (``fault="wrong-placement"``: the field declared ``Shard(0)``, along the positions).
    """

    dtype = torch.float64

    def __init__(self, layout: str = "replicate", fault: str | None = None) -> None:
        self.layout, self.fault = layout, fault
        self.name = f"dtensor-{layout}" + (f"-{fault}" if fault else "")

    def build(self, topo: Topology) -> torch.nn.Module:
        from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

        model = torch.nn.Linear(IN, OUT)
        mesh = device_mesh(topo)
        if mesh is None:
            return model  # the reference: plain parameters
        placements = [Replicate(), Shard(0) if self.layout == "shard" else Replicate()]

        def partition(name: str, module: torch.nn.Module, mesh: Any) -> None:
            for key, p in list(module.named_parameters(recurse=False)):
                value = distribute_tensor(p.detach(), mesh, placements)
                module.register_parameter(key, torch.nn.Parameter(value))

        return distribute_module(model, mesh, partition)

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        x = torch.randn(N, IN)
        return x[_rows(topo)] if self.layout == "replicate" else x

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        from torch.distributed.tensor import DTensor, Partial, Replicate
        from torch.distributed.tensor import Shard as DShard

        w, b = model.weight, model.bias
        if isinstance(w, DTensor):
            grads = None if self.fault == "no-grad-sync" else [Replicate(), Partial()]
            if self.layout == "shard":
                grads = None  # a shard's gradient is its own: nothing to add up
            w, b = w.to_local(grad_placements=grads), b.to_local(grad_placements=grads)
        y = F.linear(batch, w, b)
        loss = reduce_loss(y.pow(2).sum(), topo) / (N * OUT)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        if self.layout == "replicate":
            rows = _rows(topo)
            return Outputs(loss, {"y": Shard(y, torch.arange(rows.start, rows.stop), dim=0)})
        along = DShard(0) if self.fault == "wrong-placement" else DShard(1)
        mesh = model.weight.device_mesh
        field = DTensor.from_local(
            y, mesh, [Replicate(), along], shape=torch.Size([N, OUT]), stride=(OUT, 1)
        )
        return Outputs(loss, {"y": field})

    def partition(self, topo: Topology) -> Any:
        rows = _rows(topo)
        return Positions(N, range(rows.start, rows.stop)) if self.layout == "replicate" else None


@pytest.mark.parametrize("layout", ["replicate", "shard"])
def test_a_correct_model_with_dtensor_parameters_is_equivalent(spatial, layout):
    report = check_equivalence(DTensorLinear(layout), ranks=RANKS, pool=spatial.pool(RANKS))
    assert report.ok, str(report)
    # float64: reordered sums only, ~1e-16 relative
    assert max(report.stats[q].max_rel for q in ("loss", "grad", "field", "param")) < 1e-12


@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_dtensor_gradients_left_unsummed_are_a_grad_report_located_or_not(spatial, locate):
    case = DTensorLinear("replicate", fault="no-grad-sync")
    report = check_equivalence(case, ranks=RANKS, pool=spatial.pool(RANKS), locate=locate)
    assert not report.ok
    first = report.mismatches[0]
    assert (first.quantity, first.name, first.step) == ("grad", "weight", 0), str(report)
    assert {"grad", "param"} <= report.quantities
    text = str(report)  # the report reads whole, whatever locating made of DTensors
    assert "grad 'weight'" in text


def test_a_dtensor_field_declared_along_the_wrong_dim_is_a_field_finding(spatial):
    report = check_equivalence(
        DTensorLinear("shard", fault="wrong-placement"), ranks=RANKS, pool=spatial.pool(RANKS)
    )
    assert report.quantities & {"field", "coverage"}, str(report)
    assert not report.quantities & {"error", "crash"}, str(report)


def test_a_sharded_dtensor_parameter_is_described_by_its_placements(spatial):
    # the shard of rank 1 made wrong by hand: its initial value is off
    report = check_equivalence(Nudged("shard"), ranks=RANKS, pool=spatial.pool(RANKS))
    init = [m for m in report.mismatches if m.step is None]
    assert [(m.quantity, m.name, m.rank) for m in init] == [("param", "weight", 1)], str(report)
    assert (
        "(positions 2..2 along dim 0 of a DTensor (Replicate(), Shard(dim=0)) on a 1x2 mesh "
        "('data', 'spatial'))" in init[0].where
    ), init[0].where


class Nudged(DTensorLinear):
    """Rank 1's shard of the weight moved by 1e-3 after build."""

    def build(self, topo: Topology) -> torch.nn.Module:
        model = super().build(topo)
        if topo.spatial_rank == 1:
            with torch.no_grad():
                model.weight.to_local().add_(1e-3)
        return model


# ---------------------------------------------------------------------- a ShardTensor-like


class ShardLike(torch.Tensor):
    """physicsnemo's ``ShardTensor`` in miniature: this rank's block of a global tensor, with
    ``to_local()`` (the block) and ``full_tensor()`` (every rank's block, gathered along
    ``shard_dim``); ``shard_dim=None`` (also what operations on it give) is a replicated
    value."""

    shard_dim: int | None = None
    group: Any = None

    @staticmethod
    def __new__(cls, local: torch.Tensor, dim: int | None, group: Any) -> ShardLike:
        out = torch.Tensor._make_subclass(cls, local.detach(), local.requires_grad)
        out.shard_dim, out.group = dim, group
        return out

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def full_tensor(self) -> torch.Tensor:
        local = self.to_local().detach()
        if self.shard_dim is None:
            return local
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.shard_dim)


class ShardLikeLinear(DTensorLinear):
    """The replicated layout with ``ShardLike`` parameters (``dim=None``) and its field a
    bare ``ShardLike`` along the positions; gradients summed by ``sync_gradients``
    (``fault="no-grad-sync"``: not summed)."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__("replicate", fault)
        self.name = "shardlike" + (f"-{fault}" if fault else "")

    def build(self, topo: Topology) -> torch.nn.Module:
        model = torch.nn.Linear(IN, OUT)
        if topo.spatial_group is None:
            return model
        for key, p in list(model.named_parameters()):
            like = ShardLike(p.detach().clone(), None, topo.spatial_group)
            model.register_parameter(key, torch.nn.Parameter(like))
        if self.fault != "no-grad-sync":
            sync_gradients(model, topo)
        return model

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        y = F.linear(batch, model.weight, model.bias)
        loss = reduce_loss(y.pow(2).sum(), topo) / (N * OUT)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        return Outputs(loss, {"y": ShardLike(y, 0, topo.spatial_group)})


def test_a_correct_model_with_shardtensor_like_values_is_equivalent(spatial):
    report = check_equivalence(ShardLikeLinear(), ranks=RANKS, pool=spatial.pool(RANKS))
    assert report.ok, str(report)


@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_shardtensor_like_gradients_left_unsummed_are_a_grad_report(spatial, locate):
    report = check_equivalence(
        ShardLikeLinear("no-grad-sync"), ranks=RANKS, pool=spatial.pool(RANKS), locate=locate
    )
    first = report.mismatches[0]
    assert (first.quantity, first.name, first.step) == ("grad", "weight", 0), str(report)
