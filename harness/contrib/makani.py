"""NVIDIA makani's spatially parallel SFNO as a ``SpatialCase``.

``MakaniCase`` builds makani's own ``SphericalFourierNeuralOperatorNet``
(``makani.models.networks.sfnonet``) model parallel over latitudes (makani's ``h`` group;
``w`` and ``matmul`` of size 1) and trains it one step at a time the way makani's trainer
does around the model:

- makani's groups from makani's own ``comm.init`` (physicsnemo's ``DistributedManager``
  adopted onto the harness's world first, ``harness.adopt.adopt_distributed_manager``), held
  against the topology by ``harness.adopt.check_group``;
- makani's ``init_gradient_reduction_hooks``: DDP over the data group (mean) with makani's
  comm hook summing every gradient over the model groups its parameter's ``is_shared_mp``
  names (the spectral weights are sharded over ``h`` and not summed there);
- data sliced to the rank's latitudes by torch-harmonics' ``compute_split_shapes``, the
  split makani's data loaders use.

Each rank holds only its degrees ``l`` of every spectral weight (makani's
``sharded_dims_mp``), declared in ``parameter_shards``. The ranks cannot draw the
reference's initial values (a shard drawn at its own shape consumes fewer random numbers,
and makani scales ``l = 0`` of every rank's local block), so ``load_reference_init`` copies
the reference's into every parameter before the first step: initial values are not checked,
everything after them is.

One shim, CPU only: makani passes ``device_ids=[device]`` to DDP, which DDP refuses for a
CPU module (``makani/mpu/mappings.py``, ``init_gradient_reduction_hooks``); the case drops
``device_ids``/``output_device`` there when the device is the CPU. Nothing else of makani's
is changed except by the faults (``MAKANI_FAULTS``).

makani needs torch-harmonics >= 0.9 (``torch_harmonics.quadrature.precompute_latitudes``)
and is not on the package index. Install it from its source, beside physicsnemo, with
``pip install "torch-harmonics>=0.9" nvidia-physicsnemo wandb zarr h5py ruamel.yaml moviepy
more-itertools && pip install --no-deps <makani source>``. Nothing here imports makani until
a case is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.adopt import adopt_distributed_manager, check_group, on_undo, patch, pending, undo
from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.errors import ConfigError
from harness.partition import LatLonPartition
from harness.steppers.faults import check_faults
from harness.topology import Topology

__all__ = [
    "MAKANI_FAULTS",
    "MakaniCase",
    "MakaniConfig",
    "MakaniNotInstalled",
    "fault_matrix",
    "main_configs",
    "require",
]

INSTALL = (
    'pip install "torch-harmonics>=0.9" nvidia-physicsnemo wandb zarr h5py ruamel.yaml '
    "moviepy more-itertools && pip install --no-deps <makani source: github NVIDIA/makani>"
)

#: what a rank pool should import once, in its fork server (``--spatial-preload``)
PRELOAD = ("makani", "makani.models.networks.sfnonet", "torch_harmonics.distributed")

#: fault id -> what is broken in makani's own distributed path (inside the rank only)
MAKANI_FAULTS: dict[str, str] = {
    "grad-not-summed-over-model": "every parameter's is_shared_mp leaves out the model "
    "group: makani's comm hook sums no replicated gradient over h",
    "input-slices-mirrored": "each rank is handed the latitudes of its mirror rank in h",
}


#: fault id -> the quantities whose mismatch must come first (seen on 4 ranks, h = 2 x data 2)
EXPECTED: dict[str, set[str]] = {
    "grad-not-summed-over-model": {"grad", "sync"},
    "input-slices-mirrored": {"loss", "field"},
}


def main_configs(ranks: int) -> list[tuple[str, Any, dict[str, Any], int]]:
    """(label, factory, kwargs, spatial_size) for ``harness-check --model makani``: h = 2,
    with ``ranks // 2`` data-parallel groups."""
    if ranks < 2 or ranks % 2:
        return []
    return [(f"makani sfno h=2 x data {ranks // 2}", MakaniCase, {}, 2)]


def fault_matrix(ranks: int) -> list[tuple[str, Any, dict[str, Any], int, str, set[str]]]:
    """Each fault of ``MAKANI_FAULTS`` on h = 2, with the quantities that must catch it."""
    if ranks < 2 or ranks % 2:
        return []
    return [("makani", MakaniCase, {}, 2, fault, set(q)) for fault, q in EXPECTED.items()]


class MakaniNotInstalled(ConfigError, ImportError):
    """makani is not importable here: an ``ImportError`` and the harness's ``ConfigError``."""


def require() -> Any:
    """Import and return ``makani``'s SFNO module, or raise ``MakaniNotInstalled``."""
    try:
        from makani.models.networks import sfnonet
        from makani.utils import comm  # noqa: F401
    except ImportError as exc:
        raise MakaniNotInstalled(
            f"harness.contrib.makani needs NVIDIA makani ({exc}); it is not on the package "
            f"index: install it with: {INSTALL}"
        ) from exc
    return sfnonet


@dataclass(frozen=True)
class MakaniConfig:
    """A small makani SFNO, model parallel over ``h`` latitude blocks (``w = 1``)."""

    nlat: int = 8
    nlon: int = 16
    h: int = 2
    channels: int = 2
    batch_size: int = 2
    embed_dim: int = 4
    num_layers: int = 2
    operator_type: str = "dhconv"  # spectral weights sharded over h by degree l


class MakaniCase(SpatialCase):
    """makani's SFNO without comm (the reference) against makani on ``h`` ranks per spatial
    group (the ranks beyond them are makani's data-parallel ``batch`` groups)."""

    load_reference_init = True

    def __init__(
        self, dtype: torch.dtype = torch.float32, faults: tuple[str, ...] = (), **config: Any
    ) -> None:
        self.config = MakaniConfig(**config)
        self.dtype = dtype
        self.faults = tuple(sorted(check_faults(faults, MAKANI_FAULTS, "makani")))
        self.name = "makani sfno" + (f" [{', '.join(self.faults)}]" if self.faults else "")

    # ------------------------------------------------------------------ build

    def build(self, topo: Topology) -> torch.nn.Module:
        sfnonet = require()
        from makani.utils import comm

        from harness._base.compat import reset_torch_harmonics_groups

        cfg = self.config
        if topo.spatial_group is not None and cfg.h != topo.spatial_size:
            raise ConfigError(
                f"MakaniCase h={cfg.h} needs spatial groups of {cfg.h} ranks, got "
                f"{topo.spatial_size}: pass spatial_size={cfg.h}"
            )
        self._adopted_from = pending()  # teardown undoes this build's adoptions, no older
        patch(comm, "_DM", None)  # the reference: makani's comm answers size 1 everywhere
        patch(comm, "_COMM_ROOTS", {})
        reset_torch_harmonics_groups()
        on_undo(reset_torch_harmonics_groups)
        if topo.spatial_group is not None:
            adopt_distributed_manager(topo, groups={})
            comm.init(
                model_parallel_sizes=[cfg.h, 1, 1],
                model_parallel_names=["h", "w", "matmul"],
                data_parallel_sizes=[1, -1],
                data_parallel_names=["ensemble", "batch"],
            )
            check_group(comm.get_group("h"), topo, "makani's h group", of="spatial")
            check_group(comm.get_group("data"), topo, "makani's data group", of="data")
        net = sfnonet.SphericalFourierNeuralOperatorNet(
            inp_shape=(cfg.nlat, cfg.nlon),
            out_shape=(cfg.nlat, cfg.nlon),
            scale_factor=1,
            inp_chans=cfg.channels,
            out_chans=cfg.channels,
            embed_dim=cfg.embed_dim,
            num_layers=cfg.num_layers,
            operator_type=cfg.operator_type,
            model_grid_type="legendre-gauss",
            sht_grid_type="legendre-gauss",
        )
        wrapped = net
        if topo.spatial_group is not None:
            if "grad-not-summed-over-model" in self.faults:
                for p in net.parameters():
                    shared = getattr(p, "is_shared_mp", ["model"])
                    p.is_shared_mp = [g for g in shared if g != "model"]
            wrapped = _reduction_hooks(net)
        return _MakaniModel(net, wrapped)

    def teardown(self, model: torch.nn.Module | None, topo: Topology) -> None:
        undo(getattr(self, "_adopted_from", 0))

    # ------------------------------------------------------------------ shards

    def parameter_shards(self, model: torch.nn.Module, topo: Topology) -> dict[str, Shard]:
        """makani's spectral weights: dim ``i`` marked ``"h"`` in ``sharded_dims_mp`` holds
        this rank's degrees ``l`` (``inverse_transform.l_shapes``)."""
        if topo.spatial_group is None:
            return {}
        from makani.utils import comm

        rank = comm.get_rank("h")
        out: dict[str, Shard] = {}
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                dims = getattr(p, "sharded_dims_mp", None) or []
                marked = [(i, g) for i, g in enumerate(dims) if g is not None]
                if not marked:
                    continue
                if marked != [(p.dim() - 1, "h")] or not hasattr(module, "inverse_transform"):
                    raise ConfigError(
                        f"makani parameter {mod_name}.{p_name} is sharded as {dims}; "
                        "MakaniCase declares only spectral weights sharded over h in their "
                        "last dim (w = 1)"
                    )
                shapes = list(module.inverse_transform.l_shapes)
                start = sum(shapes[:rank])
                out[f"{mod_name}.{p_name}"] = Shard(p, slice(start, start + shapes[rank]), -1)
        return out

    # ------------------------------------------------------------------ data

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        shape = (cfg.batch_size, cfg.channels, cfg.nlat, cfg.nlon)
        x, y = torch.randn(shape), torch.randn(shape)  # the global batch, seeded alike
        samples = data_share(cfg.batch_size, topo)
        return {"x": x[samples], "y": y[samples]}

    def _rows(self, topo: Topology, handed: bool = True) -> slice:
        from torch_harmonics.distributed import compute_split_shapes

        if topo.spatial_group is None:
            return slice(0, self.config.nlat)
        shapes = compute_split_shapes(self.config.nlat, self.config.h)
        rank = topo.spatial_rank
        if handed and "input-slices-mirrored" in self.faults:
            rank = self.config.h - 1 - rank
        start = sum(shapes[:rank])
        return slice(start, start + shapes[rank])

    def forward(self, model: torch.nn.Module, batch: Any, topo: Topology) -> Outputs:
        assert isinstance(model, _MakaniModel)
        cfg = self.config
        rows = self._rows(topo)
        x, y = batch["x"][..., rows, :], batch["y"][..., rows, :]
        out = model(x)
        # each data group's mean square error over its samples (makani's DDP averages the
        # gradients of the data groups, its comm hook sums the h ranks' parts)
        count = (cfg.batch_size // topo.data_size) * cfg.channels * cfg.nlat * cfg.nlon
        local = ((out - y) ** 2).sum() / count
        loss = _global_loss(local, topo)
        if topo.spatial_group is None:
            return Outputs(loss, {"output": out.detach()})
        true_rows = self._rows(topo, handed=False)  # where the rank's block truly is
        cols = slice(0, cfg.nlon)
        return Outputs(
            loss, {"output": Shard.grid(out.detach(), true_rows, cols, cfg.nlat, cfg.nlon)}
        )

    def partition(self, topo: Topology) -> LatLonPartition:
        return LatLonPartition(self.config.nlat, self.config.nlon, self.config.h, 1)

    def describe(self, topo: Topology | None = None) -> str:
        cfg = self.config
        return f"legendre-gauss {cfg.nlat}x{cfg.nlon}, makani h={cfg.h} x w=1"


class _MakaniModel(torch.nn.Module):
    """makani's network as makani trains it: ``wrapped`` is what
    ``init_gradient_reduction_hooks`` returned (DDP with makani's comm hook), or the network
    itself for the reference; the parameters are the network's own, registered once."""

    wrapped: torch.nn.Module

    def __init__(self, net: torch.nn.Module, wrapped: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        object.__setattr__(self, "wrapped", wrapped)  # not a submodule: same parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wrapped(x)
        return out


def _reduction_hooks(net: torch.nn.Module) -> torch.nn.Module:
    """makani's ``init_gradient_reduction_hooks`` on the CPU: its DDP call passes
    ``device_ids=[device]``, which DDP refuses for a CPU module; dropped here (the shim
    the module docstring names)."""
    from makani.mpu import mappings
    from torch.nn.parallel import DistributedDataParallel

    def cpu_ddp(module: torch.nn.Module, *args: Any, **kw: Any) -> Any:
        kw.pop("device_ids", None)
        kw.pop("output_device", None)
        return DistributedDataParallel(module, *args, **kw)

    patch(mappings, "DistributedDataParallel", cpu_ddp)
    return mappings.init_gradient_reduction_hooks(net, torch.device("cpu"))  # type: ignore[no-any-return]


class _WorldSum(torch.autograd.Function):
    """Forward: the mean over data groups of their losses (each the sum of its ranks'
    parts). Backward: the identity, since makani's DDP averages over data groups and its
    comm hook sums the h ranks' parts already."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, data_size: int) -> torch.Tensor:
        y = x.detach().clone()
        dist.all_reduce(y)
        return y / data_size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _global_loss(local: torch.Tensor, topo: Topology) -> torch.Tensor:
    if topo.spatial_group is None:
        return local
    out: torch.Tensor = _WorldSum.apply(local, topo.data_size)  # type: ignore[no-untyped-call]
    return out
