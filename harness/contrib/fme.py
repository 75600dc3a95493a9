"""ACE / ``fme``'s spatially parallel SFNO as a ``SpatialCase``.

``FmeCase`` builds fme's own conditional SFNO (``get_lat_lon_sfnonet``, on fme's
``Distributed`` singleton and torch-harmonics' distributed SHT) and trains it one step at a
time the way fme does around the model:

- fme's ``Distributed.wrap_module``: DDP over the data group (``broadcast_buffers=False``)
  plus fme's gradient hooks that all-reduce every parameter gradient over the spatial group;
- fme's loss, ``AreaWeightedMSELoss`` on ``LatLonOperations.area_weighted_mean``, whose
  weighted sums cross the spatial group through fme's ``spatial_reduce_sum`` (all-reduce
  forward, identity backward);
- data sliced to the rank's block by fme's ``get_local_slices`` (``scatter_spatial``).

The reference is the same code with fme's ``NonDistributed`` backend. On the ranks fme's
``ModelTorchDistributed`` runs inside the harness's process group: fme's vendored
``DistributedManager`` wants to create the default group itself (and its ``atexit`` handler
and ``Distributed.context()`` destroy it), so the case *adopts* the harness's group by filling
the manager's shared state before fme looks, and puts everything back in ``teardown``: the
manager's state, fme's ``Distributed`` singleton, fme's ``patch_gloo_alltoall`` of
``torch.distributed.all_to_all`` and torch-harmonics' groups (0.8.0's ``is_initialized`` is
always False, so fme calls ``thd.init`` on every build). Gloo's ``all_to_all`` is fme's own
patch, not the harness's: the harness's transposes are undone first.

Install with ``pip install "pytest-spatial-harness[fme]"`` beside fme (which pins
torch-harmonics 0.8.0). Nothing here imports fme until a case is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.collectives import apply
from harness.equivalence import Outputs, Shard, SpatialCase, data_share
from harness.errors import ConfigError
from harness.topology import Topology

__all__ = ["FME_FAULTS", "FmeCase", "FmeConfig", "fault_matrix", "main_configs", "require"]

_INSTALL = 'pip install "pytest-spatial-harness[fme]"'

#: The modules a rank pool should import once, in its fork server (``--spatial-preload``):
#: importing fme and torch-harmonics takes seconds.
PRELOAD = ("fme", "torch_harmonics", "torch_harmonics.distributed")

#: fault id -> what is patched into fme's own distributed path (inside the rank only)
FME_FAULTS: dict[str, str] = {
    "no-spatial-grad-hooks": "wrap_module leaves out fme's spatial gradient all-reduce hooks",
    "reduce-sum-no-allreduce": "spatial_reduce_sum returns the local sum (no all-reduce)",
    "slices-swapped": "get_local_slices hands each rank the block of its mirror rank",
}


def require() -> Any:
    """Import and return ``fme``, or raise a ``ConfigError`` naming the fix."""
    try:
        import fme
        from fme.core.distributed import distributed  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"harness.contrib.fme needs the fme package (ACE) ({exc}); install it with: {_INSTALL}"
        ) from exc
    return fme


@dataclass(frozen=True)
class FmeConfig:
    """A small fme SFNO and its partition.

    ``h`` x ``w`` is fme's spatial process grid (latitudes x longitudes, split by
    torch-harmonics' rule, uneven where the sizes do not divide); ranks beyond ``h * w``
    become fme's data-parallel groups. The SFNO options are fme's ``SFNONetConfig``'s.
    """

    nlat: int = 8
    nlon: int = 16
    h: int = 2
    w: int = 2
    channels: int = 2
    batch_size: int = 2
    grid: str = "legendre-gauss"  # fme's data_grid: "legendre-gauss" or "equiangular"
    embed_dim: int = 8
    num_layers: int = 2
    pos_embed: bool = True
    big_skip: bool = True
    global_layer_norm: bool = False
    affine_norms: bool = False
    normalize_big_skip: bool = False
    filter_type: str = "linear"
    clip_latent_global_means: bool = False
    #: also run the model in eval mode each step and compare that output ("eval output"):
    #: some of fme's code paths (the latent mean clipping) only act in eval
    eval_output: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # any other SFNONetConfig field

    def sfno_config(self) -> Any:
        from fme.core.models.conditional_sfno.sfnonet import SFNONetConfig

        return SFNONetConfig(
            embed_dim=self.embed_dim,
            num_layers=self.num_layers,
            pos_embed=self.pos_embed,
            big_skip=self.big_skip,
            global_layer_norm=self.global_layer_norm,
            affine_norms=self.affine_norms,
            normalize_big_skip=self.normalize_big_skip,
            filter_type=self.filter_type,
            clip_latent_global_means=self.clip_latent_global_means,
            **self.options,
        )


class FmeCase(SpatialCase):
    """fme's SFNO: its ``NonDistributed`` path against ``ModelTorchDistributed`` on the
    harness's ranks (``h * w`` ranks per spatial group).

    float32 by default: fme's SHT and loss are float32 code; float64 works where fme's
    layers follow the default dtype (``dtype=torch.float64``).
    """

    def __init__(
        self, dtype: torch.dtype = torch.float32, faults: tuple[str, ...] = (), **config: Any
    ) -> None:
        unknown = set(faults) - FME_FAULTS.keys()
        if unknown:
            raise ConfigError(
                f"unknown fme fault(s) {sorted(unknown)}; known: {sorted(FME_FAULTS)}"
            )
        self.config = FmeConfig(**config)
        self.dtype = dtype
        self.faults = tuple(faults)
        opts = ", ".join(f"{k}={v}" for k, v in sorted(config.items()) if k not in ("h", "w"))
        self.name = f"fme sfno ({opts})" if opts else "fme sfno"

    # ------------------------------------------------------------------ build

    def build(self, topo: Topology) -> torch.nn.Module:
        require()
        cfg = self.config
        if topo.spatial_group is not None and cfg.h * cfg.w != topo.spatial_size:
            raise ConfigError(
                f"FmeCase h={cfg.h} x w={cfg.w} needs spatial groups of {cfg.h * cfg.w} "
                f"ranks, got {topo.spatial_size}: pass spatial_size={cfg.h * cfg.w}"
            )
        instance = _install_backend(topo, cfg)
        _patch_faults(self.faults, instance)
        from fme.core.models.conditional_sfno.sfnonet import get_lat_lon_sfnonet

        net = get_lat_lon_sfnonet(
            self.config.sfno_config(),
            in_chans=cfg.channels,
            out_chans=cfg.channels,
            img_shape=(cfg.nlat, cfg.nlon),
            data_grid=cfg.grid,
        )
        return _FmeModel(net, instance.wrap_module(net), _area_weights(cfg))

    def teardown(self, model: torch.nn.Module | None, topo: Topology) -> None:
        _uninstall_backend()

    # ------------------------------------------------------------------ data

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        shape = (cfg.batch_size, cfg.channels, cfg.nlat, cfg.nlon)
        x, y = torch.randn(shape), torch.randn(shape)  # the global batch, seeded alike
        samples = data_share(cfg.batch_size, topo)
        return {"x": x[samples], "y": y[samples]}

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        from fme.core.distributed.distributed import Distributed
        from fme.core.loss import AreaWeightedMSELoss
        from fme.core.models.conditional_sfno.layers import Context

        assert isinstance(model, _FmeModel)
        cfg = self.config
        dist = Distributed.get_instance()
        local = dist.scatter_spatial(batch, (cfg.nlat, cfg.nlon))  # fme's own slicing
        ops = _lat_lon_operations(model.area)
        context = Context(embedding_scalar=None, embedding_pos=None, labels=None, noise=None)
        out = model(local["x"], context)
        components = AreaWeightedMSELoss(ops.area_weighted_mean)(out, local["y"])
        loss = sum(c.reduce_to_channel().mean() for c in components)
        assert isinstance(loss, torch.Tensor)
        if topo.data_group is not None and topo.data_size > 1:
            loss = _data_mean(loss, topo)
        fields = {"output": out.detach()}
        if cfg.eval_output:
            model.eval()
            with torch.no_grad():
                # an input unlike the training batches: eval-only paths act on it
                fields["eval output"] = model(2.0 * local["x"] + 1.0, context)
            model.train()
        if topo.spatial_group is None:
            return Outputs(loss, dict(fields))
        rows, cols = dist.get_local_slices((cfg.nlat, cfg.nlon))
        shards = {k: Shard.grid(v, rows, cols, cfg.nlat, cfg.nlon) for k, v in fields.items()}
        return Outputs(loss, dict(shards))

    def describe(self, topo: Topology | None = None) -> str:
        cfg = self.config
        text = f"{cfg.grid} {cfg.nlat}x{cfg.nlon}"
        if topo is None or topo.spatial_group is None:
            return text
        from torch_harmonics.distributed import compute_split_shapes

        lat = compute_split_shapes(cfg.nlat, cfg.h)
        lon = compute_split_shapes(cfg.nlon, cfg.w)
        return f"{text} on {cfg.h}x{cfg.w} (lat {lat} x lon {lon})"


class _FmeModel(torch.nn.Module):
    """fme's network as fme trains it: ``wrapped`` is what ``wrap_module`` returned (DDP with
    fme's spatial gradient hooks, or fme's ``DummyWrapper``); the parameters are the
    network's own, registered once."""

    wrapped: torch.nn.Module
    area: torch.Tensor

    def __init__(self, net: torch.nn.Module, wrapped: torch.nn.Module, area: torch.Tensor):
        super().__init__()
        self.net = net
        object.__setattr__(self, "wrapped", wrapped)  # not a submodule: same parameters
        self.register_buffer("area", area, persistent=False)

    def forward(self, *args: Any) -> Any:
        return self.wrapped(*args)


# ---------------------------------------------------------------------- fme's global state


def _install_backend(topo: Topology, cfg: FmeConfig) -> Any:
    """fme's ``Distributed`` singleton for this run: ``NonDistributed`` for the reference,
    ``ModelTorchDistributed(h, w)`` on the harness's group for the ranks."""
    import torch.distributed as tdist
    from fme.core.distributed import distributed as fme_distributed
    from fme.core.distributed.distributed import Distributed
    from fme.core.distributed.external.pnd_manager import DistributedManager

    from harness._compat import reset_torch_harmonics_groups, restore_transposes

    _SAVED.append((fme_distributed.singleton, Distributed._entered))
    instance = Distributed.__new__(Distributed)
    instance._seed = 0
    instance._force_non_distributed = topo.spatial_group is None
    if topo.spatial_group is None:
        from fme.core.distributed.non_distributed import NonDistributed

        instance._distributed = NonDistributed()
    else:
        from fme.core.distributed.model_torch_distributed import ModelTorchDistributed

        restore_transposes()  # fme brings its own answer to gloo's all_to_all
        reset_torch_harmonics_groups()
        # Adopt the harness's default group: fme's manager then skips init_process_group.
        DistributedManager._shared_state.update(
            _is_initialized=True,
            _distributed=True,
            _rank=tdist.get_rank(),
            _world_size=tdist.get_world_size(),
            _local_rank=tdist.get_rank(),
            _device=torch.device("cpu"),
            _cuda=False,
            _initialization_method="harness",
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Distributed manager is already initialized")
            instance._distributed = ModelTorchDistributed(h_size=cfg.h, w_size=cfg.w)
    setattr(fme_distributed, "singleton", instance)  # noqa: B010
    Distributed._entered = True
    return instance


_SAVED: list[tuple[Any, bool]] = []


def _uninstall_backend() -> None:
    """Put back fme's singleton, its manager's state, its gloo patch and torch-harmonics'
    groups as they were before ``build``."""
    import sys

    fme_distributed = sys.modules.get("fme.core.distributed.distributed")
    if fme_distributed is None:
        return
    from fme.core.distributed import _gloo_patch
    from fme.core.distributed.distributed import Distributed
    from fme.core.distributed.external.pnd_manager import DistributedManager

    from harness._compat import reset_torch_harmonics_groups

    if _SAVED:
        singleton, Distributed._entered = _SAVED.pop()
        setattr(fme_distributed, "singleton", singleton)  # noqa: B010
    # not cleanup(): that destroys the default group, which is the harness's
    DistributedManager._shared_state.clear()
    if _gloo_patch._original_all_to_all is not None:
        torch.distributed.all_to_all = _gloo_patch._original_all_to_all
        _gloo_patch._original_all_to_all = None
    reset_torch_harmonics_groups()
    _unpatch_faults()


def _area_weights(cfg: FmeConfig) -> torch.Tensor:
    """Area weights of the grid's cells, cos(latitude), the same in both runs."""
    import numpy as np

    if cfg.grid == "legendre-gauss":
        nodes = np.polynomial.legendre.leggauss(cfg.nlat)[0]  # cos(colatitude)
        lat = np.arcsin(nodes)
    else:
        lat = np.linspace(np.pi / 2, -np.pi / 2, cfg.nlat)
    weights = torch.as_tensor(np.cos(lat), dtype=torch.get_default_dtype()).clamp_min(1e-6)
    return weights[:, None].expand(cfg.nlat, cfg.nlon).contiguous()


def _lat_lon_operations(area: torch.Tensor) -> Any:
    from fme.core.gridded_ops import LatLonOperations

    return LatLonOperations(area)


def _data_mean(loss: torch.Tensor, topo: Topology) -> torch.Tensor:
    """The loss as fme logs it over data groups: the mean of the groups' losses, with an
    identity backward (DDP averages the gradients over the data group itself)."""
    return apply(_DataMean, loss, topo.data_group, topo.data_size)


class _DataMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        out = x.detach().clone()
        torch.distributed.all_reduce(out, group=group)
        return out / size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


# ---------------------------------------------------------------------- faults


_UNDO: list[Callable[[], None]] = []


def _patch_faults(faults: tuple[str, ...], instance: Any) -> None:
    """Break fme's own distributed path the way each fault says, on this rank only."""
    backend = instance._distributed
    if not faults or type(backend).__name__ != "ModelTorchDistributed":
        return
    cls = type(backend)
    if "no-spatial-grad-hooks" in faults:
        _swap(cls, "_register_spatial_grad_hooks", lambda self, module: None)
    if "reduce-sum-no-allreduce" in faults:
        _swap(cls, "spatial_reduce_sum", lambda self, tensor: tensor)
    if "slices-swapped" in faults:
        original = cls._get_local_spatial_shape

        def mirrored(self: Any, h: int, w: int) -> Any:
            self._h_rank, saved = self._h_size - 1 - self._h_rank, self._h_rank
            try:
                return original(self, h, w)
            finally:
                self._h_rank = saved

        _swap(cls, "_get_local_spatial_shape", mirrored)


def _swap(cls: type, name: str, new: Any) -> None:
    old = cls.__dict__[name]
    setattr(cls, name, new)
    _UNDO.append(lambda: setattr(cls, name, old))


def _unpatch_faults() -> None:
    while _UNDO:
        _UNDO.pop()()


# ---------------------------------------------------------------------- the main job


Config = tuple[str, Callable[..., SpatialCase], dict[str, Any], "int | None"]


def main_configs(ranks: int) -> list[Config]:
    """(label, factory, kwargs, spatial_size) for ``harness-check --model fme``."""
    if ranks == 4:
        return [
            ("fme 2x2", FmeCase, {"h": 2, "w": 2}, None),
            ("fme 4x1 uneven", FmeCase, {"nlat": 10, "nlon": 16, "h": 4, "w": 1}, None),
            ("fme 1x4 equiangular", FmeCase, {"h": 1, "w": 4, "grid": "equiangular"}, None),
            ("fme 2x1 x 2 data", FmeCase, {"h": 2, "w": 1, "batch_size": 4}, 2),
        ]
    h = ranks if ranks <= 8 else 1
    return [(f"fme {h}x1", FmeCase, {"nlat": max(8, 2 * h), "h": h, "w": 1}, None)]


def fault_matrix(ranks: int) -> Iterator[tuple[str, Any, dict[str, Any], Any, str, set[str]]]:
    """Each fault of ``FME_FAULTS`` on a 2x2 layout, with the quantities that must catch it."""
    if ranks != 4:
        return
    expected = {
        "no-spatial-grad-hooks": {"grad", "sync"},
        "reduce-sum-no-allreduce": {"loss", "grad"},
        "slices-swapped": {"field", "loss"},
    }
    for fault in FME_FAULTS:
        yield "fme", FmeCase, {"h": 2, "w": 2}, None, fault, expected[fault]
