"""A HEALPix encoder/decoder stepper: one model code path for the reference and a
cell-partitioned run.

Spatial rank ``r`` owns the NESTED cells ``bounds[r]:bounds[r+1]`` of a ``CellPartition``
(ranges may be empty). One training step, and the sharding after each stage:

1. assimilation: each observation ``(lat, lon, values)`` falls in the cell ``cell_of`` gives
   it; a rank embeds the observations of its own cells (per-observation MLP) and pools them
   per (sample, cell) with a mean; a cell without observations gets a learned empty token.
   Sharded: ``(B, n_local, H)``.
2. encoder: a per-cell MLP plus a learned per-cell embedding (full size on every rank, the
   rank's rows used). Sharded.
3. the latent is gathered over the spatial group (``all_gather_uneven``, autograd-aware).
   Replicated: ``(B, npix, H)`` in global cell order.
4. a global step (attention over all cells), computed identically on every rank. Replicated.
5. decoder: each owned cell is predicted from its 9-cell neighbourhood (self + 8 from
   ``CellPartition.neighbours()``, global cell ids, missing neighbours replaced by self).
   Sharded: ``(B, n_local, C)``.
6. predictions are flattened sample-major per rank, gathered with padding, stripped and
   put back in sample-major order: the forecast on the whole globe. Replicated.
7. loss: per sample, the squared-error sum and target count of the rank's cells, summed over
   the spatial group with ``reduce_loss``; the loss is the mean over samples of their
   masked MSE. Gradients: ``sync_gradients`` (sum over the spatial group, mean over the data
   group).

With ``tokens=T`` the forecast is reported as WeatherGenerator's decoder emits it: a varying
number of tokens (0..T, drawn per sample and cell with the batch) per (sample, cell), each
rank packing the tokens of its own cells sample-major in a ragged ``(items, C)`` tensor, as
``Shard.keyed(values, keys, cell_column=1)`` with ``(sample, cell, token)`` keys; the reference
packs the whole field cell-major, its own order, and ``token_order="shuffled"`` shuffles
each rank's packing. Token ``t`` of a cell is the cell's forecast plus ``0.1 * (t + 1)``.

A rank with no cells, no observations or no targets runs every module and every collective
on empty tensors, so its parameters get zero gradients, never ``None``. Before backward the
ranks check together that every parameter is in every rank's graph: the gradient hooks need
it, and a rank that left one out would leave the others waiting.

``faults=`` switches on the HEALPix bugs of FAULTS.md, each where that bug lives:
``HEALPIX_FAULTS`` lists them. Some need a private variant of a collective (a plain
``dist.all_gather``, a gather over the world, a group ranked in reverse). A neighbour table
with healpy's ``-1`` left in is not among them: the reference would read the same wrong
cell, so no equivalence check can see it; ``CellPartition.neighbours()`` replaces them and
its unit tests say so. The fault tables and those private collectives are
``_healpix_faults``; how observations are drawn and tokens keyed, ``_healpix_data``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from harness.case import Outputs, Shard, SpatialCase, data_share
from harness.collectives import all_gather_uneven, reduce_loss, sync_gradients
from harness.errors import ConfigError
from harness.partition import CellPartition, cell_of
from harness.steppers._healpix_data import PointSet, _features, _points_in, token_keys
from harness.steppers._healpix_faults import (
    DATA2,
    EVEN,
    FAULT_CHECKS,
    HEALPIX_FAULTS,
    INFERENCE_CHECKS,
    NO_CELLS,
    QUIET,
    TOKENS2,
    UNEVEN,
    _gather_keeping_padding,
    _gather_without_autograd,
    _over_world,
    _reversed_order,
    check_faults,
)
from harness.topology import Topology

__all__ = [
    "DATA2",
    "EVEN",
    "FAULT_CHECKS",
    "HEALPIX_FAULTS",
    "INFERENCE_CHECKS",
    "NO_CELLS",
    "QUIET",
    "TOKENS2",
    "UNEVEN",
    "HealpixCase",
    "HealpixStepper",
    "PointSet",
    "check_faults",
    "token_keys",
]


# ---------------------------------------------------------------------- the model


def _parameters_in_graph(root: torch.Tensor) -> set[int]:
    """ids of the leaf tensors ``root``'s autograd graph accumulates gradients into."""
    found: set[int] = set()
    seen: set[object] = set()  # autograd nodes
    stack = [root.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(f for f, _ in fn.next_functions)
    return found


class HealpixStepper(nn.Module):
    """The encoder/decoder network, its loss and its gradient sync, for one topology.

    ``partition`` is the spatial group's partition (one range, all cells, for the
    reference); this rank owns ``partition.cells(topo.spatial_rank)``.
    """

    def __init__(
        self,
        partition: CellPartition,
        topo: Topology,
        *,
        channels: int = 2,
        hidden: int = 8,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.partition, self.topo, self.faults = partition, topo, check_faults(faults)
        cells = partition.cells(topo.spatial_rank)
        self.lo, self.hi = cells.start, cells.stop
        self.hidden, self.channels = hidden, channels
        h = hidden

        self.obs_net = nn.Sequential(nn.Linear(channels + 3, h), nn.Tanh(), nn.Linear(h, h))
        self.empty_token = nn.Parameter(0.5 * torch.randn(h))
        self.cell_embedding = nn.Parameter(0.5 * torch.randn(partition.npix, h))
        self.encoder = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h))
        self.query = nn.Linear(h, h, bias=False)
        self.key = nn.Linear(h, h, bias=False)
        self.value = nn.Linear(h, h, bias=False)
        self.decoder = nn.Sequential(nn.Linear(9 * h, h), nn.Tanh(), nn.Linear(h, channels))

        rows = np.arange(self.lo, self.hi)
        if "local-neighbour-index" in self.faults:
            rows = rows - self.lo  # the bug: the rank's first cell taken to be cell 0
        self.neighbourhood: torch.Tensor  # (n_local, 9) global cell ids
        neighbours = torch.from_numpy(partition.neighbours()[rows].copy())
        self.register_buffer("neighbourhood", neighbours, persistent=False)

        self.latent_topo = topo
        if "rank-order" in self.faults and topo.spatial_group is not None:
            self.latent_topo = _reversed_order(topo)
        sync_gradients(self, topo)

    @property
    def n_local(self) -> int:
        """How many cells this rank owns."""
        return self.hi - self.lo

    # ------------------------------------------------------------ model stages

    def assimilate(self, obs: torch.Tensor, slot: torch.Tensor, batch: int) -> torch.Tensor:
        """Mean embedding of the observations per (sample, own cell): ``(B, n_local, H)``.

        ``obs`` holds the features of this rank's observations, ``slot`` their
        ``sample * n_local + local cell``.
        """
        slots = batch * self.n_local
        if "empty-none-grad" in self.faults and obs.shape[0] == 0:
            # the bug: nothing to embed, so the observation network is skipped
            return self.empty_token.expand(batch, self.n_local, self.hidden)
        embedded = self.obs_net(obs)
        total = embedded.new_zeros(slots, self.hidden).index_add(0, slot, embedded)
        count = torch.bincount(slot, minlength=slots).to(embedded.dtype)[:, None]
        pooled = torch.where(count > 0, total / count.clamp(min=1), self.empty_token)
        return pooled.reshape(batch, self.n_local, self.hidden)

    def encode(self, pooled: torch.Tensor) -> torch.Tensor:
        """The latent of each own cell from its pooled observations: ``(B, n_local, H)``."""
        z: torch.Tensor = self.encoder(pooled + self.cell_embedding[self.lo : self.hi])
        return z

    def gather_latent(self, z: torch.Tensor) -> torch.Tensor:
        """Every rank's latent cells, in global cell order: ``(B, npix, H)``."""
        if "non-autograd-gather" in self.faults:
            return _gather_without_autograd(z, self.topo, 1, self.partition.sizes)
        return all_gather_uneven(z, self.latent_topo, dim=1)  # replicated, cell order

    def mix(self, z: torch.Tensor) -> torch.Tensor:
        """The global step: attention over all cells, the same on every rank."""
        scores = self.query(z) @ self.key(z).transpose(-1, -2) / math.sqrt(self.hidden)
        mixed: torch.Tensor = z + torch.softmax(scores, dim=-1) @ self.value(z)
        return mixed

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Prediction of each own cell from its 9-cell neighbourhood: ``(B, n_local, C)``."""
        near = z[:, self.neighbourhood]  # (B, n_local, 9, H)
        out: torch.Tensor = self.decoder(near.flatten(-2))
        return out

    def gather_predictions(self, pred: torch.Tensor) -> torch.Tensor:
        """Every rank's predictions on the whole globe, sample-major: ``(B, npix, C)``."""
        topo, sizes = self.topo, self.partition.sizes
        b, _, c = pred.shape
        rows = [b * n for n in sizes]
        flat = pred.reshape(-1, c)  # sample-major within this rank: (B * n_local, C)
        if "padding-kept" in self.faults:
            gathered = _gather_keeping_padding(flat, topo, rows)
        elif "gather-over-world" in self.faults and topo.spatial_group is not None:
            gathered = all_gather_uneven(flat, _over_world(topo))
        else:
            gathered = all_gather_uneven(flat, topo)
        # replicated: every rank's rows, rank after rank (rank-major)
        if "rank-major-gather" in self.faults:
            return gathered.reshape(b, -1, c)  # the bug: rank-major rows read as sample-major
        starts = np.cumsum([0, *rows])
        blocks = [gathered[starts[r] : starts[r + 1]].reshape(b, n, c) for r, n in enumerate(sizes)]
        return torch.cat(blocks, dim=1)  # replicated: (B, npix, C) in cell order

    # ------------------------------------------------------------ loss

    def loss(
        self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, full: torch.Tensor
    ) -> torch.Tensor | None:
        """The mean over samples of each sample's masked MSE, replicated; ``None``: skip.

        ``pred``, ``target``: ``(B, n_local, C)``, ``mask``: ``(B, n_local)``; ``full``: the
        gathered predictions.
        """
        topo = self.topo
        if "grad-scale" in self.faults:
            # the bug: every rank computes the whole loss from the gathered predictions; the
            # gather's backward sums S identical copies, and the gradient sync, right for
            # per-rank parts, sums them again
            pred = full
            target = all_gather_uneven(target, topo, dim=1)
            mask = all_gather_uneven(mask, topo, dim=1)
        sq = ((pred - target) ** 2 * mask[..., None]).sum(dim=(1, 2))
        if "empty-rank-mean" in self.faults:
            # the bug: the rank's error as a mean over its cells scaled back by their count,
            # the same wherever a rank owns cells; 0 / 0 on a rank that owns none
            sq = ((pred - target) ** 2 * mask[..., None]).mean(dim=1).sum(dim=-1) * self.n_local
        parts = torch.stack([sq, mask.sum(dim=1) * pred.shape[-1]])  # this rank's (2, B)
        total = parts if "grad-scale" in self.faults else reduce_loss(parts, topo)
        # total is replicated over the spatial group: squared errors and counts per sample
        checked = parts if "rank-local-nan-check" in self.faults else total
        if not torch.isfinite(checked[0].sum() / checked[1].sum()):
            return None  # no targets anywhere: a bad batch, skipped by every rank together
        return (total[0] / total[1].clamp(min=1)).mean()

    def check_graph(self, loss: torch.Tensor) -> None:
        """Raise on every rank if any rank left a parameter out of its loss graph.

        The gradient hooks all-reduce each parameter's gradient as it lands; a rank where a
        hook never fires leaves the others waiting. Decided together over the world (the
        hooks also reduce over the data group), like DDP's unused-parameter check.
        """
        if self.topo.world_size == 1:
            return
        used = _parameters_in_graph(loss)
        unused = [n for n, p in self.named_parameters() if p.requires_grad and id(p) not in used]
        counts = torch.zeros(self.topo.world_size, dtype=torch.long)
        counts[self.topo.rank] = len(unused)
        dist.all_reduce(counts)  # replicated over the world: every rank's count
        if int(counts.sum()):
            bad = {r: int(c) for r, c in enumerate(counts.tolist()) if c}
            mine = f" (here: {', '.join(unused)})" if unused else ""
            raise ConfigError(
                f"parameters left out of the loss graph on ranks {bad} (rank: count){mine}; "
                "every rank must run every module, on empty tensors if its domain is "
                "empty, so each parameter gets a zero gradient, not None"
            )

    # ------------------------------------------------------------ inference

    @torch.no_grad()
    def rollout(
        self, batch: dict[str, torch.Tensor], steps: int, spread: float = 0.01
    ) -> list[torch.Tensor]:
        """A latent rollout from the batch's observations, as a forecast engine runs one:
        assimilate and encode once, then per step gather the latent, mix it globally,
        perturb it (one ensemble member: noise drawn for the whole globe and batch from a
        fixed seed, ``spread`` times) and decode; the mixed latent of the rank's own cells is
        the next step's. Each step's forecast of the rank's cells ``(B, n_local, C)``."""
        topo = self.topo
        b = batch["target"].shape[0]
        z = self.encode(self.assimilate(batch["obs"], batch["slot"], b))
        generator = torch.Generator().manual_seed(4321)
        rows = data_share(b * topo.data_size, topo)
        kept: torch.Tensor | None = None
        out = []
        for _ in range(steps):
            if "inference-cached-latent" in self.faults and not self.training and kept is not None:
                # the bug: the other ranks' cells, gathered at the first step, are kept (a
                # halo cached across steps); only the rank's own cells are refreshed
                full = kept.clone()
                full[:, self.lo : self.hi] = z
            else:
                full = self.gather_latent(z)  # replicated, cell order
                kept = full
            mixed = self.mix(full)
            if "inference-noise-per-rank" in self.faults and not self.training:
                # the bug: the member's noise drawn at this rank's shape, not the globe's
                noise = torch.randn(b, self.n_local, self.hidden, generator=generator)
            else:
                shape = (b * topo.data_size, self.partition.npix, self.hidden)
                noise = torch.randn(shape, generator=generator)[rows, self.lo : self.hi]
            z = mixed[:, self.lo : self.hi] + spread * noise.to(mixed.dtype)
            out.append(self.decode(mixed))
        return out

    # ------------------------------------------------------------ one step

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one batch: (replicated loss, replicated forecast ``(B, npix, C)``)."""
        b = batch["target"].shape[0]
        if "empty-skip" in self.faults and batch["obs"].shape[0] == 0:
            # the bug: nothing observed here, so nothing to do; the other ranks wait in the
            # latent gather for a rank that never comes
            full = batch["target"].new_zeros(b, self.partition.npix, self.channels)
            return torch.zeros((), requires_grad=True), full
        z = self.encode(self.assimilate(batch["obs"], batch["slot"], b))
        pred = self.decode(self.mix(self.gather_latent(z)))
        needs_grad = "grad-scale" in self.faults
        full = self.gather_predictions(pred if needs_grad else pred.detach())
        loss = self.loss(pred, batch["target"], batch["mask"], full)
        if loss is None:
            return torch.zeros((), requires_grad=True), full.detach()
        self.check_graph(loss)
        return loss, full.detach()


class HealpixCase(SpatialCase):
    """The HEALPix stepper as a ``SpatialCase``: ``check_equivalence(HealpixCase(), ranks=4)``.

    Parameters
    ----------
    nside:
        HEALPix resolution (``12 * nside**2`` cells, NESTED order).
    bounds:
        The partitioned run's cell ranges, ``ranks + 1`` bounds (empty ranges allowed);
        ``None``: ``CellPartition.even(nside, spatial_size)``.
    batch_size, n_obs, channels, hidden:
        Samples per step (all data groups together), observations per sample, values per
        observation and per target, latent width.
    observations:
        Explicit observations instead of drawn ones: objects with ``lat``, ``lon`` (degrees,
        ``(n,)``) and ``values`` (``(n, channels)``), e.g. ``strategies.ObservationSet`` s;
        sample ``b`` uses ``observations[b % len(observations)]``.
    empty_ranks:
        Spatial ranks of ``bounds`` whose cells get no observations, no targets and no
        tokens.
    target_density:
        Fraction of cells with a target value, per sample.
    tokens:
        ``0``: the forecast is one value per (sample, cell), a ``Shard`` of cells. ``T > 0``:
        0..T tokens per (sample, cell), a keyed field (see the module docstring).
    token_order:
        How a rank packs its tokens: ``"packed"`` (sample, cell, token order) or
        ``"shuffled"`` (a fixed permutation per rank).
    """

    name = "healpix"

    def __init__(
        self,
        nside: int = 2,
        bounds: tuple[int, ...] | None = None,
        *,
        batch_size: int = 2,
        n_obs: int = 40,
        channels: int = 2,
        hidden: int = 8,
        observations: Sequence[PointSet] | None = None,
        empty_ranks: tuple[int, ...] = (),
        target_density: float = 0.7,
        dtype: torch.dtype = torch.float64,
        faults: str | Iterable[str] = (),
        tokens: int = 0,
        token_order: str = "packed",
    ) -> None:
        self.faults = check_faults(faults)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ConfigError(
                f"tokens={tokens!r}: give the most tokens per (sample, cell) as an int >= 1, "
                "or 0 for one value per cell"
            )
        if token_order not in ("packed", "shuffled"):
            raise ConfigError(f"token_order={token_order!r}: use 'packed' or 'shuffled'")
        self.tokens, self.token_order = tokens, token_order
        self.reference_partition = CellPartition(nside, (0, 12 * nside * nside))
        self.nside, self.npix = self.reference_partition.nside, self.reference_partition.npix
        self.bounds = None if bounds is None else CellPartition(nside, bounds).bounds
        self.empty_ranks = tuple(int(r) for r in empty_ranks)
        if self.empty_ranks and self.bounds is None:
            raise ConfigError(
                f"empty_ranks={self.empty_ranks} needs bounds=...: the reference draws the "
                "observations too, so it must know which cells those ranks own"
            )
        if any(not 0 <= r < len(self.bounds or ()) - 1 for r in self.empty_ranks):
            raise ConfigError(
                f"empty_ranks={self.empty_ranks} names ranks outside the "
                f"{len(self.bounds or ()) - 1} ranks of bounds={self.bounds}"
            )
        self.observations: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        if observations is not None:
            self.observations = [
                (
                    np.asarray(o.lat, np.float64),
                    np.asarray(o.lon, np.float64),
                    np.asarray(o.values, np.float64).reshape(len(o.lat), channels),
                )
                for o in observations
            ]
            if not self.observations:
                raise ConfigError("observations=[] has no set; give at least one, or None")
        self.batch_size, self.n_obs, self.channels, self.hidden = (
            batch_size,
            n_obs,
            channels,
            hidden,
        )
        self.target_density, self.dtype = target_density, dtype

    # ------------------------------------------------------------ partition

    def block_variants(self, mesh: tuple[int, ...]) -> dict[str, SpatialCase]:
        """Uneven cell ranges (the first rank short) and a rank owning no cell (spatial rank
        1), on ``mesh[0]`` ranks; none when ``bounds`` pin the partition."""
        ranks = mesh[0] if mesh else 1
        if self.bounds is not None or ranks < 2:
            return {}
        out: dict[str, SpatialCase] = {}
        if self.npix >= 2 * ranks:
            out["uneven"] = self._with_bounds(CellPartition.uneven(self.nside, ranks).bounds)
        out["empty-rank"] = self._with_bounds(
            CellPartition.with_empty_rank(self.nside, ranks).bounds
        )
        return out

    def _with_bounds(self, bounds: tuple[int, ...]) -> HealpixCase:
        variant = copy.copy(self)  # the same model and data: only the split differs
        variant.bounds = bounds
        return variant

    def partition(self, topo: Topology) -> CellPartition:
        """The spatial group's partition; all cells on one range for the reference."""
        if topo.spatial_group is None:
            return self.reference_partition
        if self.bounds is None:  # the harness's 1-axis mesh, when it hands one, is the same
            return CellPartition.even(self.nside, topo.mesh_shape(1)[0])
        part = CellPartition(self.nside, self.bounds)
        if part.ranks != topo.spatial_size:
            raise ConfigError(
                f"bounds={self.bounds} name {part.ranks} ranks but the spatial group has "
                f"{topo.spatial_size}; give {topo.spatial_size + 1} bounds or bounds=None"
            )
        return part

    def _quiet_cells(self) -> np.ndarray:
        """Cells of ``empty_ranks``: no observation or target lands there."""
        if not self.empty_ranks:
            return np.zeros(0, dtype=np.int64)
        b = self.bounds
        assert b is not None  # checked in __init__
        return np.concatenate([np.arange(b[r], b[r + 1]) for r in self.empty_ranks])

    # ------------------------------------------------------------ contract

    def build(self, topo: Topology) -> nn.Module:
        return HealpixStepper(
            self.partition(topo),
            topo,
            channels=self.channels,
            hidden=self.hidden,
            faults=self.faults,
        )

    def batch(self, topo: Topology, step: int) -> dict[str, torch.Tensor]:
        """This rank's observations and targets, drawn for the whole globe and batch."""
        seed = int(torch.randint(0, 2**31 - 1, ()))  # the harness seeds torch the same everywhere
        if "same-batch-violated" in self.faults:
            seed += topo.rank  # the bug: a loader seeded per rank, 'for variety'
        rng = np.random.default_rng(seed)
        quiet = self._quiet_cells()
        allowed = np.setdiff1d(np.arange(self.npix), quiet)
        samples = []
        for b in range(self.batch_size):
            if self.observations is not None:
                lat, lon, values = self.observations[b % len(self.observations)]
            else:
                lat, lon = _points_in(self.nside, rng.choice(allowed, size=self.n_obs), rng)
                values = rng.standard_normal((self.n_obs, self.channels))
            samples.append((lat, lon, values))
        target = rng.standard_normal((self.batch_size, self.npix, self.channels))
        mask = rng.random((self.batch_size, self.npix)) < self.target_density
        mask[:, quiet] = False
        extra: dict[str, torch.Tensor] = {}
        if self.tokens:  # drawn last: the batches of tokens=0 stay what they were
            counts = rng.integers(0, self.tokens + 1, size=(self.batch_size, self.npix))
            counts[:, quiet] = 0
            extra["tokens"] = torch.as_tensor(counts)  # the whole batch; forward takes its own

        part = self.partition(topo)
        cells = part.cells(topo.spatial_rank)
        rows = range(self.batch_size)[data_share(self.batch_size, topo)]
        feats, slots = [], []
        for k, b in enumerate(rows):
            lat, lon, values = samples[b]
            cell = cell_of(self.nside, lat, lon)
            order = np.argsort(cell, kind="stable")  # packed in cell order
            counts = np.bincount(cell, minlength=self.npix)
            mine = order[part.packed_slice(counts, topo.spatial_rank)]
            feats.append(_features(lat[mine], lon[mine], values[mine]))
            slots.append(k * len(cells) + cell[mine] - cells.start)
        dtype = torch.get_default_dtype()
        own = slice(cells.start, cells.stop)
        obs = np.concatenate(feats).reshape(-1, self.channels + 3)
        return {
            "obs": torch.as_tensor(obs, dtype=dtype),
            "slot": torch.as_tensor(np.concatenate(slots), dtype=torch.long),
            "target": torch.as_tensor(target[rows.start : rows.stop, own], dtype=dtype),
            "mask": torch.as_tensor(mask[rows.start : rows.stop, own], dtype=dtype),
            **{k: v[rows.start : rows.stop, own] for k, v in extra.items()},
            **({"first_sample": torch.tensor(rows.start)} if extra else {}),
        }

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], topo: Topology) -> Outputs:
        assert isinstance(model, HealpixStepper), type(model)
        loss, full = model(batch)
        if self.tokens:
            return Outputs(loss, {"prediction": self.token_prediction(full, batch, model, topo)})
        if topo.spatial_group is None:
            return Outputs(loss, {"prediction": full})
        # each rank reports its own cells of the replicated forecast
        index = torch.arange(model.lo, model.hi)
        return Outputs(
            loss,
            {"prediction": Shard(full[:, model.lo : model.hi], index, dim=1, unit="cell")},
        )

    def predict(
        self, model: nn.Module, batch: dict[str, torch.Tensor], topo: Topology, steps: int
    ) -> list[dict[str, Shard | torch.Tensor]]:
        """The stepper's latent rollout (one ensemble member); each step's forecast of the
        rank's cells."""
        assert isinstance(model, HealpixStepper), type(model)
        steps_out = model.rollout(batch, steps)
        if topo.spatial_group is None:
            return [{"forecast": f} for f in steps_out]
        index = torch.arange(model.lo, model.hi)
        return [{"forecast": Shard(f, index, dim=1, unit="cell")} for f in steps_out]

    def token_prediction(
        self,
        full: torch.Tensor,
        batch: dict[str, torch.Tensor],
        model: HealpixStepper,
        topo: Topology,
    ) -> Shard:
        """The forecast as tokens: this rank's cells, a varying number of tokens each."""
        first = int(batch["first_sample"])
        if "local-sample-key" in self.faults:
            first = 0  # the bug: the data group's own sample numbers, 0.. in every group
        keys = token_keys(batch["tokens"], model.lo, first)
        local = keys[:, 0] - first
        token = keys[:, 2:3].to(full.dtype)
        values = full[local, keys[:, 1]] + 0.1 * (token + 1)
        if topo.spatial_group is None:  # the reference packs cell by cell: its own order
            order = torch.argsort(keys[:, 1] * (self.batch_size + 1) + keys[:, 0], stable=True)
        elif self.token_order == "shuffled":
            g = torch.Generator().manual_seed(1 + topo.rank)
            order = torch.randperm(len(keys), generator=g)
        else:
            order = torch.arange(len(keys))
        return Shard.keyed(values[order], keys[order], cell_column=1)

    def activation_shard(self, name: str, tensor: torch.Tensor, topo: Topology) -> str | None:
        """Observations have no global layout (each rank holds those of its cells, packed per
        sample): not compared, they are compared downstream as the pooled cells."""
        observations = tensor.dim() == 2 and tensor.shape[-1] == self.channels + 3
        slots = tensor.dim() == 1 and not tensor.is_floating_point()
        if name.startswith("obs_net") or (name == "" and (observations or slots)):
            return "skip"
        return None

    def describe(self, topo: Topology | None = None) -> str:
        text = f"nside {self.nside}"
        if topo is not None and topo.spatial_group is not None:
            bounds = self.partition(topo).bounds
        elif self.bounds is not None:
            bounds = self.bounds
        else:
            return text + (f", 0..{self.tokens} tokens per cell" if self.tokens else "")
        text += ", cells [" + "|".join(f"{a}:{b}" for a, b in pairwise(bounds)) + "]"
        if self.empty_ranks:
            text += f", nothing observed on ranks {list(self.empty_ranks)}"
        if self.tokens:
            text += f", 0..{self.tokens} tokens per cell"
        return text
