"""ECMWF anemoi-models' sharded encoder-processor-decoder as a ``SpatialCase``.

``AnemoiCase`` builds anemoi-models' own ``AnemoiModelEncProcDec`` on a small hand-built
graph (``harness.contrib._anemoi_graph``) and runs it twice: once as anemoi's single-process
path (``model_comm_group=None``) and once on the harness's ranks with the spatial group as
anemoi's ``model_comm_group``, so every collective under test (``shard_tensor``,
``sync_tensor``, ``gather_tensor``, the edge sharding, the transformer's head all-to-all) is
anemoi's own code. Training is done the way anemoi-training 0.x does it around the model:

- the gradient rule of its ``DDPGroupStrategy``: every parameter gradient is multiplied by
  the model-group size (``register_gradient_scaling_hooks``; names containing ``trainable``
  or ``no_gradscaling`` are skipped), then torch's ``DistributedDataParallel`` averages it
  over the whole world;
- the loss: a node-weighted MSE (weights cos(lat) of the data nodes, like anemoi-training's
  area-weighted MSE). With the output gathered (``shard_input=False``) every rank computes it
  on the whole grid; with the batch kept sharded (``shard_input=True``, anemoi-training's
  ``keep_batch_sharded``) each rank sums its grid shard and the sum goes through anemoi's
  ``reduce_tensor`` (all-reduce forward, identity backward), as anemoi-training's loss does
  with its ``group`` argument.

Install with ``pip install "pytest-spatial-harness[anemoi]"`` (anemoi-models 0.13.0 and its
torch-geometric). Nothing here imports anemoi until a case is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from harness.adopt import check_group, patch, pending, undo
from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.errors import ConfigError
from harness.topology import Topology

__all__ = ["ANEMOI_FAULTS", "AnemoiCase", "fault_matrix", "main_configs", "require_anemoi"]

#: fault id -> what is patched into anemoi's own sharded path (inside the rank only)
ANEMOI_FAULTS: dict[str, str] = {
    "sync-identity-backward": "sync_tensor's backward splits the gradient without the "
    "all-reduce over the model group",
    "gather-order": "anemoi's _gather concatenates the ranks' shards in reverse rank order",
    "no-grad-scaling": "anemoi-training's gradient scaling by the model-group size is left out",
    "scale-trainable": "the gradient scaling also multiplies the replicated trainable tensors",
}

_INSTALL = 'pip install "pytest-spatial-harness[anemoi]"'

#: What ``harness-check --model anemoi`` has its fork server import once (as tox and CI pass
#: ``--spatial-preload``): anemoi-models and torch-geometric take seconds to import.
PRELOAD = ("anemoi.models", "torch_geometric")
_SKIP_SCALING = ("trainable", "no_gradscaling")  # anemoi-training's default skip list
_NVARS = 3  # model input channels (prognostic a, b; forcing f); outputs a, b, diagnostic d


def require_anemoi() -> Any:
    """Import and return ``anemoi.models``, or raise a ``ConfigError`` naming the fix."""
    try:
        import anemoi.models
        import torch_geometric  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"harness.contrib.anemoi needs anemoi-models and torch-geometric ({exc}); "
            f"install them with: {_INSTALL}"
        ) from exc
    return anemoi.models


# ---------------------------------------------------------------------- faults (patches)


def _apply_faults(faults: frozenset[str]) -> None:
    from anemoi.models.distributed import graph, primitives

    if "sync-identity-backward" in faults:

        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
            if ctx.comm_group and ctx.gather_in_fwd:
                split = primitives._split(grad_output, ctx.dim, ctx.shapes, group=ctx.comm_group)
                return split, None, None, None, None
            return grad_output, None, None, None, None

        patch(graph._SyncParallelSection, "backward", staticmethod(backward))
    if "gather-order" in faults:
        original = graph._gather

        def gather(input_: torch.Tensor, dim_: int, shapes_: Any, group: Any = None) -> Any:
            out = original(input_, dim_, shapes_, group=group)
            sizes = [s[dim_] for s in shapes_]
            return torch.cat(list(reversed(out.split(sizes, dim=dim_))), dim=dim_)

        patch(graph, "_gather", gather)


# ---------------------------------------------------------------------- the case


class AnemoiCase(SpatialCase):
    """anemoi-models' ``AnemoiModelEncProcDec``: its sharded path vs its single-process path.

    ``n_grid`` / ``n_hidden``: data (grid) and hidden nodes of the graph; ``kind``: ``gnn``,
    ``transformer`` or ``graphtransformer`` (encoder, processor and decoder of that kind);
    ``shard_input``: keep the batch sharded over the grid (anemoi-training's
    ``keep_batch_sharded``) instead of giving every rank the whole grid; ``grid_shards``: the
    grid points of each model-group rank when ``shard_input`` (default: anemoi's balanced
    split; uneven and empty shards allowed); ``batch_size``: the global batch (anemoi takes
    one sample per model group when sharded, so use the number of data groups);
    ``dropout``, ``trainable_size``, ``num_chunks``, ``shard_strategy`` (graph transformer:
    ``edges`` or ``heads``), ``num_heads``, ``num_channels``, ``num_layers``: model options;
    ``faults``: ids of ``ANEMOI_FAULTS`` patched into anemoi's sharded path on the ranks.
    """

    def __init__(
        self,
        *,
        n_grid: int = 40,
        n_hidden: int = 10,
        kind: str = "gnn",
        shard_input: bool = False,
        grid_shards: tuple[int, ...] | None = None,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float64,
        dropout: float = 0.0,
        trainable_size: int = 0,
        num_chunks: int = 1,
        shard_strategy: str = "edges",
        num_heads: int = 4,
        num_channels: int = 8,
        num_layers: int = 1,
        knn: int = 3,
        faults: Any = (),
    ) -> None:
        from harness.contrib._anemoi_graph import KINDS

        if kind not in KINDS:
            raise ConfigError(f"unknown anemoi processor kind {kind!r}; valid: {sorted(KINDS)}")
        ids = frozenset((faults,) if isinstance(faults, str) else faults)
        unknown = ids - set(ANEMOI_FAULTS)
        if unknown:
            raise ConfigError(
                f"unknown anemoi fault(s) {sorted(unknown)}; valid ids: {', '.join(ANEMOI_FAULTS)}"
            )
        if grid_shards is not None and sum(grid_shards) != n_grid:
            raise ConfigError(f"grid_shards {grid_shards} must add up to n_grid={n_grid}")
        self.n_grid, self.n_hidden, self.kind = n_grid, n_hidden, kind
        self.shard_input, self.grid_shards, self.batch_size = shard_input, grid_shards, batch_size
        self.dtype = dtype
        self.options: dict[str, Any] = {
            "dropout": dropout,
            "trainable_size": trainable_size,
            "num_chunks": num_chunks,
            "shard_strategy": shard_strategy,
            "num_heads": num_heads,
            "num_channels": num_channels,
            "num_layers": num_layers,
        }
        self.knn, self.faults = knn, ids
        self.name = f"anemoi-{kind}"

    # -------------------------------------------------------------- layout helpers

    def _shards(self, topo: Topology) -> list[int]:
        """Grid points of each model-group rank (the reference: one shard, all of them)."""
        if topo.spatial_size == 1:
            return [self.n_grid]
        if self.shard_input and self.grid_shards is not None:
            if len(self.grid_shards) != topo.spatial_size:
                raise ConfigError(
                    f"grid_shards {self.grid_shards} has {len(self.grid_shards)} entries for a "
                    f"model group of {topo.spatial_size} ranks"
                )
            return list(self.grid_shards)
        from anemoi.models.distributed.balanced_partition import get_balanced_partition_sizes

        return list(get_balanced_partition_sizes(self.n_grid, topo.spatial_size))

    def _mine(self, topo: Topology) -> slice:
        """This rank's grid points ``[start, stop)`` (anemoi's shard of the grid)."""
        sizes = self._shards(topo)
        start = sum(sizes[: topo.spatial_rank])
        return slice(start, start + sizes[topo.spatial_rank])

    def describe(self, topo: Topology | None = None) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items() if v)
        mode = "batch kept sharded" if self.shard_input else "whole grid in, output gathered"
        shards = "" if topo is None else f", grid shards {self._shards(topo)}"
        return f"{self.n_grid} grid / {self.n_hidden} hidden nodes, {mode}{shards}; {opts}"

    # -------------------------------------------------------------- contract

    def build(self, topo: Topology) -> torch.nn.Module:
        require_anemoi()
        from anemoi.models.data_indices.collection import IndexCollection
        from anemoi.models.models.encoder_processor_decoder import AnemoiModelEncProcDec
        from omegaconf import OmegaConf

        from harness.contrib._anemoi_graph import build_graph, model_config

        self._adopted_from = pending()  # teardown undoes this build's patches, no older
        if not topo.is_reference:
            # the harness's spatial group is anemoi's model_comm_group (see forward): it must
            # be the model group anemoi-training would give this rank
            check_group(
                topo.spatial_group,
                topo,
                "anemoi's model_comm_group",
                of=model_comm_group_ranks(topo.rank, topo.world_size, topo.spatial_size),
            )
        if not topo.is_reference and self.faults:
            _apply_faults(self.faults)
        data_config = OmegaConf.create({"forcing": ["f"], "diagnostic": ["d"]})
        indices = {"data": IndexCollection(data_config, {"a": 0, "b": 1, "f": 2, "d": 3})}
        model = AnemoiModelEncProcDec(
            model_config=OmegaConf.create(model_config(self.kind, **self.options)),
            data_indices=indices,
            statistics={"data": None},
            graph_data=build_graph(self.n_grid, self.n_hidden, self.knn),
        )
        if topo.is_reference:
            return cast(torch.nn.Module, model)
        if "no-grad-scaling" not in self.faults:
            skip = () if "scale-trainable" in self.faults else _SKIP_SCALING
            _register_gradient_scaling_hooks(model, topo.spatial_size, skip)
        # anemoi-training's DDPGroupStrategy is torch DDP over the whole world
        return torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)

    def batch(self, topo: Topology, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, 1, 1, self.n_grid, _NVARS)
        target = torch.randn(self.batch_size, 1, 1, self.n_grid, _NVARS)
        samples = data_share(self.batch_size, topo)
        grid = self._mine(topo) if self.shard_input else slice(None)
        return x[samples, :, :, grid], target[samples, :, :, grid]

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        from anemoi.models.distributed.graph import reduce_tensor

        x, target = batch
        group = None if topo.is_reference else topo.spatial_group
        mine = self._mine(topo)
        sharded = self.shard_input and group is not None
        shapes = {"data": self._shards(topo)} if sharded else None
        y = model({"data": x}, model_comm_group=group, grid_shard_shapes=shapes)["data"]
        core = _core(model)
        weights = _node_weights(core)
        w = weights[mine] if sharded else weights
        local = ((y - target) ** 2 * w[:, None]).sum()
        total = reduce_tensor(local, group) if sharded else local
        loss = total / (x.shape[0] * weights.sum() * y.shape[-1])
        out = y if sharded else y[:, :, :, mine]
        index = torch.arange(self.n_grid)[mine]
        return Outputs(loss, {"forecast": Shard(out, index, dim=3, unit="grid point")})

    def teardown(self, model: torch.nn.Module | None, topo: Topology) -> None:
        undo(getattr(self, "_adopted_from", 0))


def model_comm_group_ranks(rank: int, world_size: int, num_gpus_per_model: int) -> list[int]:
    """The global ranks of ``rank``'s model group as anemoi-training's ``DDPGroupStrategy``
    lays them out: the world split into ``world_size // num_gpus_per_model`` consecutive
    blocks (``np.split(np.arange(world_size), ...)``).

    >>> model_comm_group_ranks(5, 8, 4)
    [4, 5, 6, 7]
    """
    first = rank // num_gpus_per_model * num_gpus_per_model
    return list(range(first, first + num_gpus_per_model))


def _core(model: torch.nn.Module) -> Any:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _node_weights(model: Any) -> torch.Tensor:
    """cos(latitude) of the data nodes (anemoi-training's area weights, roughly)."""
    return cast(torch.Tensor, model._graph_data["data"].x[:, 0].cos())


def _register_gradient_scaling_hooks(
    model: torch.nn.Module, size: int, skip: tuple[str, ...]
) -> None:
    """anemoi-training's ``register_gradient_scaling_hooks`` (anemoi-training is not
    installable beside torch 2.13, so its ten lines are restated here): multiply every
    gradient by the model-group size except parameters whose name contains a ``skip``
    pattern (the trainable tensors, replicated before the split)."""
    for name, param in model.named_parameters():
        if param.requires_grad and not any(s in name for s in skip):
            param.register_hook(lambda grad: grad * float(size))


# ---------------------------------------------------------------------- the main job


def _case(**kw: Any) -> SpatialCase:
    return AnemoiCase(**kw)


Config = tuple[str, Callable[..., SpatialCase], dict[str, Any], "int | None"]
Fault = tuple[str, Callable[..., SpatialCase], dict[str, Any], "int | None", str, set[str]]


def main_configs(ranks: int) -> list[Config]:
    """(label, case factory, kwargs, spatial_size) for each anemoi layout of the main job.

    Float64 layouts use ``shard_strategy="heads"``, whose path has no all-reduce; the
    ``edges`` strategy and the sharded-batch loss go through anemoi's ``_reduce``, which
    all-reduces in float32 (FINDINGS: anemoi-fp32-reduce), so they run in float32. The GNN
    kind is left out: its backward fails on any model group of more than one rank
    (FINDINGS: anemoi-gnn-shard-backward).
    """
    heads: dict[str, Any] = {"shard_strategy": "heads"}
    f32: dict[str, Any] = {"dtype": torch.float32}
    out: list[Config] = [
        ("anemoi transformer", _case, {"kind": "transformer", **heads}, None),
        ("anemoi graphtransformer", _case, {"kind": "graphtransformer", **heads}, None),
        ("anemoi graphtransformer edges f32", _case, {"kind": "graphtransformer", **f32}, None),
        (
            "anemoi sharded batch uneven f32",
            _case,
            {"kind": "transformer", "shard_input": True, "n_grid": 41, "n_hidden": 11, **f32},
            None,
        ),
        (
            "anemoi trainable",
            _case,
            {"kind": "graphtransformer", "trainable_size": 2, **heads},
            None,
        ),
    ]
    if ranks >= 4 and ranks % 2 == 0:
        kw = {"kind": "graphtransformer", "batch_size": 2, **heads}
        out.append(("anemoi s×d", _case, kw, ranks // 2))
    return out


def fault_matrix(ranks: int) -> Iterator[Fault]:
    """(stepper, factory, kwargs, spatial_size, fault id, expected quantities) per fault.

    Each fault is patched into anemoi's own sharded path on the ranks (``ANEMOI_FAULTS``);
    the same layout without it is in ``main_configs``.
    """
    if ranks < 2:
        return
    gt: dict[str, Any] = {"kind": "graphtransformer", "shard_strategy": "heads"}
    edges: dict[str, Any] = {"kind": "graphtransformer", "dtype": torch.float32}
    yield "anemoi", _case, edges, None, "sync-identity-backward", {"grad"}
    yield "anemoi", _case, gt, None, "gather-order", {"field", "loss", "grad"}
    yield "anemoi", _case, gt, None, "no-grad-scaling", {"grad"}
    yield "anemoi", _case, {**gt, "trainable_size": 2}, None, "scale-trainable", {"grad"}
