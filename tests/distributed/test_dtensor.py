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
from torch.utils._pytree import tree_map

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
    ``layout="two-dims"``: as ``"replicate"``, the weight sharded along both its dims (no
    rank holds a block of one dim: it is recorded gathered), redistributed whole to use.
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
        weight = {
            "replicate": [Replicate(), Replicate()],
            "shard": [Replicate(), Shard(0)],
            "two-dims": [Shard(1), Shard(0)],  # its rows and its columns (a 1 x 2 mesh)
        }[self.layout]
        bias = [Replicate(), Shard(0) if self.layout == "shard" else Replicate()]

        def partition(name: str, module: torch.nn.Module, mesh: Any) -> None:
            for key, p in list(module.named_parameters(recurse=False)):
                value = distribute_tensor(p.detach(), mesh, weight if key == "weight" else bias)
                module.register_parameter(key, torch.nn.Parameter(value))

        return distribute_module(model, mesh, partition)

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        x = torch.randn(N, IN)
        return x[_rows(topo)] if self.layout != "shard" else x

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        from torch.distributed.tensor import DTensor, Partial, Replicate
        from torch.distributed.tensor import Shard as DShard

        w, b = model.weight, model.bias
        if isinstance(w, DTensor):
            grads = None if self.fault == "no-grad-sync" else [Replicate(), Partial()]
            if self.layout == "shard":
                grads = None  # a shard's gradient is its own: nothing to add up
            if self.layout == "two-dims":  # the whole weight, its gradient summed back
                w = w.redistribute(w.device_mesh, [Replicate(), Replicate()])
            w, b = w.to_local(grad_placements=grads), b.to_local(grad_placements=grads)
        y = F.linear(batch, w, b)
        loss = reduce_loss(y.pow(2).sum(), topo) / (N * OUT)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        if self.layout != "shard":
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
        return Positions(N, range(rows.start, rows.stop)) if self.layout != "shard" else None


@pytest.mark.parametrize("layout", ["replicate", "shard", "two-dims"])
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


class ShardLikeSpec:
    """physicsnemo's ``ShardTensorSpec``, the part a reader of placements sees: ``mesh``,
    ``placements``, ``_sharding_shapes`` (every shard's shape, per sharded mesh dim, so
    shards may be uneven and not ``torch.chunk``'s) and ``offsets(mesh_dim)``, computed as
    physicsnemo 2.2 computes it (the shapes of the shards before this rank's, summed)."""

    def __init__(self, mesh: Any, placements: Any, sharding_shapes: dict[int, Any]) -> None:
        self.mesh, self.placements = mesh, tuple(placements)
        self._sharding_shapes = {m: tuple(map(tuple, s)) for m, s in sharding_shapes.items()}

    def offsets(self, mesh_dim: int | None = None) -> Any:
        found = [0] * len(self.placements)
        for m, placement in enumerate(self.placements):
            if placement.is_shard():
                before = self._sharding_shapes[m][: self.mesh.get_coordinate()[m]]
                found[m] = sum(s[placement.dim] for s in before)
        return found[mesh_dim] if mesh_dim is not None else tuple(found)


class ShardLike(torch.Tensor):
    """physicsnemo's ``ShardTensor`` in miniature, its interface as physicsnemo 2.2 has it
    (``tests/contrib/physicsnemo`` checks the real one): a wrapper whose ``.shape`` is the
    global shape, no DTensor subclass, with ``device_mesh``, ``placements``, ``_spec``
    (``ShardLikeSpec``), ``to_local()`` (this rank's block, of any size) and
    ``full_tensor()``. Operations on it compute on the local block and give plain tensors
    (the real one gives ShardTensors; the harness reads values, not operations)."""

    _local_tensor: torch.Tensor
    _spec: ShardLikeSpec

    @staticmethod
    def __new__(
        cls, local: torch.Tensor, mesh: Any, placements: Any, shapes: Any = None
    ) -> ShardLike:
        shapes = dict(shapes or {})
        size = list(local.shape)
        for m, placement in enumerate(placements):
            if placement.is_shard():
                size[placement.dim] = sum(s[placement.dim] for s in shapes[m])
        out = torch.Tensor._make_wrapper_subclass(
            cls, size, dtype=local.dtype, device=local.device, requires_grad=local.requires_grad
        )
        out._local_tensor, out._spec = local, ShardLikeSpec(mesh, placements, shapes)
        return out

    @property
    def device_mesh(self) -> Any:
        return self._spec.mesh

    @property
    def placements(self) -> Any:
        return self._spec.placements

    def to_local(self) -> torch.Tensor:
        return self._local_tensor

    def full_tensor(self) -> torch.Tensor:
        local = self._local_tensor.detach()
        for m, placement in enumerate(self.placements):
            if not placement.is_shard():
                continue
            dim, shapes = placement.dim, self._spec._sharding_shapes[m]
            widest = max(s[dim] for s in shapes)  # gloo gathers equal sizes: pad, then trim
            pad = list(local.shape)
            pad[dim] = widest - local.shape[dim]
            padded = torch.cat([local, local.new_zeros(pad)], dim).contiguous()
            parts = [torch.empty_like(padded) for _ in shapes]
            dist.all_gather(parts, padded, group=self.device_mesh.get_group(m))
            local = torch.cat([p.narrow(dim, 0, s[dim]) for p, s in zip(parts, shapes)], dim)
        return local

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t._local_tensor if isinstance(t, ShardLike) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func is torch.ops.aten.detach.default:  # what nn.Parameter and .detach() make
            return ShardLike(
                out, args[0].device_mesh, args[0].placements, args[0]._spec._sharding_shapes
            )
        return out


SPLIT = (6, 2)  # the ShardLike field's rows per rank: uneven, not torch.chunk's 4 + 4


class ShardLikeLinear(DTensorLinear):
    """The replicated layout on rows split ``SPLIT``, with ``ShardLike`` parameters
    (``[Replicate(), Replicate()]``) and its field a ``ShardLike`` ``[Replicate(),
    Shard(0)]`` with every shard's shape; gradients summed by ``sync_gradients``
    (``fault="no-grad-sync"``: not summed; ``fault="misplaced"``: each rank computes the
    other's rows and declares them where the spec puts its own)."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__("replicate", fault)
        self.name = "shardlike" + (f"-{fault}" if fault else "")

    def rows(self, topo: Topology) -> slice:
        rank = topo.spatial_rank
        if self.fault == "misplaced":
            rank = RANKS - 1 - rank
        return slice(sum(SPLIT[:rank]), sum(SPLIT[: rank + 1]))

    def build(self, topo: Topology) -> torch.nn.Module:
        from torch.distributed.tensor import Replicate

        model = torch.nn.Linear(IN, OUT)
        mesh = device_mesh(topo)
        if mesh is None:
            return model
        for key, p in list(model.named_parameters()):
            like = ShardLike(p.detach().clone(), mesh, [Replicate(), Replicate()])
            model.register_parameter(key, torch.nn.Parameter(like))
        if self.fault != "no-grad-sync":
            sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        x = torch.randn(N, IN)
        return x if topo.spatial_group is None else x[self.rows(topo)]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor import Shard as DShard

        y = F.linear(batch, model.weight, model.bias)
        loss = reduce_loss(y.pow(2).sum(), topo) / (N * OUT)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        split = SPLIT[::-1] if self.fault == "misplaced" else SPLIT  # the shapes as held
        shapes = {1: [(n, OUT) for n in split]}
        mesh = model.weight.device_mesh
        return Outputs(loss, {"y": ShardLike(y.detach(), mesh, [Replicate(), DShard(0)], shapes)})

    def partition(self, topo: Topology) -> Any:
        split = SPLIT[::-1] if self.fault == "misplaced" else SPLIT
        start = sum(split[: topo.spatial_rank])  # where the spec places the rank's rows
        return Positions(N, range(start, start + split[topo.spatial_rank]))


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


@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_a_shardtensor_like_block_at_the_wrong_offset_is_a_field_report(spatial, locate):
    report = check_equivalence(
        ShardLikeLinear("misplaced"), ranks=RANKS, pool=spatial.pool(RANKS), locate=locate
    )
    first = report.mismatches[0]
    assert (first.quantity, first.name, first.step) == ("field", "y", 0), str(report)
    # loss and gradients are sums over the rows, which their order does not change
    assert report.quantities == {"field"}, str(report)


# ---------------------------------------------------------------------- complex values, zeros


class ComplexField(SpatialCase):
    """A complex field whose imaginary part and every other row are exact zeros (spectral
    coefficients that vanish), rows split over the spatial group (``fault="doubled"``: rank
    1 returns its rows doubled)."""

    name = "complex-zeros"
    dtype = torch.float64

    def __init__(self, fault: str | None = None) -> None:
        self.fault = fault

    def build(self, topo: Topology) -> torch.nn.Module:
        model = torch.nn.Linear(IN, OUT)
        sync_gradients(model, topo)
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        x = torch.randn(N, IN)
        x[::2] = 0.0  # every other row: an exact zero all the way to the field
        return x[_rows(topo)]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        y = model(batch) * (batch[:, :1] != 0)
        z = torch.complex(y, torch.zeros_like(y))
        if self.fault == "doubled" and topo.spatial_rank == 1:
            z = 2 * z
        loss = reduce_loss(z.abs().pow(2).sum(), topo) / (N * OUT)
        if topo.spatial_group is None:
            return Outputs(loss, {"z": z})
        rows = _rows(topo)
        return Outputs(loss, {"z": Shard(z, torch.arange(rows.start, rows.stop), dim=0)})

    def partition(self, topo: Topology) -> Any:
        rows = _rows(topo)
        return Positions(N, range(rows.start, rows.stop))


def test_a_complex_field_with_exact_zeros_is_equivalent_and_its_bug_a_field_report(spatial):
    pool = spatial.pool(RANKS)
    assert check_equivalence(ComplexField(), ranks=RANKS, pool=pool).ok
    report = check_equivalence(ComplexField("doubled"), ranks=RANKS, pool=pool, locate=True)
    m = next(m for m in report.mismatches if m.quantity == "field")
    assert m.name == "z" and "on rank 1" in m.where, str(report)
    assert "z" in str(report)  # the whole report renders, complex zeros and all


# ---------------------------------------------------------------------- the reference raises


class BrokenReference(DTensorLinear):
    """The reference's forward raises at step 1; the ranks would run fine."""

    calls = 0

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        if topo.is_reference:
            self.calls += 1
            if self.calls == 2:
                raise ValueError("the reference's own bug")
        return super().forward(model, batch, topo)


def test_a_reference_that_raises_is_an_error_of_the_reference_with_its_traceback(spatial):
    report = check_equivalence(BrokenReference(), ranks=RANKS, pool=spatial.pool(RANKS))
    (m,) = report.mismatches
    assert (m.quantity, m.run, m.rank, m.step, m.phase) == (
        "error",
        "reference",
        None,
        1,
        "step 1 forward",
    )
    assert m.where == "ValueError: the reference's own bug"
    assert "Traceback" in m.detail and "BrokenReference" not in m.where
    assert "in forward" in m.detail
    assert str(report).splitlines()[1] == (
        "First: the reference: error 'dtensor-replicate' in step 1 forward: "
        "ValueError: the reference's own bug"
    )


# ---------------------------------------------------------------------- locating that raises


def test_a_locating_that_raises_leaves_the_verdict_and_says_so(spatial, monkeypatch):
    import harness.equivalence._locating

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("aten.sub.Tensor got mixed torch.Tensor and DTensor")

    monkeypatch.setattr(harness.equivalence._locating, "locate", broken)
    case = DTensorLinear("replicate", fault="no-grad-sync")
    report = check_equivalence(case, ranks=RANKS, pool=spatial.pool(RANKS), locate=True)
    assert report.mismatches[0].quantity == "grad"
    assert report.location is None and report.first_divergence is None
    line = (
        "Not located: the first divergence at step 0 (RuntimeError: aten.sub.Tensor got mixed "
        "torch.Tensor and DTensor)"
    )
    assert report.diagnoses == [line]
    assert str(report).splitlines()[2] == line  # under the first mismatch, where locating's go


# ---------------------------------------------------------------------- declarations


class JunkPartition(DTensorLinear):
    def __init__(self, junk: Any) -> None:
        super().__init__("replicate")
        self.junk = junk

    def partition(self, topo: Topology) -> Any:
        return self.junk


class JunkActivation(ComplexField):
    """Its modules are called (``model(batch)``), so locating would ask about them."""

    def activation_shard(self, name: str, tensor: torch.Tensor, topo: Topology) -> Any:
        return 7


@pytest.mark.parametrize(
    ("case", "says"),
    [
        (
            JunkPartition("junk"),
            "ConfigError: dtensor-replicate.partition on rank {r} returned 'junk' (a str); "
            "return a LatLonPartition, a CellPartition, harness.Positions, a list of them, "
            "or None",
        ),
        (
            JunkPartition(42),
            "ConfigError: dtensor-replicate.partition on rank {r} returned 42 (a int); "
            "return a LatLonPartition, a CellPartition, harness.Positions, a list of them, "
            "or None",
        ),
        (
            JunkActivation(),
            "ConfigError: complex-zeros.activation_shard('', ...) on rank {r} returned 7 "
            '(a int); return a Shard, "whole", "skip" or None (infer it from partition)',
        ),
    ],
    ids=["str", "int", "activation-int"],
)
@pytest.mark.parametrize("locate", [True, False], ids=["located", "not-located"])
def test_a_declaration_locating_cannot_read_fails_the_check_as_one_config_error(
    spatial, case, says, locate
):
    report = check_equivalence(case, ranks=RANKS, pool=spatial.pool(RANKS), locate=locate)
    errors = sorted((m for m in report.mismatches if m.quantity == "error"), key=lambda m: m.rank)
    assert [m.rank for m in errors] == [0, 1] and report.quantities == {"error"}, str(report)
    assert [m.where for m in errors] == [says.format(r=r) for r in (0, 1)]


# ---------------------------------------------------------------------- sharded as built


class DrawnAtShardShape(SpatialCase):
    """A per-position ``scale`` sharded with the positions, drawn at the shard's shape on
    the ranks (as makani draws its spectral weights at h = 2), then a replicated ``lin``.

    The ranks consume fewer random numbers than the reference before ``lin`` is drawn, so
    ``lin`` differs from the reference's too: no seed makes them equal. ``declared``: the
    shard is named in ``parameter_shards``; ``dtensor``: it is a DTensor ``Shard(0)`` of the
    spatial mesh, which says where it sits itself.
    """

    dtype = torch.float64

    def __init__(self, kind: str, **flags: bool) -> None:
        self.kind = kind
        self.name = f"drawn-at-shard-shape-{kind}"
        for key, value in flags.items():
            setattr(self, key, value)

    def build(self, topo: Topology) -> torch.nn.Module:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Shard as DShard

        model = torch.nn.Module()
        rows = _rows(topo)
        scale = torch.randn(rows.stop - rows.start)  # the shard's shape: fewer draws
        mesh = device_mesh(topo)
        if self.kind == "dtensor" and mesh is not None:
            scale = DTensor.from_local(scale, mesh["spatial"], [DShard(0)])
        model.scale = torch.nn.Parameter(scale)
        model.lin = torch.nn.Linear(IN, OUT)
        sync_gradients(model.lin, topo)
        return model

    def batch(self, topo: Topology, step: int) -> torch.Tensor:
        return torch.randn(N, IN)[_rows(topo)]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        scale = model.scale
        if hasattr(scale, "to_local"):
            scale = scale.to_local()
        y = model.lin(batch) * scale[:, None]
        loss = reduce_loss(y.pow(2).sum(), topo) / (N * OUT)
        rows = _rows(topo)
        if topo.spatial_group is None:
            return Outputs(loss, {"y": y})
        return Outputs(loss, {"y": Shard(y, torch.arange(rows.start, rows.stop), dim=0)})

    def parameter_shards(self, model: torch.nn.Module, topo: Topology) -> dict[str, Shard]:
        if self.kind != "declared":
            return {}
        rows = _rows(topo)
        return {"scale": Shard(model.scale, torch.arange(rows.start, rows.stop), dim=0)}


@pytest.mark.parametrize("kind", ["declared", "dtensor"])
def test_a_shard_drawn_at_its_own_shape_passes_once_the_reference_init_is_loaded(spatial, kind):
    pool = spatial.pool(RANKS)
    # as built: the replicated lin differs on every rank, and rank 1's shard of scale
    report = check_equivalence(DrawnAtShardShape(kind), ranks=RANKS, pool=pool, locate=False)
    init = sorted((m.name, m.rank) for m in report.mismatches if m.step is None)
    assert init == [
        ("lin.bias", 0),
        ("lin.bias", 1),
        ("lin.weight", 0),
        ("lin.weight", 1),
        ("scale", 1),
    ], str(report)
    # loading the shards alone leaves lin drawn after them wrong (makani at h = 2)
    if kind == "declared":
        shards_only = DrawnAtShardShape(kind, load_reference_shards=True)
        report = check_equivalence(shards_only, ranks=RANKS, pool=pool, locate=False)
        init = sorted({m.name for m in report.mismatches if m.step is None})
        assert init == ["lin.bias", "lin.weight"], str(report)
    loaded = DrawnAtShardShape(kind, load_reference_init=True)
    report = check_equivalence(loaded, ranks=RANKS, pool=pool)
    assert report.ok, str(report)
    assert report.notes == [
        "reference initial values loaded: the reference's initial values were copied into "
        "every parameter (3, 1 of them sharded: lin.bias, lin.weight, scale) before the "
        "first step (load_reference_init), so initial values are not checked"
    ]
    assert f"\nNote: {report.notes[0]}" in str(report)
