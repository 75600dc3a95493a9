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

Beside the case: its options and network in ``_fme_model``, fme's global state in
``_fme_backend``, the faults in ``_fme_faults`` and fme's ``Stepper`` for ``predict`` in
``_fme_rollout``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from harness.adopt import pending, undo
from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.contrib._fme_backend import _check_groups, _install_backend
from harness.contrib._fme_faults import FME_FAULTS, INFERENCE_FAULTS, _patch_faults
from harness.contrib._fme_model import FmeConfig, _FmeModel
from harness.contrib._fme_rollout import _load_envelope, _rollout_data, _stepper
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


# ---------------------------------------------------------------------- the network and the grid


def _draw_noise_weights(net: torch.nn.Module, std: float) -> None:
    """Give fme's zero-initialised noise conditioning trained-like weights. From a private
    generator: the same on every rank (the weights are replicated) and the seeded RNG
    stream the noise draws from stays as it was."""
    generator = torch.Generator().manual_seed(20_261_010)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".W_scale_2d." in name or ".W_bias_2d." in name:
                p.copy_(std * torch.randn(p.shape, generator=generator, dtype=p.dtype))


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
