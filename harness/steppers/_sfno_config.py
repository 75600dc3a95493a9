"""The SFNO stepper before it is built: its configuration, its faults and its grid.

``SFNOConfig`` (sizes, process grid, faults; ``process_grid`` fits ``h`` x ``w`` to a
spatial group), the fault tables (``FAULT_CHECKS``, ``INFERENCE_CHECKS``: the quantity and
the layout that show each SFNO bug of FAULTS.md) and the geometry the stepper and its case
share: the latitudes' quadrature weights, the data partition (the SHT's split, unless a
fault changes it) and the triangular truncation. ``harness.steppers.sfno`` builds on it and
re-exports its public names.

Communicates nothing: every collective of the SFNO stepper is issued in ``sfno.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from difflib import get_close_matches
from typing import Any

import torch

from harness.errors import ConfigError
from harness.partition import LatLonPartition, sht_split_rule
from harness.steppers import faults as _faults
from harness.topology import Topology

_UNEVEN_LAT: dict[str, object] = {
    "nlat": 30,
    "nlon": 16,
    "h": 4,
    "w": 1,
}  # bands [8, 8, 8, 6], unequal areas
_H2W2: dict[str, object] = {"h": 2, "w": 2}

#: fault id -> (quantities FAULTS.md says catch it, ``SFNOCase`` kwargs of the smallest layout
#: on 4 ranks that shows it, spatial_size). Measured with check_equivalence, float64, 2 steps.
FAULT_CHECKS: dict[str, tuple[set[str], dict[str, object], int | None]] = {
    "reduce-not-differentiable": ({"grad"}, _H2W2, None),
    "reduce-double-count": ({"grad"}, _H2W2, None),
    "coupling-identity-backward": ({"grad"}, _H2W2, None),
    "no-grad-sync": ({"grad", "sync"}, _H2W2, None),
    "grad-sync-mean": ({"grad"}, _H2W2, None),
    # even l and m splits (nlat 17: lmax 16 = 8 + 8; nlon 30: mmax 16 = 8 + 8): with uneven
    # ones the broadcast's sizes differ between ranks and gloo aborts the process (a crash)
    "buffer-broadcast": (
        {"error", "field", "buffer", "crash"},
        {"nlat": 17, "nlon": 30, **_H2W2},
        None,
    ),
    "mean-of-means": ({"loss"}, _UNEVEN_LAT, None),
    "split-mismatch": ({"field", "error"}, _UNEVEN_LAT, None),
    "per-rank-noise": ({"field"}, {"noise": 1, **_H2W2}, None),
    "local-weights": ({"loss", "error"}, _UNEVEN_LAT, None),
    "reduce-over-world": ({"loss"}, {"h": 2, "w": 1}, 2),
    # faults that show on some layouts only (a sweep of check_layouts finds where):
    # uneven latitude bands (30 over 4: [8, 8, 8, 6]; 2 and 3 bands are even)
    "band-start-from-own-size": ({"loss", "field"}, _UNEVEN_LAT, None),
    # w >= 3: on 2 azimuth ranks the second is the last, where counting back is right
    "m-slice-from-end": ({"field", "grad", "loss"}, {"h": 1, "w": 4}, None),
    # data groups: with one, its samples are the whole batch
    "noise-per-data-group": ({"field"}, {"noise": 1, "h": 2, "w": 1, "batch_size": 4}, 2),
    # sharded spectral weights (makani's layout): a shard from the wrong l range starts
    # wrong (param at build) and filters the wrong modes (field, grad)
    "shard-wrong-l": ({"param", "grad", "field"}, {**_H2W2, "shard_weights": True}, None),
    # even l and m splits (8 + 8): the fault's all-reduce over the whole spatial group sums
    # the polar ranks' different l slices, which gloo can only do when they are one size
    "shard-grad-replicated": (
        {"grad"},
        {"nlat": 17, "nlon": 30, **_H2W2, "shard_weights": True},
        None,
    ),
}
#: faults that live only in inference (``predict`` in eval mode, under no_grad): fault id ->
#: (the rollout step where the bug enters, ``SFNOCase`` kwargs on 4 ranks). A training check
#: cannot see them; a rollout check (``check_equivalence(..., rollout=N)``) names that step.
INFERENCE_CHECKS: dict[str, tuple[int, dict[str, object]]] = {
    "inference-cached-mean": (1, _H2W2),
    "eval-local-mean": (0, _H2W2),
    "inference-noise-per-rank": (0, {"noise": 1, **_H2W2}),
    "step-counter-per-rank": (1, _H2W2),
}
#: the faults that live in the sharded spectral weights (``shard_weights=True``)
SHARD_FAULTS = frozenset({"shard-wrong-l", "shard-grad-replicated"})
SHARD_INITS = ("sliced", "per-rank")
#: the SFNO stepper's training fault ids (FAULTS.md); with ``INFERENCE_CHECKS``' ids, what
#: ``SFNOCase(faults=...)`` takes
SFNO_FAULTS = frozenset(FAULT_CHECKS)
GRIDS = ("equiangular", "legendre-gauss")


def check_faults(faults: str | Iterable[str]) -> frozenset[str]:
    """``faults`` as a frozenset of known SFNO fault ids, or a ``ConfigError``."""
    known = SFNO_FAULTS | frozenset(INFERENCE_CHECKS)  # training faults, then inference's
    return _faults.check_faults(faults, known, "SFNO")


@dataclass(frozen=True)
class SFNOConfig:
    """Sizes, process grid and faults of an SFNO stepper.

    ``h`` x ``w`` is the process grid of a partitioned run (``None``: inferred from the
    spatial group, all polar by default); the reference always runs 1 x 1. ``noise`` is the
    number of noise channels fed to the encoder (0: no noise conditioning).
    """

    nlat: int = 16
    nlon: int = 32
    grid: str = "equiangular"
    h: int | None = None
    w: int | None = None
    channels: int = 2
    embed: int = 8
    blocks: int = 2
    noise: int = 0
    noise_seed: int = 1234
    forward_steps: int = 2
    faults: frozenset[str] = field(default_factory=frozenset)
    #: each rank holds only its l modes of the spectral weights (makani's layout), as the
    #: parameter; else full-size weights on every rank, sliced in forward
    shard_weights: bool = False
    #: how sharded weights start: "sliced" from one seeded full-size draw (the reference's
    #: values by construction), or "per-rank": each rank draws its own slice from a
    #: generator of its own, as a model that initialises its shards independently does
    shard_init: str = "sliced"

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", check_faults(self.faults))
        if self.shard_init not in SHARD_INITS:
            raise ConfigError(
                f"shard_init {self.shard_init!r} is not known; choose one of {SHARD_INITS}"
            )
        needs = sorted(self.faults & SHARD_FAULTS)
        if needs and not self.shard_weights:
            raise ConfigError(
                f"fault(s) {needs} live in sharded spectral weights; use shard_weights=True"
            )
        if self.grid not in GRIDS:
            raise ConfigError(f"grid {self.grid!r} is not supported; choose one of {GRIDS}")
        for name in ("nlat", "nlon", "channels", "embed", "blocks", "forward_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (2 if name in ("nlat", "nlon") else 1):
                raise ConfigError(f"SFNOConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.noise, int) or self.noise < 0:
            raise ConfigError(f"SFNOConfig.noise must be an integer >= 0, got {self.noise!r}")

    def process_grid(self, topo: Topology) -> tuple[int, int]:
        """(h, w) for this topology: 1 x 1 for the reference, else ``h * w == spatial_size``:
        the harness's ``topo.mesh`` when it hands one (``check_layouts``), else ``h`` x ``w``."""
        if topo.spatial_group is None:
            return 1, 1
        s = topo.spatial_size
        h, w = topo.mesh_shape(2) if topo.mesh else (self.h, self.w)
        if h is None and w is None:
            h, w = s, 1
        elif h is None:
            h = s // w if w and s % w == 0 else 0
        elif w is None:
            w = s // h if h and s % h == 0 else 0
        if not h or not w or h * w != s:
            raise ConfigError(
                f"process grid h={self.h} x w={self.w} does not fit a spatial group of {s} "
                f"ranks; choose h * w == {s}"
            )
        lmax = mmax = _triangular(self.nlat, self.nlon)
        if lmax < h or self.nlon < w or mmax < w:
            raise ConfigError(
                f"a {self.nlat}x{self.nlon} grid has {lmax} degrees l and {mmax} orders m; "
                f"they cannot be split over h={h} x w={w} ranks; use a larger grid"
            )
        if self.embed < max(h, w):
            raise ConfigError(
                f"embed={self.embed} channels cannot be split over {max(h, w)} ranks: "
                f"torch-harmonics 0.8.0's distributed SHT splits the channels over each "
                f"process-grid axis; use embed >= {max(h, w)}"
            )
        return h, w


#: ``SFNOCase``'s positional arguments, in order: fields of ``SFNOConfig`` (the grid, then
#: the process grid), as ``SFNOCase(16, 32, 2, 2)`` has always meant
POSITIONAL = ("nlat", "nlon", "h", "w")


def config_from(
    grid: Sequence[object], options: Mapping[str, object], base: SFNOConfig | None = None
) -> SFNOConfig:
    """The ``SFNOConfig`` of ``SFNOCase(*grid, config=base, **options)``: ``base`` (else the
    defaults) with the positional ``grid`` (``POSITIONAL``) and the keyword ``options``
    replacing its fields, validated once by ``SFNOConfig`` itself."""
    if len(grid) > len(POSITIONAL):
        raise ConfigError(
            f"SFNOCase takes at most {len(POSITIONAL)} positional arguments "
            f"({', '.join(POSITIONAL)}), got {len(grid)}; pass the others by keyword"
        )
    named = dict(zip(POSITIONAL, grid, strict=False))
    twice = sorted(named.keys() & options.keys())
    if twice:
        raise ConfigError(f"SFNOCase got {twice} both by position and by keyword; pass it once")
    known = [f.name for f in fields(SFNOConfig) if f.init]
    for name in options:
        if name not in known:
            close = get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"SFNOCase got an unknown option {name!r}; {hint}besides its own (see "
                f"SFNOCase.__init__) it takes the fields of SFNOConfig: {', '.join(known)}"
            )
    changes: dict[str, Any] = {**named, **options}
    return replace(base, **changes) if base is not None else SFNOConfig(**changes)


# ---------------------------------------------------------------------- geometry


def lat_weights(nlat: int, grid: str) -> torch.Tensor:
    """Quadrature weights of the latitudes in the SHT's order (north to south), float64."""
    from torch_harmonics.quadrature import clenshaw_curtiss_weights, legendre_gauss_weights

    rule = legendre_gauss_weights if grid == "legendre-gauss" else clenshaw_curtiss_weights
    _, weights = rule(nlat, -1, 1)
    return torch.flip(torch.as_tensor(weights, dtype=torch.float64), dims=(0,))


def data_partition(config: SFNOConfig, h: int, w: int) -> LatLonPartition:
    """How grid data are scattered: the SHT's own split (unless ``split-mismatch``)."""
    if "split-mismatch" in config.faults:
        # The bug: a split rule other than the SHT's (numpy.array_split's balanced rule
        # where torch-harmonics 0.8 splits with ceil, ceil where 0.9 balances).
        other = "ceil" if sht_split_rule() == "balanced" else "balanced"
        return LatLonPartition(config.nlat, config.nlon, h, w, rule=other)
    return LatLonPartition(config.nlat, config.nlon, h, w)


def _offset_slice(sizes: list[int], index: int) -> slice:
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


def _truncation(cfg: SFNOConfig) -> dict[str, int | str]:
    """Explicit ``lmax``/``mmax``, the same on every torch-harmonics: 0.9 changed the default
    truncation (triangular, lmax capped at nlat - 1), and the stepper must be one model on
    both, so that one set of goldens serves both."""
    t = _triangular(cfg.nlat, cfg.nlon)
    return {"lmax": t, "mmax": t, "grid": cfg.grid}


def _triangular(nlat: int, nlon: int) -> int:
    """Triangular truncation both torch-harmonics versions accept: l, m < min(nlat - 1, ...)."""
    return min(nlat - 1, nlon // 2 + 1)
