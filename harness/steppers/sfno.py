"""An SFNO-style stepper: one model code path for the reference and a lat x lon partitioned run.

Pointwise encoder -> per block [global-mean conditioning, real SHT, spectral filter, inverse
SHT, pointwise MLP, residual] -> pointwise decoder, residual on the state. The reference
(``Topology.single()``) uses torch-harmonics' ``RealSHT``; a partitioned run splits the grid
over an ``h`` (polar) x ``w`` (azimuth) process grid and uses ``DistributedRealSHT``.

Sharding through one block (torch-harmonics 0.8.0, read from ``distributed_sht.py``):

- grid space ``(B, E, nlat_local, nlon_local)``: latitudes split over the polar group and
  longitudes over the azimuth group, both with ``split_sizes`` (the SHT's rule);
- spectral space ``(B, E, l_local, m_local)``: degrees ``l`` split over the polar group,
  orders ``m`` over the azimuth group, same rule; triangular truncation
  ``lmax = mmax = min(nlat - 1, nlon // 2 + 1)``, explicit so both torch-harmonics agree.

In between, the SHT's transposes split the ``E`` channels over each group, and 0.8.0 cannot
split fewer channels than ranks: ``embed >= max(h, w)`` is required (checked). Its transposes
use ``dist.all_to_all``, which gloo refuses for chunks of unequal shape, so on the ranks they
are routed through ``all_to_all_single`` (``harness._base.compat.use_uneven_transposes``; same
numbers).

Under ``torch.autocast`` the SHT and its inverse (serial and distributed) run in float32 with
autocast off, as makani's and fme's SFNOs run theirs; the pointwise layers stay under
autocast. Outside autocast nothing changes: float32 and float64 runs are bit-identical.

Everything that must be identical on every rank is made so by construction: parameters are
full size on every rank (the spectral weights are sliced to the rank's (l, m) modes in
forward), noise is drawn for the whole globe and batch from one seeded generator and sliced,
the area weights are the global quadrature weights sliced to the rank's latitudes. The global
mean of the conditioning is a ``spatial_sum`` (summed backward); the loss's sums go through
``reduce_loss`` (identity backward) and parameter gradients are summed by ``sync_gradients``.

``faults=`` switches on the SFNO bugs of FAULTS.md, each in the code path where that bug
really lives (loss reduction, conditioning, gradient hooks, forward, data partition, noise
generator); ``FAULT_CHECKS`` says which quantity catches each, on which layout. The
configuration, the fault tables and the grid's geometry are ``_sfno_config``; the layers that
never communicate, ``_sfno_layers``; every collective of the stepper is issued here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from harness._base.compat import restore_transposes, use_uneven_transposes
from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.collectives import apply, reduce_gradient, reduce_loss, spatial_sum, sync_gradients
from harness.errors import ConfigError
from harness.partition import LatLonPartition
from harness.steppers._sfno_config import (
    FAULT_CHECKS,
    GRIDS,
    INFERENCE_CHECKS,
    SFNO_FAULTS,
    SHARD_FAULTS,
    SHARD_INITS,
    SFNOConfig,
    _offset_slice,
    _triangular,
    _truncation,
    check_faults,
    data_partition,
    lat_weights,
)
from harness.steppers._sfno_layers import Pointwise, SpectralFilter
from harness.topology import Topology

__all__ = [
    "FAULT_CHECKS",
    "GRIDS",
    "INFERENCE_CHECKS",
    "SFNO_FAULTS",
    "SHARD_FAULTS",
    "SHARD_INITS",
    "Pointwise",
    "SFNOCase",
    "SFNOConfig",
    "SFNOStepper",
    "SpectralFilter",
    "TrainOutput",
    "check_faults",
    "data_partition",
    "lat_weights",
]

# ---------------------------------------------------------------------- layers


class _MeanOverGroup(torch.autograd.Function):
    """Forward: all-reduce SUM over ``group``, divided by ``n``. Backward: identity."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: ProcessGroup | None, n: int
    ) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / n  # replicated over the group

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # each data group back-propagates its own loss; the gradient hooks average over the
        # data group, which is the derivative of this mean
        return grad, None, None


# ---------------------------------------------------------------------- the stepper


@dataclass
class TrainOutput:
    """What ``train_on_batch`` returns: the global loss and the autoregressive predictions
    ``(B, forward_steps, C, nlat_local, nlon_local)``."""

    loss: torch.Tensor
    prediction: torch.Tensor


class SFNOStepper(nn.Module):
    """The SFNO-style network plus its loss, gradient sync and stepping, for one topology.

    ``forward(state)`` is one model step ``(B, C, lat, lon) -> (B, C, lat, lon)`` on this
    rank's block; ``train_on_batch`` and ``predict`` are the ACE-like stepper API.
    """

    area_weights: torch.Tensor
    sht: Any  # torch-harmonics transforms: lmax, mmax (and l_shapes, m_shapes when split)
    isht: Any

    def __init__(self, config: SFNOConfig, topo: Topology) -> None:
        super().__init__()
        cfg = self.config = config
        self.topo = topo
        self.faults = config.faults
        h, w = self.h, self.w = config.process_grid(topo)
        p, a = self.grid_position = topo.grid_position(h, w)
        self.partition = data_partition(config, h, w)
        self.lat_slice, self.lon_slice = self.partition.slices(p * w + a)

        self.sht, self.isht = _make_transforms(cfg, topo, h, w)
        lmax, mmax = self.sht.lmax, self.sht.mmax
        l_slice, m_slice = self._mode_slices(p, a)

        # global and replicated: the same buffer (name, shape, values) on every rank
        self.register_buffer(
            "area_weights",
            lat_weights(cfg.nlat, cfg.grid).to(torch.get_default_dtype()),
            persistent=False,
        )
        self.area_total = float(self.area_weights.sum()) * cfg.nlon

        self.encoder = Pointwise(cfg.channels + cfg.noise, cfg.embed)
        # a wrong l range: the first l_local modes, whichever the rank owns
        held = slice(0, l_slice.stop - l_slice.start) if "shard-wrong-l" in self.faults else None
        self.filters = nn.ModuleList(
            SpectralFilter(
                cfg.embed,
                lmax,
                mmax,
                l_slice,
                m_slice,
                sharded=cfg.shard_weights,
                held=held,
                generator=torch.Generator().manual_seed(cfg.noise_seed + 7919 * (b + 1) + topo.rank)
                if cfg.shard_init == "per-rank"
                else None,
            )
            for b in range(cfg.blocks)
        )
        self.mlps = nn.ModuleList(Pointwise(cfg.embed, cfg.embed, 0.5) for _ in range(cfg.blocks))
        # share of the global mean each block adds before its SHT, per channel (about -1/2:
        # half removed, a learned coupling of every point to the whole sphere)
        self.mean_gains = nn.Parameter(-0.5 + 0.1 * torch.randn(cfg.blocks, cfg.embed))
        self.decoder = Pointwise(cfg.embed, cfg.channels, 0.2)

        seed = cfg.noise_seed + (topo.rank if "per-rank-noise" in self.faults else 0)
        self.noise_generator = torch.Generator().manual_seed(seed)
        self.step_count = 0  # the rollout's step, which picks each step's forcing
        self._others: dict[int, torch.Tensor] = {}  # inference-cached-mean: per block
        self._sync_gradients(h, w)

    def _mode_slices(self, p: int, a: int) -> tuple[slice, slice]:
        """The l and m modes this rank owns at polar position ``p``, azimuth position ``a``."""
        lmax, mmax = self.sht.lmax, self.sht.mmax
        if self.topo.spatial_size > 1:  # the SHT's own split of the modes (polar: l, azimuth: m)
            l_slice = _offset_slice(self.sht.l_shapes, p)
            m_slice = _offset_slice(self.sht.m_shapes, a)
        else:
            l_slice, m_slice = slice(0, lmax), slice(0, mmax)
        if "m-slice-from-end" in self.faults and a > 0:
            # the bug: every azimuth rank after the first takes its orders counted back from
            # the last, as the second of a 2-way split may; a middle rank filters its modes
            # with other orders' weights
            m_slice = slice(mmax - (m_slice.stop - m_slice.start), mmax)
        return l_slice, m_slice

    def _sync_gradients(self, h: int, w: int) -> None:
        """Hook the gradient sync of this topology (or a fault's wrong one) on the parameters."""
        if "grad-sync-mean" in self.faults:
            _sync_gradients_mean(self, self.topo)
        elif "no-grad-sync" in self.faults:
            pass
        elif self.config.shard_weights:
            _sync_sharded_gradients(self, self.topo, h, w)
        else:
            sync_gradients(self, self.topo)

    # ------------------------------------------------------------ model step

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        if "buffer-broadcast" in self.faults:
            _broadcast_buffers(self, self.topo)
        x = state
        if self.config.noise:
            x = torch.cat([x, self.draw_noise(state.shape[0])], dim=-3)
        x = self.encoder(x)
        for block, (spectral, mlp, gain) in enumerate(
            zip(self.filters, self.mlps, self.mean_gains)
        ):
            # partial removal keeps the (0, 0) mode, whose gradient would otherwise be rounding
            y = x + gain[:, None, None] * self.global_mean(x, block)
            coeffs = _untouched_by_autocast(self.sht, y)  # (B, E, lat, lon) -> (B, E, l, m)
            y = _untouched_by_autocast(self.isht, spectral(coeffs))  # -> (B, E, lat, lon)
            x = x + mlp(F.gelu(y))
        out: torch.Tensor = state + self.decoder(x)
        return out

    def local_area_weights(self) -> torch.Tensor:
        """The area weights of this rank's latitudes."""
        if "band-start-from-own-size" in self.faults:
            # the bug: the band's first latitude is the polar index times this band's size,
            # right while every band has the same size
            n = self.lat_slice.stop - self.lat_slice.start
            start = self.grid_position[0] * n
            return self.area_weights[start : start + n]
        return self.area_weights[self.lat_slice]

    def global_mean(self, x: torch.Tensor, block: int = 0) -> torch.Tensor:
        """Area-weighted mean over the whole sphere, per sample and channel: (..., 1, 1)."""
        local = torch.einsum("...ij,i->...", x, self.local_area_weights())
        inference = not self.training
        if "eval-local-mean" in self.faults and inference:
            # the bug: in eval mode the "global" statistic is taken over this rank's block
            # (the shape of fme's clip_latent_global_means eval finding)
            area = self.local_area_weights().sum() * x.shape[-1]
            return (local / area)[..., None, None]
        if "inference-cached-mean" in self.faults and inference and block in self._others:
            # the bug: the other ranks' share of the sum, received at the first step, is
            # kept as a buffer and reused at every later step of the rollout
            return ((local + self._others[block]) / self.area_total)[..., None, None]
        if "coupling-identity-backward" in self.faults:
            total = reduce_loss(local, self.topo)  # the bug: other ranks' uses are not summed back
        else:
            total = spatial_sum(local, self.topo)  # replicated; backward summed over the group
        if "inference-cached-mean" in self.faults and inference:
            self._others[block] = total - local  # what the other ranks sent (0: the reference)
        return (total / self.area_total)[..., None, None]

    def draw_noise(self, batch_local: int) -> torch.Tensor:
        """Noise for this rank's samples and block, drawn for the whole globe and batch."""
        cfg, topo = self.config, self.topo
        if "noise-per-data-group" in self.faults:
            # the bug: each data group draws noise for its own samples from the shared seed,
            # so every group's samples get the first samples' noise
            full = torch.randn(
                (batch_local, cfg.noise, cfg.nlat, cfg.nlon), generator=self.noise_generator
            )
            return full[..., self.lat_slice, self.lon_slice]
        full = torch.randn(
            (batch_local * topo.data_size, cfg.noise, cfg.nlat, cfg.nlon),
            generator=self.noise_generator,
        )
        rows = data_share(batch_local * topo.data_size, topo)
        return full[rows, :, self.lat_slice, self.lon_slice]

    # ------------------------------------------------------------ loss

    def loss(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Area-weighted MSE over the globe and this data group's samples; replicated."""
        topo = self.topo
        weights = self.local_area_weights()
        if "local-weights" in self.faults:
            weights = self.area_weights[: weights.shape[0]]  # the bug: sliced from row 0
        err = (prediction - target) ** 2
        wsum = torch.einsum("...ij,i->", err, weights)
        wtot = weights.sum() * (err.numel() // err.shape[-2])  # every (sample, channel, lon)
        if "mean-of-means" in self.faults:
            loss = reduce_loss(wsum / wtot, topo) / topo.spatial_size
        elif "reduce-not-differentiable" in self.faults and topo.spatial_group is not None:
            # dist.all_reduce has no autograd: the reduced value is detached, so what the rank
            # back-propagates is its own local mean, spliced under the global value
            value = torch.stack([wsum.detach(), wtot.detach()])
            dist.all_reduce(value, group=topo.spatial_group)
            local = wsum / wtot
            loss = local + (value[0] / value[1] - local).detach()
        else:
            reduce = spatial_sum if "reduce-double-count" in self.faults else reduce_loss
            loss = reduce(wsum, topo) / reduce_loss(wtot, topo)  # this data group's loss
        return self.mean_over_data(loss)

    def mean_over_data(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the data groups: the global loss, replicated on every rank."""
        topo = self.topo
        if topo.data_group is None:
            return loss
        group: dist.ProcessGroup | None = topo.data_group
        if "reduce-over-world" in self.faults:
            group = dist.group.WORLD  # the bug: S replicas of each data group's loss summed
        return apply(_MeanOverGroup, loss, group, topo.data_size)

    # ------------------------------------------------------------ stepper API

    def train_on_batch(
        self, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None = None
    ) -> TrainOutput:
        """``forward_steps`` autoregressive steps from ``batch["state"][:, 0]``.

        The loss is the mean of the steps' losses against ``batch["state"][:, 1:]``. With an
        ``optimizer``, also zero the gradients, back-propagate and step.
        """
        state = batch["state"]
        n = self.config.forward_steps
        if state.shape[1] != n + 1:
            raise ConfigError(
                f"batch['state'] has {state.shape[1]} times; {n} forward steps need {n + 1}"
            )
        x, losses, predictions = state[:, 0], [], []
        for t in range(1, n + 1):
            x = self(x)
            losses.append(self.loss(x, state[:, t]))
            predictions.append(x)
        loss = torch.stack(losses).mean()
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return TrainOutput(loss, torch.stack(predictions, dim=1))

    @torch.no_grad()
    def predict(
        self, initial: torch.Tensor, n_steps: int, forcing: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Roll out ``n_steps`` from ``initial`` (B, C, lat, lon): (B, n_steps, C, lat, lon).

        ``forcing`` (B, n_steps, C, lat, lon), this rank's block: added to the state before
        each step, the one of the step the stepper's counter is at.
        """
        x, out = initial, []
        self.step_count = 0
        if "inference-noise-per-rank" in self.faults and not self.training:
            # the bug: each ensemble inference draws its noise from a generator seeded with
            # the rank (rank 0's is the reference's; the others' tiles see other noise)
            seed = self.config.noise_seed + self.topo.rank
            self.noise_generator = torch.Generator().manual_seed(seed)
        for _ in range(n_steps):
            if forcing is not None:
                x = x + forcing[:, self.step_count]
            x = self(x)
            out.append(x)
            if "step-counter-per-rank" not in self.faults or self.topo.spatial_rank == 0:
                # the bug: only the group's first rank (the one that logs) advances the
                # counter; the others keep applying step 0's forcing
                self.step_count += 1
        return torch.stack(out, dim=1)

    def scatter(self, field: torch.Tensor) -> torch.Tensor:
        """This rank's block of a global (..., nlat, nlon) field."""
        return field[..., self.lat_slice, self.lon_slice]

    def shard(self, local: torch.Tensor) -> Shard | torch.Tensor:
        """``local`` as a Shard of the global grid (the reference's full field as is)."""
        if self.topo.spatial_group is None:
            return local
        return Shard.grid(local, self.lat_slice, self.lon_slice, self.config.nlat, self.config.nlon)


def _untouched_by_autocast(transform: Any, x: torch.Tensor) -> torch.Tensor:
    """``transform(x)``; under autocast, with autocast off and ``x`` at least float32
    (complex64), as production SFNOs run their SHTs (makani's ``SpectralConv`` and fme's
    ``SpectralConvS2`` wrap both transforms in ``autocast(enabled=False)`` on a float32 input).

    The transforms' contractions are quadratures over every latitude: in bfloat16 they lose
    the coefficients' low bits, and torch-harmonics 0.9's compiled SHT cannot build a complex
    tensor from bfloat16 halves at all. Outside autocast this calls ``transform(x)`` as is,
    so float32 and float64 runs (and their goldens) are untouched.
    """
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return cast(torch.Tensor, transform(x))
    with torch.autocast(device, enabled=False):
        return cast(torch.Tensor, transform(x.to(torch.promote_types(x.dtype, torch.float32))))


def _make_transforms(cfg: SFNOConfig, topo: Topology, h: int, w: int) -> tuple[Any, Any]:
    """Serial SHT pair for one spatial rank, torch-harmonics' distributed pair otherwise."""
    if topo.spatial_size == 1:
        import torch_harmonics as th

        return (
            th.RealSHT(cfg.nlat, cfg.nlon, **_truncation(cfg)),
            th.InverseRealSHT(cfg.nlat, cfg.nlon, **_truncation(cfg)),
        )
    import torch_harmonics.distributed as thd

    use_uneven_transposes()  # torch-harmonics 0.8 on gloo: see harness._base.compat
    # The distributed SHT reads its groups from module globals, at build and in every
    # forward: set them on this rank (the rank pool resets them after each run).
    thd.init(*topo.grid(h, w))
    return (
        thd.DistributedRealSHT(cfg.nlat, cfg.nlon, **_truncation(cfg)),
        thd.DistributedInverseRealSHT(cfg.nlat, cfg.nlon, **_truncation(cfg)),
    )


def _sync_sharded_gradients(stepper: SFNOStepper, topo: Topology, h: int, w: int) -> None:
    """Gradient hooks with sharded spectral weights: a weight's l slice is shared only by the
    azimuth group (the ranks with the same l modes), so its gradient is summed there; every
    other parameter is replicated and summed over the whole spatial group. Then the mean
    over the data groups, as ``sync_gradients`` does."""
    if topo.spatial_group is None and topo.data_group is None:
        return
    _, azimuth = topo.grid(h, w)
    sliced = (azimuth, w)
    if "shard-grad-replicated" in stepper.faults:
        sliced = (topo.spatial_group, topo.spatial_size)  # the bug: summed as if replicated
    shards = {id(f.weight) for f in stepper.filters}
    for param in stepper.parameters():
        group, size = sliced if id(param) in shards else (topo.spatial_group, topo.spatial_size)
        param.register_hook(_reduce_over(group, size, topo))


def _reduce_over(
    group: ProcessGroup | None, size: int, topo: Topology
) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)  # own it (may be a view)
        if group is not None and size > 1:
            dist.all_reduce(grad, group=group)  # summed over the ranks holding this parameter
        if topo.data_group is not None and topo.data_size > 1:
            dist.all_reduce(grad, group=topo.data_group)
            grad.div_(topo.data_size)  # replicated: the mean over data groups
        return grad

    return reduce


def _sync_gradients_mean(module: nn.Module, topo: Topology) -> None:
    """The ``grad-sync-mean`` fault: gradients averaged, not summed, over the spatial group."""

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            reduce_gradient(param.grad, topo)
            param.grad.div_(topo.spatial_size)  # the bug

    if topo.spatial_group is None:
        return
    for param in module.parameters():
        param.register_post_accumulate_grad_hook(hook)


def _broadcast_buffers(module: nn.Module, topo: Topology) -> None:
    """The ``buffer-broadcast`` fault: DDP's ``broadcast_buffers=True`` before each forward.

    Spatial rank 0's buffers are copied in place over every rank's, as DDP does for
    replicated buffers; but the SHT's Legendre tables are m-sliced per azimuth rank.
    """
    if topo.spatial_group is None:
        return
    src = topo.spatial_ranks[0]
    for buf in module.buffers():
        incoming = buf.detach().clone()
        dist.broadcast(incoming, src=src, group=topo.spatial_group)
        with torch.no_grad():
            buf.copy_(incoming)  # in place: bumps the version autograd saved for backward


# ---------------------------------------------------------------------- the case


class SFNOCase(SpatialCase):
    """The SFNO stepper as a ``SpatialCase``: ``check_equivalence(SFNOCase(...), ranks=4)``.

    Each step's batch is ``forward_steps + 1`` states of ``batch_size`` samples on the
    whole globe (data groups get equal shares); fields compared are the autoregressive
    predictions of ``train_on_batch`` and a ``rollout``-step ``predict``.
    """

    name = "sfno"
    mesh_dims = 2  # h (polar) x w (azimuth)

    def __init__(
        self,
        nlat: int = 16,
        nlon: int = 32,
        h: int | None = None,
        w: int | None = None,
        *,
        grid: str = "equiangular",
        channels: int = 2,
        embed: int = 8,
        blocks: int = 2,
        batch_size: int = 2,
        noise: int = 0,
        rollout: int = 2,
        dtype: torch.dtype = torch.float64,
        faults: str | Iterable[str] = (),
        shard_weights: bool = False,
        shard_init: str = "sliced",
        load_reference_shards: bool = False,
    ) -> None:
        self.config = SFNOConfig(
            nlat=nlat,
            nlon=nlon,
            grid=grid,
            h=h,
            w=w,
            channels=channels,
            embed=embed,
            blocks=blocks,
            noise=noise,
            faults=check_faults(faults),
            shard_weights=shard_weights,
            shard_init=shard_init,
        )
        self.batch_size, self.rollout, self.dtype = batch_size, rollout, dtype
        self.load_reference_shards = load_reference_shards

    def build(self, topo: Topology) -> nn.Module:
        return SFNOStepper(self.config, topo)

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        cfg = self.config
        h, w = cfg.process_grid(topo)
        p, a = topo.grid_position(h, w)
        lats, lons = data_partition(cfg, h, w).slices(p * w + a)
        # the whole globe and batch, drawn identically everywhere, then this rank's share
        times = cfg.forward_steps + 1
        state = torch.randn(self.batch_size, times, cfg.channels, cfg.nlat, cfg.nlon)
        return {"state": state[data_share(self.batch_size, topo), ..., lats, lons]}

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], topo: Topology) -> Outputs:
        stepper = cast(SFNOStepper, model)
        out = stepper.train_on_batch(batch)
        fields = {"prediction": stepper.shard(out.prediction.detach())}
        if self.rollout:
            rollout = stepper.predict(batch["state"][:, 0], self.rollout)
            fields["rollout"] = stepper.shard(rollout)
        return Outputs(out.loss, fields)

    def predict(
        self, model: nn.Module, batch: dict[str, torch.Tensor], topo: Topology, steps: int
    ) -> list[dict[str, Shard | torch.Tensor]]:
        """An autoregressive rollout from the batch's first state, forced at each step by a
        travelling, insolation-like pattern; each step's state."""
        stepper = cast(SFNOStepper, model)
        forcing = stepper.scatter(self.forcing(steps))[: batch["state"].shape[0]]
        rollout = stepper.predict(batch["state"][:, 0], steps, forcing)
        return [{"state": stepper.shard(rollout[:, k])} for k in range(steps)]

    def forcing(self, steps: int) -> torch.Tensor:
        """``0.1 cos(lat) cos(lon - 2 pi k / 8)`` on the whole globe for step ``k``, every
        sample and channel: ``(batch, steps, channels, nlat, nlon)``."""
        cfg = self.config
        lat = torch.linspace(torch.pi / 2, -torch.pi / 2, cfg.nlat)
        lon = torch.arange(cfg.nlon) * 2 * torch.pi / cfg.nlon
        phase = torch.arange(steps) * 2 * torch.pi / 8
        wave = torch.cos(lon[None, :] - phase[:, None])  # (steps, nlon)
        field = 0.1 * torch.cos(lat)[None, :, None] * wave[:, None, :]  # (steps, nlat, nlon)
        return field[None, :, None].expand(self.batch_size, steps, cfg.channels, -1, -1)

    def parameter_shards(self, model: nn.Module, topo: Topology) -> dict[str, Shard]:
        """With ``shard_weights``: each spectral weight as the rank's l modes (dim 1) of the
        reference's weight. The reference's weights are whole."""
        stepper = cast(SFNOStepper, model)
        if not self.config.shard_weights or topo.spatial_group is None:
            return {}
        filters = cast(list[SpectralFilter], list(stepper.filters))
        return {f"filters.{i}.weight": Shard(f.weight, f.l_slice, 1) for i, f in enumerate(filters)}

    def partition(self, topo: Topology) -> list[LatLonPartition]:
        """The grid's blocks, and the modes' (l over the polar ranks, m over the azimuth
        ranks, by the SHT's own split): where a rank's fields and coefficients sit."""
        cfg = self.config
        h, w = cfg.process_grid(topo)
        modes = _triangular(cfg.nlat, cfg.nlon)
        return [data_partition(cfg, h, w), LatLonPartition(modes, modes, h, w)]

    def teardown(self, model: nn.Module | None, topo: Topology) -> None:
        restore_transposes()  # the next test's model may bring its own gloo transposes

    def describe(self, topo: Topology | None = None) -> str:
        cfg = self.config
        text = f"{cfg.grid} {cfg.nlat}x{cfg.nlon}"
        if topo is None or topo.spatial_group is None:
            return text
        h, w = cfg.process_grid(topo)
        part = data_partition(cfg, h, w)
        text += f" on {h}x{w} (lat {part.lat_sizes} x lon {part.lon_sizes})"
        return text + (", spectral weights sharded over l" if cfg.shard_weights else "")
