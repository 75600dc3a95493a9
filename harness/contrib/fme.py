"""ACE / ``fme``'s spatially parallel SFNO as a ``SpatialCase``.

``FmeCase`` builds fme's own noise-conditioned SFNO (``NoiseConditionedSFNOBuilder.build``,
the registry's ``"NoiseConditionedSFNO"``, on fme's ``Distributed`` singleton and
torch-harmonics' distributed SHT) and trains it one step at a time the way fme does around
the model:

- fme's ``Distributed.wrap_module``: DDP over the data group (``broadcast_buffers=False``)
  plus fme's gradient hooks that all-reduce every parameter gradient over the spatial group;
- fme's loss, ``AreaWeightedMSELoss`` on ``LatLonOperations.area_weighted_mean``, whose
  weighted sums cross the spatial group through fme's ``spatial_reduce_sum`` (all-reduce
  forward, identity backward);
- data sliced to the rank's block by fme's ``get_local_slices`` (``scatter_spatial``).

Rollouts (``rollout=N``) go through fme's own inference path: ``FmeCase.predict`` wraps the
network in fme's ``Stepper`` and calls its ``predict`` (forcing per step, the prognostic
variable fed back, a diagnostic output) on data sliced by fme's ``BatchData.scatter_spatial``.

The reference is the same code with fme's ``NonDistributed`` backend. On the ranks fme's
``ModelTorchDistributed`` runs inside the harness's process group: fme's vendored
``DistributedManager`` wants to create the default group itself (and its ``atexit`` handler
and ``Distributed.context()`` destroy it), so the case *adopts* the harness's world into it
(``harness.adopt.adopt_distributed_manager``) before fme looks. fme then builds its own
(data, h, w) ``DeviceMesh`` and groups, which ``harness.adopt.check_group`` holds against the
topology (a layout fme and the harness disagree on is one clear line, not a wrong verdict).
``teardown`` puts everything back through ``harness.adopt.undo``: the manager's state, fme's
``Distributed`` singleton, fme's ``patch_gloo_alltoall`` of ``torch.distributed.all_to_all``,
the faults' patches and torch-harmonics' groups (0.8.0's ``is_initialized`` is always False,
so fme calls ``thd.init`` on every build). Gloo's ``all_to_all`` is fme's own patch, not the
harness's: the harness's transposes are undone first.

float32 only: fme builds its SHTs with ``.float()`` and draws its isotropic noise in
float32 whatever the default dtype, so a float64 run fails in the reference already.

Install with ``pip install "pytest-spatial-harness[fme]"`` beside fme (which pins
torch-harmonics 0.8.0). Nothing here imports fme until a case is built.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.adopt import adopt_distributed_manager, check_group, on_undo, patch, pending, undo
from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.errors import ConfigError
from harness.partition import LatLonPartition
from harness.topology import Topology

__all__ = [
    "FME_FAULTS",
    "INFERENCE_FAULTS",
    "FmeCase",
    "FmeConfig",
    "FmeNotInstalled",
    "fault_matrix",
    "main_configs",
    "require",
]

_INSTALL = 'pip install "pytest-spatial-harness[fme]"'

#: The modules a rank pool should import once, in its fork server (``--spatial-preload``):
#: importing fme and torch-harmonics takes seconds.
PRELOAD = ("fme", "torch_harmonics", "torch_harmonics.distributed")

#: fault id -> what is patched into fme's own distributed path (inside the rank only)
FME_FAULTS: dict[str, str] = {
    "no-spatial-grad-hooks": "wrap_module leaves out fme's spatial gradient all-reduce hooks",
    "reduce-sum-no-allreduce": "spatial_reduce_sum returns the local sum (no all-reduce)",
    "reduce-sum-summed-backward": "spatial_reduce_sum's backward all-reduces the gradient "
    "(fme's is the identity, right for the replicated loss): gradients S times too large",
    "slices-swapped": "get_local_slices hands each rank the block of its mirror rank",
    "all-to-all-peer-order": "fme's gloo all_to_all files each peer's block under the next "
    "peer (a wrong gather order in the SHT's transposes)",
    "no-gloo-alltoall-patch": "ModelTorchDistributed skips patch_gloo_alltoall",
    "mesh-data-innermost": "fme's manager lays its (data, h, w) mesh out with the data "
    "dimension innermost: fme's spatial groups are strided, the harness's consecutive (a "
    "layout the harness must refuse in one line, not judge)",
    # only in inference (fme's Stepper.predict, no_grad): a training check passes them
    "inference-stale-forcing": "each rank keeps the forcing it scattered for the first "
    "rollout step and feeds it to every later step (a per-rank buffer cached across steps)",
    "inference-noise-per-rank": "inference seeds each rank's isotropic-noise generator with "
    "the rank (ensemble inference seeded per process): the tiles of one member see "
    "different noise",
}

#: the faults of ``FME_FAULTS`` that live only in fme's inference path (``FmeCase.predict``)
INFERENCE_FAULTS = ("inference-stale-forcing", "inference-noise-per-rank")


class FmeNotInstalled(ConfigError, ImportError):
    """fme is not importable here: both an ``ImportError`` (what callers of an optional
    dependency catch) and the harness's ``ConfigError`` (what its CLI and plugin report)."""


def require() -> Any:
    """Import and return ``fme``, or raise ``FmeNotInstalled`` naming the fix."""
    try:
        import fme
        from fme.core.distributed import distributed  # noqa: F401
    except ImportError as exc:
        raise FmeNotInstalled(
            f"harness.contrib.fme needs the fme package (ACE) ({exc}); install it with: {_INSTALL}"
        ) from exc
    return fme


@dataclass(frozen=True)
class FmeConfig:
    """A small fme SFNO and its partition.

    ``h`` x ``w`` is fme's spatial process grid (latitudes x longitudes, split by
    torch-harmonics' rule, uneven where the sizes do not divide); ranks beyond ``h * w``
    become fme's data-parallel groups. The model options are those of fme's
    ``NoiseConditionedSFNOBuilder`` (registry name ``"NoiseConditionedSFNO"``, the SFNO ACE
    trains); ``options`` passes any other field of it.
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
    #: fme's conditioning noise: "isotropic" (drawn in spectral space, sliced per rank) or
    #: "gaussian" (drawn per grid point); ``noise_embed_dim=0`` turns the noise off
    noise_type: str = "isotropic"
    noise_embed_dim: int = 4
    context_pos_embed_dim: int = 0
    pos_embed: bool = True
    big_skip: bool = True
    global_layer_norm: bool = False
    affine_norms: bool = False
    normalize_big_skip: bool = False
    filter_residual: bool = False
    filter_output: bool = False
    filter_type: str = "linear"
    clip_latent_global_means: bool = False
    #: fields of fme's ``AtmosphereCorrectorConfig`` to apply fme's corrector to the output
    #: as its stepper does (channel 0 is named ``tendency_of_total_water_path_due_to_advection``,
    #: the others ``var1``, ...), e.g. ``{"zero_global_mean_moisture_advection": True}``
    corrector: dict[str, Any] | None = None
    #: also run the model in eval mode each step and compare that output ("eval output"):
    #: some of fme's code paths (the latent mean clipping) only act in eval
    eval_output: bool = False
    #: the latent global-mean envelope (fme's ``_gm_min``, ``_gm_max`` buffers, every channel)
    #: a trained checkpoint carries into inference, loaded before ``predict`` as fme loads a
    #: checkpoint's state: with ``clip_latent_global_means`` fme's eval forward clips the
    #: latent means to it (a network as built holds -inf, inf there and clips nothing)
    latent_mean_envelope: tuple[float, float] | None = None
    #: after fme's init, draw the weights of the noise-conditioning convolutions
    #: (``W_scale_2d``, ``W_bias_2d``) from N(0, std^2), as a trained checkpoint holds them:
    #: fme initialises them to zero, so in a network as built the noise changes no output
    #: (only gradients), and neither a field nor a rollout could see a noise bug
    noise_weights_std: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)  # any other builder field

    def builder(self) -> Any:
        """fme's ``NoiseConditionedSFNOBuilder`` for these options."""
        from fme.ace.registry.stochastic_sfno import NoiseConditionedSFNOBuilder

        return NoiseConditionedSFNOBuilder(
            embed_dim=self.embed_dim,
            num_layers=self.num_layers,
            # no noise channels: fme's isotropic draw would run an inverse SHT on an empty
            # tensor (an MKL FFT error); its gaussian draw of 0 channels is a no-op
            noise_type="gaussian" if self.noise_embed_dim == 0 else self.noise_type,
            noise_embed_dim=self.noise_embed_dim,
            context_pos_embed_dim=self.context_pos_embed_dim,
            pos_embed=self.pos_embed,
            big_skip=self.big_skip,
            global_layer_norm=self.global_layer_norm,
            affine_norms=self.affine_norms,
            normalize_big_skip=self.normalize_big_skip,
            filter_residual=self.filter_residual,
            filter_output=self.filter_output,
            filter_type=self.filter_type,
            clip_latent_global_means=self.clip_latent_global_means,
            data_grid=self.grid,
            **self.options,
        )


class FmeCase(SpatialCase):
    """fme's SFNO: its ``NonDistributed`` path against ``ModelTorchDistributed`` on the
    harness's ranks (``h * w`` ranks per spatial group).

    float32: fme's SHTs are float32 (``get_sht(...).float()``) and its isotropic noise is
    drawn in float32, so ``dtype=torch.float64`` fails in fme's own reference path.
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
        self._adopted_from = pending()  # teardown undoes this build's adoptions, no older
        if topo.spatial_group is not None:
            _patch_faults(self.faults)  # before fme's backend exists: some act in its __init__
        instance = _install_backend(topo, cfg)
        if topo.spatial_group is not None:
            _check_groups(instance._distributed, topo, cfg)
        from fme.core.dataset_info import DatasetInfo

        # fme's own builder, as its registry calls it (ModuleSelector.build)
        net = cfg.builder().build(
            cfg.channels, cfg.channels, DatasetInfo(img_shape=(cfg.nlat, cfg.nlon))
        )
        if cfg.noise_weights_std:
            _draw_noise_weights(net, cfg.noise_weights_std)
        return _FmeModel(net, instance.wrap_module(net), _area_weights(cfg))

    def teardown(self, model: torch.nn.Module | None, topo: Topology) -> None:
        undo(getattr(self, "_adopted_from", 0))

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

        assert isinstance(model, _FmeModel)
        cfg = self.config
        dist = Distributed.get_instance()
        local = dist.scatter_spatial(batch, (cfg.nlat, cfg.nlon))  # fme's own slicing
        ops = _lat_lon_operations(model.area)
        out = model(local["x"])  # fme's NoiseConditionedModel draws its noise here
        if cfg.corrector is not None:
            out = _correct(out, cfg.corrector, ops)
        components = AreaWeightedMSELoss(ops.area_weighted_mean)(out, local["y"])
        loss = sum(c.reduce_to_channel().mean() for c in components)
        assert isinstance(loss, torch.Tensor)
        # with data groups this is the group's own loss: the harness compares the mean of
        # the groups' losses with the reference (checks.check_loss), as fme logs it
        fields = {"output": out.detach()}
        if cfg.eval_output:
            model.eval()
            with torch.no_grad():
                # an input unlike the training batches: eval-only paths act on it
                fields["eval output"] = model(2.0 * local["x"] + 1.0)
            model.train()
        if topo.spatial_group is None:
            return Outputs(loss, dict(fields))
        rows, cols = dist.get_local_slices((cfg.nlat, cfg.nlon))
        shards = {k: Shard.grid(v, rows, cols, cfg.nlat, cfg.nlon) for k, v in fields.items()}
        return Outputs(loss, dict(shards))

    # ------------------------------------------------------------------ inference

    def predict(self, model: torch.nn.Module, batch: Any, topo: Topology, steps: int) -> Any:
        """fme's own inference path: its ``Stepper.predict`` (``predict_generator``, one
        ``Stepper.step`` per forward step: normalize, the network, denormalize) over ``steps``
        steps, the path the seed's ``predict`` golden drives (``test_stepper_predict_regression``):
        a forcing read at every step, prognostic variables fed back, a diagnostic output.

        The stepper is fme's, built from its ``StepperConfig`` around the network the
        harness built (its weights and buffers copied in as a checkpoint would be, the
        mode as the harness set it); the data is one global ``BatchData`` sliced to the
        rank's block by fme's own ``BatchData.scatter_spatial``, as fme's loaders do. Each
        step's prognostic and diagnostic fields come back as ``Shard.grid`` blocks."""
        from fme.core.distributed.distributed import Distributed

        cfg = self.config
        if cfg.corrector is not None or cfg.channels < 2:
            raise ConfigError(
                f"FmeCase.predict rolls out a forcing and channels - 1 prognostic variables "
                f"without a corrector; got channels={cfg.channels}, corrector="
                f"{cfg.corrector}: roll out with channels >= 2 and corrector=None"
            )
        if cfg.latent_mean_envelope is not None and not cfg.clip_latent_global_means:
            raise ConfigError(
                f"FmeCase latent_mean_envelope={cfg.latent_mean_envelope} is the envelope of "
                "fme's latent-mean clipping, which is off: pass clip_latent_global_means=True"
            )
        assert isinstance(model, _FmeModel)
        if cfg.latent_mean_envelope is not None:
            _load_envelope(model.net, cfg.latent_mean_envelope)
        prognostic = [f"var{i}" for i in range(1, cfg.channels)]
        stepper = _stepper(model, cfg, ["forcing", *prognostic], [*prognostic, "diagnostic"])
        data = _rollout_data(batch, prognostic, steps).scatter_spatial((cfg.nlat, cfg.nlon))
        initial = data.get_start(prognostic, n_ic_timesteps=stepper.n_ic_timesteps)
        with warnings.catch_warnings():  # fme times its predict only inside its GlobalTimer
            warnings.filterwarnings("ignore", "The GlobalTimer is currently inactive")
            output, _ = stepper.predict(initial, data)
        names = [*prognostic, "diagnostic"]
        if topo.spatial_group is None:
            return [{n: output.data[n][:, k] for n in names} for k in range(steps)]
        rows, cols = Distributed.get_instance().get_local_slices((cfg.nlat, cfg.nlon))
        return [
            {n: Shard.grid(output.data[n][:, k], rows, cols, cfg.nlat, cfg.nlon) for n in names}
            for k in range(steps)
        ]

    def partition(self, topo: Topology) -> LatLonPartition:
        """Where a rank's activations sit, for locating a first divergence: the lat x lon
        block of the rank in fme's h x w mesh, split as torch-harmonics splits (fme
        scatters its data with that split, ``get_local_slices``)."""
        cfg = self.config
        return LatLonPartition(cfg.nlat, cfg.nlon, cfg.h, cfg.w)

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


# ---------------------------------------------------------------------- fme's stepper


def _stepper(model: _FmeModel, cfg: FmeConfig, in_names: list[str], out_names: list[str]) -> Any:
    """fme's ``Stepper`` (``StepperConfig.get_stepper``, single-module step) for ``cfg``'s
    network, holding ``model``'s weights and buffers. Built under ``fork_rng``: the
    stepper's own network is drawn and discarded, and the rollout's noise must come from
    the RNG state the harness seeded, on the reference and on every rank alike."""
    import dataclasses
    import datetime

    from fme.ace.stepper.single_module import StepperConfig
    from fme.core.coordinates import HybridSigmaPressureCoordinate, LatLonCoordinates
    from fme.core.dataset_info import DatasetInfo
    from fme.core.normalizer import NetworkAndLossNormalizationConfig, NormalizationConfig
    from fme.core.registry.module import ModuleSelector
    from fme.core.step import SingleModuleStepConfig, StepSelector

    names = sorted({*in_names, *out_names})
    step = SingleModuleStepConfig(
        builder=ModuleSelector(
            type="NoiseConditionedSFNO", config=dataclasses.asdict(cfg.builder())
        ),
        in_names=in_names,
        out_names=out_names,
        # the seed golden's normalization: not the identity, so normalizing is exercised
        normalization=NetworkAndLossNormalizationConfig(
            network=NormalizationConfig(
                means=dict.fromkeys(names, 0.1), stds=dict.fromkeys(names, 1.1)
            )
        ),
    )
    lat, lon = _lat_lon_degrees(cfg)
    info = DatasetInfo(
        horizontal_coordinates=LatLonCoordinates(lat=lat, lon=lon),
        vertical_coordinate=HybridSigmaPressureCoordinate(
            ak=torch.arange(7, dtype=torch.float32), bk=torch.arange(7, dtype=torch.float32)
        ),
        timestep=datetime.timedelta(hours=6),
    )
    config = StepperConfig(step=StepSelector(type="single_module", config=dataclasses.asdict(step)))
    with torch.random.fork_rng():
        stepper = config.get_stepper(info)
    (module,) = stepper.modules  # fme's wrapped network: DDP or its DummyWrapper
    module.load_state_dict(model.wrapped.state_dict())  # a checkpoint of the harness's net
    module.train(model.training)
    return stepper


def _rollout_data(batch: dict[str, torch.Tensor], prognostic: list[str], steps: int) -> Any:
    """The rollout's global ``BatchData`` from step 0's batch: the prognostic variables'
    initial condition is ``x``'s channels 1..; the forcing turns from ``x``'s channel 0
    to ``y``'s over the steps (a new forcing every step, so a stale one shows)."""
    import numpy as np
    import xarray as xr
    from fme.ace.data_loading.batch_data import BatchData

    x, y = batch["x"], batch["y"]
    angle = 0.5 * torch.arange(steps + 1, dtype=x.dtype)[None, :, None, None]
    forcing = torch.cos(angle) * x[:, None, 0] + torch.sin(angle) * y[:, None, 0]
    data = {"forcing": forcing}
    for i, name in enumerate(prognostic, start=1):
        data[name] = x[:, None, i].expand(-1, steps + 1, -1, -1).contiguous()
    time = xr.DataArray(np.zeros((x.shape[0], steps + 1)), dims=["sample", "time"])
    return BatchData.new_on_device(data=data, time=time, horizontal_dims=["lat", "lon"])


def _draw_noise_weights(net: torch.nn.Module, std: float) -> None:
    """Give fme's zero-initialised noise conditioning trained-like weights. From a private
    generator: the same on every rank (the weights are replicated) and the seeded RNG
    stream the noise draws from stays as it was."""
    generator = torch.Generator().manual_seed(20_261_010)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".W_scale_2d." in name or ".W_bias_2d." in name:
                p.copy_(std * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def _load_envelope(net: torch.nn.Module, envelope: tuple[float, float]) -> None:
    """Put a trained checkpoint's latent-mean envelope into fme's buffers."""
    low, high = envelope
    for name, b in net.named_buffers():
        if name.endswith("_gm_min"):
            b.fill_(low)
        elif name.endswith("_gm_max"):
            b.fill_(high)


def _lat_lon_degrees(cfg: FmeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's latitudes and longitudes in degrees (fme's area weights follow them)."""
    import numpy as np

    if cfg.grid == "legendre-gauss":
        lat = np.degrees(np.arcsin(np.polynomial.legendre.leggauss(cfg.nlat)[0]))
    else:
        lat = np.linspace(90.0, -90.0, cfg.nlat)
    lon = np.arange(cfg.nlon) * 360.0 / cfg.nlon
    return torch.tensor(lat.copy(), dtype=torch.float32), torch.tensor(lon, dtype=torch.float32)


# ---------------------------------------------------------------------- fme's global state


def _install_backend(topo: Topology, cfg: FmeConfig) -> Any:
    """fme's ``Distributed`` singleton for this run: ``NonDistributed`` for the reference,
    ``ModelTorchDistributed(h, w)`` on the harness's world for the ranks; each change is
    pushed onto ``harness.adopt``'s undo stack."""
    from fme.core.distributed import distributed as fme_distributed
    from fme.core.distributed.distributed import Distributed
    from fme.core.distributed.external.pnd_manager import DistributedManager

    from harness._compat import reset_torch_harmonics_groups, restore_transposes

    saved = (fme_distributed.singleton, Distributed._entered)

    def restore_singleton() -> None:
        setattr(fme_distributed, "singleton", saved[0])  # noqa: B010
        Distributed._entered = saved[1]

    on_undo(restore_singleton)
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
        # fme's manager then skips init_process_group (and never destroys the harness's)
        adopt_distributed_manager(topo, DistributedManager)
        on_undo(_undo_fme_side_effects)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Distributed manager is already initialized")
            instance._distributed = ModelTorchDistributed(h_size=cfg.h, w_size=cfg.w)
    setattr(fme_distributed, "singleton", instance)  # noqa: B010
    Distributed._entered = True
    return instance


def _undo_fme_side_effects() -> None:
    """What ``ModelTorchDistributed.__init__`` changes beyond the manager: its gloo
    ``all_to_all`` patch and torch-harmonics' groups (``thd.init``)."""
    from fme.core.distributed import _gloo_patch

    from harness._compat import reset_torch_harmonics_groups

    if _gloo_patch._original_all_to_all is not None:
        torch.distributed.all_to_all = _gloo_patch._original_all_to_all
        _gloo_patch._original_all_to_all = None
    reset_torch_harmonics_groups()


def _check_groups(backend: Any, topo: Topology, cfg: FmeConfig) -> None:
    """fme built its groups from its own (data, h, w) mesh: they must hold the ranks the
    harness partitions for (the spatial and data groups, and the rows and columns of the
    h x w grid as ``Topology.grid`` lays them out). As sets: fme places its blocks by its own
    group ranks and reports them by global position, so an order of its own is no error."""
    base = topo.data_rank * topo.spatial_size
    p, a = divmod(topo.spatial_rank, cfg.w)
    check_group(backend._spatial_group, topo, "fme's spatial group", of="spatial")
    check_group(backend._data_group, topo, "fme's data group", of="data")
    polar = [base + i * cfg.w + a for i in range(cfg.h)]
    check_group(backend._h_group, topo, "fme's h (polar) group", of=polar)
    azimuth = [base + p * cfg.w + j for j in range(cfg.w)]
    check_group(backend._w_group, topo, "fme's w (azimuth) group", of=azimuth)


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


#: the names fme's atmosphere corrector gives the output channels (channel 0 first)
_CORRECTED_NAME = "tendency_of_total_water_path_due_to_advection"


def _correct(out: torch.Tensor, options: dict[str, Any], ops: Any) -> torch.Tensor:
    """fme's ``AtmosphereCorrector`` (built by its config, as the stepper builds it) applied to
    the output's channels, as a dict of named fields, then stacked back."""
    import datetime

    from fme.core.corrector.atmosphere import AtmosphereCorrectorConfig

    corrector = AtmosphereCorrectorConfig(**options)._build(ops, None, datetime.timedelta(hours=6))
    names = [_CORRECTED_NAME] + [f"var{i}" for i in range(1, out.shape[1])]
    gen = {name: out[:, i] for i, name in enumerate(names)}
    corrected = corrector({}, gen, {}, None).corrected
    return torch.stack([corrected[name] for name in names], dim=1)


# ---------------------------------------------------------------------- faults


def _patch_faults(faults: tuple[str, ...]) -> None:
    """Break fme's own distributed path the way each fault says, on this rank only (undone
    by ``teardown``)."""
    from fme.core.distributed import _gloo_patch, model_torch_distributed
    from fme.core.distributed.model_torch_distributed import (
        ModelTorchDistributed,
        _AutogradAllReduce,
    )

    cls = ModelTorchDistributed
    on_undo(_FAULT_GROUPS.clear)
    if "no-spatial-grad-hooks" in faults:
        patch(cls, "_register_spatial_grad_hooks", lambda self, module: None)
    if "reduce-sum-no-allreduce" in faults:
        patch(cls, "spatial_reduce_sum", lambda self, tensor: tensor)
    if "reduce-sum-summed-backward" in faults:

        def summed_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            grad = grad.clone()
            torch.distributed.all_reduce(grad, group=_FAULT_GROUPS[0])
            return grad, None

        original_reduce = cls.spatial_reduce_sum

        def reduce_sum(self: Any, tensor: torch.Tensor) -> torch.Tensor:
            _FAULT_GROUPS[:] = [self._spatial_group]
            reduced: torch.Tensor = original_reduce(self, tensor)
            return reduced

        patch(cls, "spatial_reduce_sum", reduce_sum)
        patch(_AutogradAllReduce, "backward", staticmethod(summed_backward))
    if "slices-swapped" in faults:
        original = cls._get_local_spatial_shape

        def mirrored(self: Any, h: int, w: int) -> Any:
            self._h_rank, saved = self._h_size - 1 - self._h_rank, self._h_rank
            try:
                return original(self, h, w)
            finally:
                self._h_rank = saved

        patch(cls, "_get_local_spatial_shape", mirrored)
    if "all-to-all-peer-order" in faults:
        exchange = _gloo_patch._gloo_all_to_all

        def misfiled(outputs: list[torch.Tensor], inputs: list[torch.Tensor], **kw: Any) -> None:
            exchange(outputs, inputs, **kw)
            received = [t.clone() for t in outputs]
            for i, out in enumerate(outputs):
                nxt = received[(i + 1) % len(received)]
                if nxt.shape == out.shape:
                    out.copy_(nxt)

        patch(_gloo_patch, "_gloo_all_to_all", misfiled)
    if "no-gloo-alltoall-patch" in faults:
        patch(model_torch_distributed, "patch_gloo_alltoall", lambda: None)
    if "mesh-data-innermost" in faults:
        from fme.core.distributed.external.pnd_manager import DistributedManager
        from torch.distributed.device_mesh import DeviceMesh

        def data_innermost(self: Any, mesh_shape: Any, mesh_dim_names: Any) -> Any:
            _, h, w = mesh_shape  # fme asks for (-1, h, w) named ("data", "h", "w")
            d = self.world_size // (h * w)
            ranks = torch.arange(self.world_size).reshape(h, w, d).permute(2, 0, 1)
            self._global_mesh = DeviceMesh("cpu", ranks, mesh_dim_names=mesh_dim_names)
            self._mesh_dims = dict(zip(mesh_dim_names, (d, h, w), strict=True))
            return self._global_mesh

        patch(DistributedManager, "initialize_mesh", data_innermost)
    if "inference-stale-forcing" in faults:
        from fme.ace.stepper.single_module import Stepper

        generate = Stepper.predict_generator

        def stale_forcing(self: Any, ic: Any, forcing: Any, *args: Any, **kw: Any) -> Any:
            first = {k: v[:, :1].expand_as(v) for k, v in forcing.items()}
            return generate(self, ic, first, *args, **kw)

        patch(Stepper, "predict_generator", stale_forcing)
    if "inference-noise-per-rank" in faults:
        from fme.ace.registry import stochastic_sfno
        from fme.core.rand import use_generator

        draw = stochastic_sfno.isotropic_noise

        def per_rank(*args: Any, **kw: Any) -> torch.Tensor:
            if torch.is_grad_enabled():  # training draws as fme does
                noise: torch.Tensor = draw(*args, **kw)
                return noise
            seeded = torch.Generator().manual_seed(torch.distributed.get_rank())
            with use_generator(seeded):
                noise = draw(*args, **kw)
            return noise

        patch(stochastic_sfno, "isotropic_noise", per_rank)


_FAULT_GROUPS: list[Any] = []


# ---------------------------------------------------------------------- the main job


Config = tuple[str, Callable[..., SpatialCase], dict[str, Any], "int | None"]


def main_configs(ranks: int) -> list[Config]:
    """(label, factory, kwargs, spatial_size) for ``harness-check --model fme``: layouts of
    fme's noise-conditioned SFNO (isotropic noise) that ``ranks`` ranks can hold.

    The spatial x data layout runs without noise: the reference draws the whole global
    batch's noise in one call, a data group only its share from the same RNG state, so the
    samples' noise cannot agree (a harness limit, see NOTES; not an fme bug).
    """
    if ranks == 4:
        return [
            ("fme 2x2", FmeCase, {"h": 2, "w": 2}, None),
            ("fme 4x1 uneven", FmeCase, {"nlat": 10, "h": 4, "w": 1}, None),
            (
                "fme 1x4 uneven equiangular",
                FmeCase,
                {"nlon": 18, "h": 1, "w": 4, "grid": "equiangular"},
                None,
            ),
            (
                "fme 2x1 x 2 data",
                FmeCase,
                {"h": 2, "w": 1, "batch_size": 4, "noise_embed_dim": 0},
                2,
            ),
        ]
    if ranks == 1:
        return [("fme 1x1", FmeCase, {"h": 1, "w": 1}, None)]
    configs = [_config(ranks, 1), _config(1, ranks)]
    if ranks % 2 == 0 and ranks > 2:
        configs.append(_config(2, ranks // 2))
        configs.append(_config(ranks // 2, 1, data=2))
    return configs


def _config(h: int, w: int, data: int = 1) -> Config:
    """A main-job layout for an h x w grid (times ``data`` data groups): grid sizes that no
    process count divides (uneven blocks, none empty: torch-harmonics' split rule), and at
    least as many latent and noise channels as ranks in a direction (its distributed
    transposes split channels over the h and w groups and refuse fewer channels than ranks).
    With data groups the noise is off (see ``main_configs``)."""
    from harness.partition import split_sizes

    nlat = max(8, 2 * h + 1) + (1 if h > 1 and max(8, 2 * h + 1) % h == 0 else 0)
    nlon = max(16, 4 * w + 2) + (2 if w > 2 and max(16, 4 * w + 2) % w == 0 else 0)
    options: dict[str, Any] = {
        "h": h,
        "w": w,
        "nlat": nlat,
        "nlon": nlon,
        "embed_dim": max(8, h, w),
        "noise_embed_dim": 0 if data > 1 else max(4, h, w),
        "batch_size": 2 * data,
    }
    uneven = len(set(split_sizes(nlat, h))) > 1 or len(set(split_sizes(nlon, w))) > 1
    label = f"fme {h}x{w}" + (" uneven" if uneven else "") + (f" x {data} data" if data > 1 else "")
    return label, FmeCase, options, (h * w if data > 1 else None)


def fault_matrix(ranks: int) -> Iterator[tuple[str, Any, dict[str, Any], Any, str, set[str]]]:
    """Each fault of ``FME_FAULTS`` on a 2x2 layout, with the quantities that must catch it."""
    if ranks != 4:
        return
    expected = {
        "no-spatial-grad-hooks": {"grad", "sync"},
        "reduce-sum-no-allreduce": {"loss", "grad"},
        "reduce-sum-summed-backward": {"grad"},
        "slices-swapped": {"field", "loss"},
        "all-to-all-peer-order": {"field", "loss"},
        "no-gloo-alltoall-patch": {"error"},
    }
    for fault in expected:
        yield "fme", FmeCase, {"h": 2, "w": 2}, None, fault, expected[fault]
    # harness.adopt.check_group refuses the layout in build, on every rank, in one line
    data = {"h": 2, "w": 1, "batch_size": 4, "noise_embed_dim": 0}
    yield "fme", FmeCase, data, 2, "mesh-data-innermost", {"error"}
