"""The HEALPix stepper's faults: their ids, the layouts that show each, and the private
collectives some of them need.

``HEALPIX_FAULTS`` and ``INFERENCE_CHECKS`` name the HEALPix bugs of FAULTS.md;
``FAULT_CHECKS`` says which quantity catches each on which layout of 4 ranks (``EVEN``,
``UNEVEN``, ``DATA2``, ``QUIET``, ``TOKENS2``, ``NO_CELLS``); ``check_faults`` checks a
``faults=`` switch. The gathers are the faults' wrong variants of a collective: a plain
``dist.all_gather`` without autograd, a gather that keeps its padding, a spatial group over
the whole world or ranked in reverse. ``harness.steppers.healpix`` calls them where a fault
is on and re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.distributed as dist

from harness.steppers import faults as _faults
from harness.topology import Topology, cached_groups

#: faults that live only in inference (``predict`` in eval mode, under no_grad): fault id ->
#: (the rollout step where the bug enters, ``HealpixCase`` kwargs on 4 ranks)
INFERENCE_CHECKS: dict[str, tuple[int, dict[str, object]]] = {
    "inference-cached-latent": (1, {"nside": 2}),
    "inference-noise-per-rank": (1, {"nside": 2}),  # perturbs the next step's latent
}

#: the HEALPix stepper's training fault ids (FAULTS.md); with ``INFERENCE_CHECKS``' ids, what
#: ``HealpixCase(faults=...)`` takes
HEALPIX_FAULTS = frozenset(
    {
        "rank-major-gather",  # gathered predictions viewed rank-major as (B, npix, C)
        "padding-kept",  # the padding of the uneven prediction gather is not stripped
        "gather-over-world",  # predictions gathered over the world, not the spatial group
        "rank-order",  # the latent is gathered over a group whose rank order is not cell order
        "local-neighbour-index",  # neighbour rows looked up by local, not global, cell id
        "empty-skip",  # a rank without observations returns before any module or collective
        "empty-none-grad",  # a rank without observations skips the observation network
        "non-autograd-gather",  # the latent is gathered with plain dist.all_gather
        "grad-scale",  # loss on the gathered (replicated) predictions: grads S times too large
        "rank-local-nan-check",  # the skip-bad-batch check reads this rank's part, not the total
        "same-batch-violated",  # the data loader seeds its draws with the world rank
        "local-sample-key",  # keyed tokens name their sample by the data group's local index
        "empty-rank-mean",  # a rank's squared error as a mean over its cells times their count
    }
)

# Layouts of 4 ranks that show each bug: two samples per data group (rank-major flattening
# needs batch >= 2), an uneven partition whose first rank is short (padding moves the later
# ranks' rows), two data groups (the world is not the spatial group), and a rank that owns
# cells but sees no observation and no target (empty-domain bugs).
EVEN: dict[str, object] = {"nside": 2}
UNEVEN: dict[str, object] = {"nside": 2, "bounds": (0, 8, 20, 34, 48)}
DATA2: dict[str, object] = {"nside": 2, "batch_size": 4}
QUIET: dict[str, object] = {"nside": 2, "bounds": (0, 12, 24, 36, 48), "empty_ranks": (1,)}
TOKENS2: dict[str, object] = {**DATA2, "tokens": 3}
NO_CELLS: dict[str, object] = {"nside": 2, "bounds": (0, 20, 20, 30, 48)}  # rank 1 owns no cell

#: fault id -> (quantities that catch it, ``HealpixCase`` kwargs, spatial_size) on 4 ranks.
FAULT_CHECKS: dict[str, tuple[set[str], dict[str, object], int | None]] = {
    "rank-major-gather": ({"field"}, EVEN, None),
    "padding-kept": ({"field", "error"}, UNEVEN, None),
    "gather-over-world": ({"field"}, DATA2, 2),
    "rank-order": ({"field"}, EVEN, None),
    "local-neighbour-index": ({"field"}, EVEN, None),
    "empty-skip": ({"deadlock", "timeout"}, QUIET, None),
    # caught as error: the stepper's graph check makes every rank raise the same error
    # (with only gradient hooks a rank whose parameter never gets a gradient hangs the rest)
    "empty-none-grad": ({"grad", "error"}, QUIET, None),
    "non-autograd-gather": ({"grad"}, EVEN, None),
    "grad-scale": ({"grad"}, EVEN, None),
    "rank-local-nan-check": ({"deadlock", "timeout", "field"}, QUIET, None),
    "same-batch-violated": ({"field", "loss"}, EVEN, None),
    "local-sample-key": ({"coverage"}, TOKENS2, 2),
    # a rank with no cells: 0 / 0 there, NaN in the group's sum, so every rank skips the
    # batch as bad (a loss of zero, no gradient) where the reference trains
    "empty-rank-mean": ({"loss", "grad"}, NO_CELLS, None),
}


def check_faults(faults: str | Iterable[str]) -> frozenset[str]:
    """``faults`` as a frozenset of known HEALPix fault ids, or a ``ConfigError``."""
    known = HEALPIX_FAULTS | frozenset(INFERENCE_CHECKS)  # training faults, then inference's
    return _faults.check_faults(faults, known, "HEALPix")


# ---------------------------------------------------------------------- gathers


def _reversed_order(topo: Topology) -> Topology:
    """The ``rank-order`` fault: ``topo`` with a spatial group ranked in reverse.

    Every rank creates the groups, in the same order (``cached_groups``).
    """
    s, d = topo.spatial_size, topo.data_size
    lists = [[g * s + s - 1 - k for k in range(s)] for g in range(d)]
    groups = cached_groups(("healpix-reversed", topo.world_size, s), lists, sort_ranks=False)
    return replace(
        topo, spatial_group=groups[topo.data_rank], spatial_rank=s - 1 - topo.spatial_rank
    )


def _over_world(topo: Topology) -> Topology:
    """The ``gather-over-world`` fault: ``topo`` whose 'spatial group' is the whole world."""
    return replace(
        topo, spatial_group=dist.group.WORLD, spatial_size=topo.world_size, spatial_rank=topo.rank
    )


def _pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()


def _gather_without_autograd(
    x: torch.Tensor, topo: Topology, dim: int, sizes: list[int]
) -> torch.Tensor:
    """The ``non-autograd-gather`` fault: ``dist.all_gather``, own shard put back by hand.

    Autograd sees only this rank's own shard: the other ranks' uses of it (their losses
    through the global step) never send their gradient back.
    """
    if topo.spatial_group is None or topo.spatial_size == 1:
        return x
    padded = _pad_to(x, dim, max(max(sizes), 1))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.detach(), group=topo.spatial_group)
    parts[topo.spatial_rank] = padded  # keeps the local graph, and only the local one
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def _gather_keeping_padding(x: torch.Tensor, topo: Topology, sizes: list[int]) -> torch.Tensor:
    """The ``padding-kept`` fault: rows of every rank padded to the longest, never stripped."""
    if topo.spatial_group is None or topo.spatial_size == 1:
        return x
    padded = _pad_to(x, 0, max(max(sizes), 1))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=topo.spatial_group)
    return torch.cat(parts)
