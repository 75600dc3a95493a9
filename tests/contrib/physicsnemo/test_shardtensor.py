"""Models whose fields are physicsnemo ``ShardTensor``s, real ones, shards of uneven sizes:
a correct model is equivalent; a gradient left unsummed over the spatial group and a field
shard placed at another rank's offset are reports with their quantities, located or not;
nothing raises from inside the harness.

physicsnemo is not a CI dependency (its install, with its ~60 dependencies, takes minutes):
these skip without it. To run them::

    python -m venv .venv-pnemo
    .venv-pnemo/bin/pip install "torch==2.13.0" nvidia-physicsnemo
    .venv-pnemo/bin/pip install -e ".[test]"
    .venv-pnemo/bin/python -m pytest tests/contrib/physicsnemo --spatial-ranks 4 -n 0

What physicsnemo 2.2.2 on torch 2.13 allows on CPU shapes the models: ``sharding_shapes=
"infer"`` (``from_local``'s default) gathers the shapes through CUDA (pinned memory), so the
shapes are given; an operation on uneven ``ShardTensor``s falls back to DTensor, which
expects ``torch.chunk``'s split, and a backward through one fails in DTensorSpec's
``shard_order`` check. So the models compute on their local blocks and the ``ShardTensor``
is what they take in and give out, as a model's boundary with physicsnemo is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

INSTALL = 'pip install "torch==2.13.0" nvidia-physicsnemo'
pytest.importorskip(
    "physicsnemo.domain_parallel",
    reason=f"physicsnemo is not installed here: {INSTALL} (in the same command), then "
    'pip install -e ".[test]"',
)

from harness import Outputs, Positions, SpatialCase, Topology, check_equivalence  # noqa: E402
from harness.adopt import adopt_distributed_manager, device_mesh  # noqa: E402
from harness.collectives import reduce_loss, sync_gradients  # noqa: E402

N, IN, OUT = 20, 3, 2


def sizes(spatial_size: int) -> list[int]:
    """Every rank's number of the ``N`` positions: uneven, and not ``torch.chunk``'s split
    (4 ranks: 8, 6, 4, 2; 2 ranks: 18, 2), so only a spec that keeps every shard's shape
    places them."""
    rest = [2 * (spatial_size - r) for r in range(1, spatial_size)]
    if sum(rest) >= N:
        pytest.skip(f"{spatial_size} ranks: these cases split {N} positions over 2 to 4 ranks")
    return [N - sum(rest), *rest]


def block(topo: Topology, rank: int) -> range:
    n = sizes(topo.spatial_size)
    start = sum(n[:rank])
    return range(start, start + n[rank])


class Pointwise(torch.nn.Module):
    """``tanh(x W^T + b)`` on the positions this rank holds: ``x`` a ``ShardTensor`` (its
    local block) or, for the reference, a plain tensor. Parameters that are ``ShardTensor``s
    are used as their local values, their gradients declared ``grads`` (``[Replicate(),
    Partial()]``: each rank's is a part of the sum, which physicsnemo adds up)."""

    def __init__(self, out: int = OUT) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(IN, out)
        self.grads: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if callable(getattr(x, "to_local", None)) else x
        w, b = self.linear.weight, self.linear.bias
        if callable(getattr(w, "to_local", None)):
            w, b = w.to_local(grad_placements=self.grads), b.to_local(grad_placements=self.grads)
            return torch.tanh(F.linear(local, w, b))
        return torch.tanh(self.linear(local))


class ShardedWeights(SpatialCase):
    """``Pointwise`` with ``N`` output features, its weight and bias ``ShardTensor``s
    ``[Replicate(), Shard(0)]`` of uneven row blocks (``sizes``): every rank sees every
    position and computes its features, the field a ``ShardTensor`` ``[Replicate(),
    Shard(1)]``. A shard's gradient is its own: nothing is summed.

    ``fault="misplaced"``: each rank takes the mirror rank's rows of the reference's
    initial weight and declares them where the spec puts its own (its initial parameters,
    and everything after, are off).
    """

    dtype = torch.float64

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault
        self.name = "shardtensor-sharded-weights" + (f"-{fault}" if fault else "")

    def features(self, topo: Topology) -> tuple[range, list[int]]:
        """This rank's feature rows and every rank's count, as the ranks hold them."""
        rank, n = topo.spatial_rank, sizes(topo.spatial_size)
        if self.fault == "misplaced":
            rank, n = topo.spatial_size - 1 - rank, n[::-1]
        start = sum(sizes(topo.spatial_size)[:rank])
        return range(start, start + sizes(topo.spatial_size)[rank]), n

    def build(self, topo: Topology) -> torch.nn.Module:
        model = Pointwise(N)  # the whole drawn on every rank: the reference's initial values
        if topo.spatial_group is None:
            return model
        from physicsnemo.domain_parallel import ShardTensor
        from torch.distributed.tensor import Replicate, Shard

        mesh = device_mesh(topo)
        rows, n = self.features(topo)
        for key, p in list(model.linear.named_parameters()):
            local = p.detach()[rows.start : rows.stop].clone()
            shapes = {1: [(k, *p.shape[1:]) for k in n]}
            value = ShardTensor.from_local(
                local, mesh, [Replicate(), Shard(0)], sharding_shapes=shapes
            )
            model.linear.register_parameter(key, torch.nn.Parameter(value))
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(N, IN)

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        y = model(batch)
        loss = reduce_loss(y.pow(2).sum(), topo)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        from physicsnemo.domain_parallel import ShardTensor
        from torch.distributed.tensor import Replicate, Shard

        shapes = {1: [(N, k) for k in self.features(topo)[1]]}
        mesh = device_mesh(topo)
        field = ShardTensor.from_local(
            y.detach(), mesh, [Replicate(), Shard(1)], sharding_shapes=shapes
        )
        return Outputs(loss, {"y": field})


class ShardTensorLinear(SpatialCase):
    """``Pointwise`` over the positions, its input and output ``ShardTensor``s
    ``[Replicate(), Shard(0)]`` on the harness's (data, spatial) mesh, with every shard's
    shape; its weights plain and replicated, their gradients summed by ``sync_gradients``
    (``params="shardtensor"``: replicated ``ShardTensor`` parameters, their gradients summed
    by physicsnemo).

    ``fault="no-grad-sync"``: gradients not summed over the spatial group.
    ``fault="misplaced"``: each rank computes the positions of the mirror rank's block
    (rank ``r`` those of ``S - 1 - r``) and declares its block where the spec puts rank
    ``r``'s: the field's values sit at the wrong offsets; loss and gradients stay right.
    ``inputs="scatter"``: ``x`` comes from ``scatter_tensor`` (rank 0's whole ``x``, split
    as ``torch.chunk`` splits, through physicsnemo's ``DistributedManager``, adopted).
    """

    dtype = torch.float64

    def __init__(
        self, fault: str | None = None, inputs: str = "from_local", params: str = "plain"
    ) -> None:
        self.fault, self.inputs, self.params = fault, inputs, params
        self.name = f"shardtensor-{inputs}-{params}" + (f"-{fault}" if fault else "")

    def build(self, topo: Topology) -> torch.nn.Module:
        model = Pointwise()
        if topo.spatial_group is None:
            return model
        if self.params == "shardtensor":
            from physicsnemo.domain_parallel import ShardTensor
            from torch.distributed.tensor import Partial, Replicate

            mesh = device_mesh(topo)
            for key, p in list(model.linear.named_parameters()):
                value = ShardTensor.from_local(p.detach(), mesh, [Replicate(), Replicate()])
                model.linear.register_parameter(key, torch.nn.Parameter(value))
            if self.fault != "no-grad-sync":
                model.grads = [Replicate(), Partial()]
        elif self.fault != "no-grad-sync":
            sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(N, IN)

    def shapes(self, topo: Topology, features: int) -> dict[int, list[tuple[int, int]]]:
        """Every shard's shape along the spatial mesh dim, as the ranks hold them."""
        n = sizes(topo.spatial_size)
        if self.fault == "misplaced":
            n = n[::-1]  # rank r holds the mirror block
        return {1: [(k, features) for k in n]}

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        if topo.spatial_group is None:
            y = model(batch)
            return Outputs(reduce_loss(y.pow(2).sum(), topo), {"y": y})
        from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
        from torch.distributed.tensor import Replicate, Shard

        mesh = device_mesh(topo)
        placements = [Replicate(), Shard(0)]
        if self.inputs == "scatter":
            adopt_distributed_manager(topo)
            x = scatter_tensor(batch, 0, mesh, placements)
            shapes = {1: [(s[0], OUT) for s in x._spec.sharding_shapes(1)]}
        else:
            rank = topo.spatial_rank
            if self.fault == "misplaced":
                rank = topo.spatial_size - 1 - rank
            rows = block(topo, rank)
            local = batch[rows.start : rows.stop]
            x = ShardTensor.from_local(
                local, mesh, placements, sharding_shapes=self.shapes(topo, IN)
            )
            shapes = self.shapes(topo, OUT)
        y = model(x)
        loss = reduce_loss(y.pow(2).sum(), topo)
        field = ShardTensor.from_local(y.detach(), mesh, placements, sharding_shapes=shapes)
        return Outputs(loss, {"y": field})

    def partition(self, topo: Topology) -> Any:
        if self.inputs == "scatter":
            return None
        n = [shape[0] for shape in self.shapes(topo, IN)[1]]
        start = sum(n[: topo.spatial_rank])  # where the ShardTensor says the block sits
        return Positions(N, range(start, start + n[topo.spatial_rank]))


@pytest.mark.parametrize("params", ["plain", "shardtensor"])
def test_a_correct_shardtensor_model_with_uneven_shards_is_equivalent(spatial, params):
    ranks = spatial.ranks
    case = ShardTensorLinear(params=params)
    report = check_equivalence(case, ranks=ranks, pool=spatial.pool(ranks))
    assert report.ok, str(report)
    # float64: reordered sums only, ~1e-16 relative
    assert max(report.stats[q].max_rel for q in ("loss", "grad", "field")) < 1e-12


def test_a_shardtensor_input_from_scatter_tensor_is_equivalent(spatial):
    ranks = spatial.ranks
    case = ShardTensorLinear(inputs="scatter")
    report = check_equivalence(case, ranks=ranks, pool=spatial.pool(ranks))
    assert report.ok, str(report)


@pytest.mark.parametrize("params", ["plain", "shardtensor"])
@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_shardtensor_gradients_left_unsummed_are_a_grad_report(spatial, locate, params):
    ranks = spatial.ranks
    case = ShardTensorLinear("no-grad-sync", params=params)
    report = check_equivalence(case, ranks=ranks, pool=spatial.pool(ranks), locate=locate)
    print(report)
    first = report.mismatches[0]
    assert (first.quantity, first.name, first.step) == ("grad", "linear.weight", 0), str(report)
    assert {"grad", "param"} <= report.quantities, str(report)
    assert not report.quantities & {"error", "crash"}, str(report)
    assert ("First divergence:" in str(report)) is locate, str(report)


@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_a_shardtensor_field_block_at_the_wrong_offset_is_a_field_report(spatial, locate):
    ranks = spatial.ranks
    report = check_equivalence(
        ShardTensorLinear("misplaced"), ranks=ranks, pool=spatial.pool(ranks), locate=locate
    )
    print(report)
    first = report.mismatches[0]
    assert (first.quantity, first.name, first.step) == ("field", "y", 0), str(report)
    # the loss and every gradient are sums over the positions, which order does not change
    assert report.quantities == {"field"}, str(report)
    assert ("First divergence:" in str(report)) is locate, str(report)


def test_uneven_shardtensor_weight_shards_are_equivalent(spatial):
    ranks = spatial.ranks
    report = check_equivalence(ShardedWeights(), ranks=ranks, pool=spatial.pool(ranks))
    assert report.ok, str(report)
    # float64: reordered sums only, ~1e-16 relative
    assert max(report.stats[q].max_rel for q in ("loss", "grad", "field", "param")) < 1e-12


@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_a_weight_shard_at_the_wrong_offset_is_a_param_report_with_its_placements(spatial, locate):
    ranks = spatial.ranks
    report = check_equivalence(
        ShardedWeights("misplaced"), ranks=ranks, pool=spatial.pool(ranks), locate=locate
    )
    print(report)
    init = [m for m in report.mismatches if m.step is None]
    assert {(m.quantity, m.name) for m in init} == {
        ("param", "linear.weight"),
        ("param", "linear.bias"),
    }, str(report)
    assert "ShardTensor (Replicate(), Shard(dim=0)) on a 1x" in init[0].where, init[0].where
    assert not report.quantities & {"error", "crash"}, str(report)
    assert ("First divergence:" in str(report)) is locate, str(report)


def read_both(split: list[int]) -> list[Any]:
    """On a rank: the same block as a real ``ShardTensor`` and as the CI's ``ShardLike``
    (tests/distributed/test_dtensor.py), read by the harness; what each gives."""
    import torch.distributed as dist
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    from harness._base.values import describe, placed
    from tests.distributed.test_dtensor import ShardLike

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=torch.arange(world))
    start = sum(split[:rank])
    whole = torch.arange(sum(split) * OUT, dtype=torch.float64).reshape(-1, OUT)
    local = whole[start : start + split[rank]]
    shapes = {0: [(n, OUT) for n in split]}
    seen = []
    for value in (
        ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes=shapes),
        ShardLike(local, mesh, [Shard(0)], shapes),
    ):
        at = placed(value)
        seen.append(
            (
                tuple(value.shape),
                value._spec.offsets(),
                (at.dim, at.start, at.size, at.gathered),
                at.values.tolist(),
                describe(value).split(" ", 1)[1],  # the placements and mesh, not the type
                torch.equal(value.full_tensor(), whole),
            )
        )
    return seen


def test_the_ci_shardtensor_mimic_is_read_as_the_real_shardtensor(spatial):
    """The ShardLike CI tests with (no physicsnemo there) reads, through harness._base.values,
    exactly as the real ShardTensor does: global shape, offsets, block, values, placements."""
    ranks = spatial.ranks
    split = sizes(ranks)
    for rank, (real, like) in enumerate(spatial.run(read_both, split)):
        assert real == like, rank
        start = sum(split[:rank])
        assert real[:3] == ((N, OUT), (start,), (0, start, split[rank], False)), rank
        assert real[5], rank  # full_tensor() gives the whole, on the real one and the mimic
