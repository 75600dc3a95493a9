"""fme's ``Stepper`` around the network ``FmeCase`` built, and the data ``FmeCase.predict``
rolls out through it (fme's own inference path): the stepper holding the harness's weights,
the global ``BatchData`` of a rollout, a checkpoint's latent-mean envelope, the grid's
coordinates."""

from __future__ import annotations

from typing import Any

import torch

from harness.contrib._fme_model import FmeConfig, _FmeModel


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
