"""fme's model as ``FmeCase`` builds it: ``FmeConfig`` (the options of fme's
``NoiseConditionedSFNOBuilder`` and the h x w partition) and ``_FmeModel`` (the network with
what fme's ``wrap_module`` made of it). Nothing here imports fme until a builder is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
