"""Which built-in stepper configurations the main job checks, and the fault catalogue.

One table serves the main job (``harness-check``), the fault tests in ``tests/faults``,
``FAULTS.md`` and the fault table of ``docs/faults.md``, so none can disagree about what
catches what: ``python -m harness.steppers.catalogue`` prints FAULTS.md (``--table``: the
table of ``docs/faults.md``),
and a test fails when either file drifts from this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from harness.case import SpatialCase
from harness.steppers.faults import check_faults

if TYPE_CHECKING:
    from harness.pool import Runner

__all__ = ["check_faults"]  # kept here too: it lived here before the steppers' own module

Maker = Callable[..., SpatialCase]


def _mlp(**kw: Any) -> SpatialCase:
    from harness.steppers.mlp import CoupledMLPCase

    return CoupledMLPCase(**kw)


#: fault id -> (stepper label, quantities that FAULTS.md says catch it)
MLP_FAULTS: dict[str, set[str]] = {
    "no-grad-sync": {"grad", "sync"},
    "wrong-shard-index": {"field"},
    "non-differentiable-reduce": {"grad"},
}


def _sfno(**kw: Any) -> SpatialCase:
    from harness.steppers.sfno import SFNOCase

    return SFNOCase(**kw)


Config = tuple[str, Maker, dict[str, object], int | None]
Fault = tuple[str, Maker, dict[str, object], int | None, str, set[str]]


def _healpix(**kw: Any) -> SpatialCase:
    from harness.steppers.healpix import HealpixCase

    return HealpixCase(**kw)


def main_configs(ranks: int) -> list[Config]:
    """(label, case factory, kwargs, spatial_size) for each check of the main job."""
    import torch

    out: list[Config] = [("coupled-mlp", _mlp, {"npos": 37, "batch_size": 4}, None)]
    if ranks == 4:
        out += [
            ("sfno", _sfno, {"nlat": 16, "nlon": 32, "h": 2, "w": 2}, None),
            (
                "sfno uneven",
                _sfno,
                {"nlat": 30, "nlon": 62, "h": 4, "w": 1, "grid": "legendre-gauss", "noise": 1},
                None,
            ),
            (
                "sfno float32",
                _sfno,
                {"nlat": 16, "nlon": 32, "h": 1, "w": 4, "dtype": torch.float32},
                None,
            ),
            ("sfno s×d", _sfno, {"nlat": 16, "nlon": 32, "h": 2, "w": 1, "batch_size": 4}, 2),
        ]
        out += [
            ("healpix", _healpix, {"nside": 4}, None),
            (
                "healpix empty rank",
                _healpix,
                {"nside": 2, "bounds": (0, 20, 20, 30, 48), "empty_ranks": (3,)},
                None,
            ),
            ("healpix s×d", _healpix, {"nside": 2, "batch_size": 4}, 2),
            ("healpix tokens s×d", _healpix, {"nside": 2, "batch_size": 4, "tokens": 3}, 2),
        ]
    else:
        out.append(("sfno", _sfno, {"nlat": 16, "nlon": 32, "h": ranks, "w": 1}, None))
        out.append(("healpix", _healpix, {"nside": 2}, None))
    if ranks % 2 == 0 and ranks > 2:
        out.append(("coupled-mlp s×d", _mlp, {"npos": 37, "batch_size": 4}, ranks // 2))
    return out


def fault_matrix(ranks: int) -> Iterator[Fault]:
    """(stepper, factory, kwargs, spatial_size, fault id, expected quantities) per fault.

    The stepper layouts are sized for 4 ranks; with another count only the MLP's run (and
    on one rank none: ``skipped_faults`` says why).
    """
    if ranks >= 2:
        for fault, expected in MLP_FAULTS.items():
            yield "coupled-mlp", _mlp, {"npos": 37}, None, fault, expected
    if ranks != 4:
        return
    from harness.steppers.sfno import FAULT_CHECKS

    for fault, (expected, kwargs, spatial_size) in FAULT_CHECKS.items():
        yield "sfno", _sfno, kwargs, spatial_size, fault, expected
    from harness.steppers.healpix import FAULT_CHECKS as HEALPIX_CHECKS

    for fault, (expected, kwargs, spatial_size) in HEALPIX_CHECKS.items():
        yield "healpix", _healpix, kwargs, spatial_size, fault, expected


#: One inference fault of the catalogue: (stepper, factory, kwargs, spatial_size, fault id,
#: the rollout step where it enters).
InferenceFault = tuple[str, Maker, dict[str, object], int | None, str, int]
#: the rollout a check of an inference fault runs: long enough to see the bugs that enter
#: after the first step, short enough to keep the catalogue quick
INFERENCE_ROLLOUT = 4


def inference_matrix(ranks: int) -> Iterator[InferenceFault]:
    """The faults that live only in inference (``predict`` in eval mode, no_grad): a
    training check passes them, a rollout check (``rollout=INFERENCE_ROLLOUT``) fails at
    the step where each enters. Sized for 4 ranks, like the steppers' training faults."""
    if ranks != 4:
        return
    from harness.steppers.sfno import INFERENCE_CHECKS

    for fault, (enters, kwargs) in INFERENCE_CHECKS.items():
        yield "sfno", _sfno, kwargs, None, fault, enters
    from harness.steppers.healpix import INFERENCE_CHECKS as HEALPIX_INFERENCE

    for fault, (enters, kwargs) in HEALPIX_INFERENCE.items():
        yield "healpix", _healpix, kwargs, None, fault, enters


def skipped_faults(ranks: int) -> list[tuple[str, str, str]]:
    """(stepper, fault id, why) for each fault of the catalogue that ``ranks`` cannot show."""
    out = []
    if ranks < 2:
        out += [
            ("coupled-mlp", f, "one rank has no communication to get wrong") for f in MLP_FAULTS
        ]
    if ranks != 4:
        from harness.steppers.healpix import HEALPIX_FAULTS
        from harness.steppers.sfno import SFNO_FAULTS

        why = "its layout is sized for 4 ranks (run --ranks 4)"
        out += [("sfno", f, why) for f in sorted(SFNO_FAULTS)]
        out += [("healpix", f, why) for f in sorted(HEALPIX_FAULTS)]
    return out


# ---------------------------------------------------------------------- the document

#: (stepper, fault id) -> (the bug, what goes wrong). What FAULTS.md and docs/faults.md say.
DESCRIPTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("coupled-mlp", "no-grad-sync"): (
        "no all-reduce of parameter gradients over the spatial group",
        "grads partial per rank; co-rank params diverge after a step",
    ),
    ("coupled-mlp", "wrong-shard-index"): (
        "a rank reports its output at positions shifted by one",
        "every field value lands one position off",
    ),
    ("coupled-mlp", "non-differentiable-reduce"): (
        "the global mean inside the model uses in-place dist.all_reduce (no autograd)",
        "each rank misses the other ranks' share of the gradient",
    ),
    ("sfno", "reduce-not-differentiable"): (
        "spatial loss sum reduced from detached values, the local part back-propagated",
        "gradients through the loss are wrong or missing",
    ),
    ("sfno", "reduce-double-count"): (
        "loss reduction whose backward also all-reduces, combined with grad hooks",
        "grads exactly S x too large, loss unchanged",
    ),
    ("sfno", "coupling-identity-backward"): (
        "a global sum inside the model (not the loss) with identity backward",
        "each rank misses the other ranks' share of the gradient",
    ),
    ("sfno", "no-grad-sync"): (
        "no all-reduce of parameter grads over the spatial group",
        "grads partial per rank; co-rank params diverge after a step",
    ),
    ("sfno", "grad-sync-mean"): (
        "grad hook averages instead of sums",
        "grads 1/S (invisible after Adam: the harness uses SGD)",
    ),
    ("sfno", "buffer-broadcast"): (
        "DDP-style in-place copy into buffers between forwards (broadcast_buffers=True)",
        "autograd 'modified by an inplace operation', or gloo aborting when the buffers' "
        "shapes differ",
    ),
    ("sfno", "mean-of-means"): (
        "area-weighted mean as the mean of per-rank means",
        "wrong loss when tiles' weight sums differ (uneven latitude bands)",
    ),
    ("sfno", "split-mismatch"): (
        "data scattered with numpy.array_split's rule instead of the SHT's split",
        "wrong modes or a shape error on uneven grids",
    ),
    ("sfno", "per-rank-noise"): (
        "noise drawn with a per-rank seed",
        "tiles of one sample see different noise",
    ),
    ("sfno", "local-weights"): (
        "area weights sliced at the wrong offset while data is split",
        "shape error or wrong loss",
    ),
    ("sfno", "reduce-over-world"): (
        "loss averaged over all ranks instead of the data-parallel group",
        "wrong loss with data x spatial groups",
    ),
    ("sfno", "shard-wrong-l"): (
        "a rank's shard of a sharded spectral weight taken from the wrong l range",
        "the shard starts as other modes' weights and filters its modes with them",
    ),
    ("sfno", "shard-grad-replicated"): (
        "a sharded weight's gradient all-reduced over the whole spatial group, as if replicated",
        "other l slices' gradients added into each shard",
    ),
    ("healpix", "rank-major-gather"): (
        "gathered predictions flattened rank-major instead of sample-major",
        "misaligned predictions with batch >= 2",
    ),
    ("healpix", "padding-kept"): (
        "padding of the uneven all-gather not stripped",
        "extra zeros, or a shape error",
    ),
    ("healpix", "gather-over-world"): (
        "gather over the world instead of the spatial group",
        "samples of different data groups mixed",
    ),
    ("healpix", "rank-order"): (
        "spatial group rank order differs from cell order",
        "cells permuted",
    ),
    ("healpix", "local-neighbour-index"): (
        "neighbour table indexed with local instead of global cell ids",
        "wrong decoder input at shard edges",
    ),
    ("healpix", "empty-skip"): (
        "a rank with an empty domain skips modules or collectives",
        "hang: the others wait in a collective it never enters",
    ),
    ("healpix", "empty-none-grad"): (
        "an empty rank leaves parameters out of the graph",
        "grad None vs zeros; a hang where only gradient hooks sync",
    ),
    ("healpix", "non-autograd-gather"): (
        "plain dist.all_gather instead of an autograd-aware gather",
        "encoder params get no gradient from other ranks' losses",
    ),
    ("healpix", "grad-scale"): (
        "loss on gathered predictions on every rank with summed gradients",
        "grads S x too large",
    ),
    ("healpix", "rank-local-nan-check"): (
        "a skip-batch decision (NaN check) taken per rank without a group reduction",
        "ranks take different branches: a hang or wrong fields",
    ),
    ("healpix", "same-batch-violated"): (
        "ranks of one spatial group read different samples",
        "wrong everything",
    ),
    ("healpix", "local-sample-key"): (
        "keyed tokens (sample, cell, token) name their sample by the data group's local index",
        "data groups' tokens share keys: items held by several ranks, others by none",
    ),
    ("sfno", "band-start-from-own-size"): (
        "a latitude band's first row taken as the polar index times the band's own size",
        "area weights of the wrong rows once bands differ in size (uneven bands only)",
    ),
    ("sfno", "m-slice-from-end"): (
        "azimuth ranks after the first take their orders m counted back from the last",
        "middle azimuth ranks filter with other orders' weights (w >= 3 only)",
    ),
    ("sfno", "noise-per-data-group"): (
        "each data group draws noise for its own samples from the shared seed",
        "every data group's samples get the first samples' noise (data groups only)",
    ),
    ("healpix", "empty-rank-mean"): (
        "a rank's squared error taken as a mean over its cells times their count",
        "0 / 0 on a rank that owns no cell: every batch skipped as NaN (an empty rank only)",
    ),
}


#: (stepper, fault id) -> (the bug, what goes wrong) for the faults that live only in inference
INFERENCE_DESCRIPTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("sfno", "inference-cached-mean"): (
        "the other ranks' share of the global mean, received at the first rollout step, kept "
        "as a buffer and reused",
        "every later step conditions on step 0's mean",
    ),
    ("sfno", "eval-local-mean"): (
        "in eval mode the global mean is taken over the rank's own block",
        "each tile conditions on its own mean (fme's clip_latent_global_means shape)",
    ),
    ("sfno", "inference-noise-per-rank"): (
        "ensemble inference seeds its noise generator with the rank",
        "tiles of one member see different noise",
    ),
    ("sfno", "step-counter-per-rank"): (
        "the rollout's step counter advanced only on the group's first rank",
        "the other ranks keep applying step 0's forcing",
    ),
    ("healpix", "inference-cached-latent"): (
        "the gathered latent of the first rollout step kept; later steps refresh only the "
        "rank's own cells",
        "other ranks' cells stale from step 1 on (a halo cached across steps)",
    ),
    ("healpix", "inference-noise-per-rank"): (
        "ensemble perturbations of the latent drawn at the rank's shape from the shared seed",
        "each rank's cells perturbed with another field's noise",
    ),
}


#: (stepper, fault id) -> where the first divergence must point (``Divergence.located``):
#: the module whose own code holds the bug (``''`` is the model itself: these steppers keep
#: their gathers, losses and global means in the model's methods, outside submodules);
#: ``"sync"`` where a parameter's gradient departs after its synchronisation, the ranks'
#: gradients before it adding up to the reference's (which parameter departs first is the
#: run's); ``"coverage"`` where
#: no value departs but items are held by no rank or by several (named by key); ``None``
#: where the run raises or hangs (its traceback says where).
LOCATED: dict[tuple[str, str], str | None] = {
    ("coupled-mlp", "no-grad-sync"): "sync",
    ("coupled-mlp", "wrong-shard-index"): "field 'out'",
    ("coupled-mlp", "non-differentiable-reduce"): "backward of '' (CoupledMLP)",
    ("sfno", "reduce-not-differentiable"): "backward of the loss",
    ("sfno", "reduce-double-count"): "backward of the loss",
    ("sfno", "coupling-identity-backward"): "backward of '' (SFNOStepper)",
    ("sfno", "no-grad-sync"): "sync",
    ("sfno", "grad-sync-mean"): "sync",
    ("sfno", "buffer-broadcast"): None,
    ("sfno", "mean-of-means"): "forward of the loss",
    ("sfno", "split-mismatch"): None,
    ("sfno", "per-rank-noise"): "forward of '' (SFNOStepper)",
    ("sfno", "local-weights"): "forward of the loss",
    ("sfno", "reduce-over-world"): "forward of the loss",
    ("healpix", "rank-major-gather"): "forward of '' (HealpixStepper)",
    ("healpix", "padding-kept"): "forward of '' (HealpixStepper)",
    ("healpix", "gather-over-world"): "forward of '' (HealpixStepper)",
    ("healpix", "rank-order"): "forward of '' (HealpixStepper)",
    ("healpix", "local-neighbour-index"): "forward of '' (HealpixStepper)",
    ("healpix", "empty-skip"): None,
    ("healpix", "empty-none-grad"): None,
    ("healpix", "non-autograd-gather"): "backward of '' (HealpixStepper)",
    ("healpix", "grad-scale"): "backward of '' (HealpixStepper)",
    ("healpix", "rank-local-nan-check"): None,
    ("healpix", "same-batch-violated"): "forward of the batch (the model's input)",
    ("sfno", "shard-wrong-l"): "forward of 'filters.0' (SpectralFilter)",
    ("sfno", "shard-grad-replicated"): "sync",
    ("healpix", "local-sample-key"): "coverage",
    ("sfno", "band-start-from-own-size"): "forward of '' (SFNOStepper)",
    ("sfno", "m-slice-from-end"): "forward of 'filters.0' (SpectralFilter)",
    ("sfno", "noise-per-data-group"): "forward of '' (SFNOStepper)",
    ("healpix", "empty-rank-mean"): "forward of '' (HealpixStepper)",
}


#: (stepper, fault id) -> (world size, process grid, blocks) of the smallest layout that
#: shows the fault: ``check_layouts`` of ``sweep_case`` (the fault's own case, its partition
#: left to the layouts) over every layout up to 4 ranks, uneven blocks and an empty rank
#: included where the case allows them (``python -m harness.steppers.catalogue --smallest``
#: measures them again). ``tests/distributed/test_layouts.py`` checks each.
SMALLEST_LAYOUT: dict[tuple[str, str], tuple[int, tuple[int, ...], str]] = {
    ("coupled-mlp", "no-grad-sync"): (2, (1,), "even"),  # 2 ranks: grid 1, 2 data groups
    ("coupled-mlp", "wrong-shard-index"): (1, (1,), "even"),  # 1 rank: grid 1
    ("coupled-mlp", "non-differentiable-reduce"): (2, (2,), "even"),  # 2 ranks: grid 2
    ("sfno", "reduce-not-differentiable"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "reduce-double-count"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "coupling-identity-backward"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "no-grad-sync"): (2, (1, 1), "even"),  # 2 ranks: grid 1x1, 2 data groups
    ("sfno", "grad-sync-mean"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "buffer-broadcast"): (1, (1, 1), "even"),  # 1 rank: grid 1x1
    ("sfno", "mean-of-means"): (3, (3, 1), "even"),  # 3 ranks: grid 3x1
    ("sfno", "split-mismatch"): (3, (1, 3), "even"),  # 3 ranks: grid 1x3
    ("sfno", "per-rank-noise"): (2, (1, 1), "even"),  # 2 ranks: grid 1x1, 2 data groups
    ("sfno", "local-weights"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "reduce-over-world"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "shard-wrong-l"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("sfno", "shard-grad-replicated"): (2, (2, 1), "even"),  # 2 ranks: grid 2x1
    ("healpix", "rank-major-gather"): (2, (2,), "even"),  # 2 ranks: grid 2
    ("healpix", "padding-kept"): (2, (2,), "uneven"),  # 2 ranks: grid 2, uneven blocks
    ("healpix", "gather-over-world"): (2, (1,), "even"),  # 2 ranks: grid 1, 2 data groups
    ("healpix", "rank-order"): (2, (2,), "even"),  # 2 ranks: grid 2
    ("healpix", "local-neighbour-index"): (2, (2,), "even"),  # 2 ranks: grid 2
    ("healpix", "empty-skip"): (2, (2,), "empty-rank"),  # 2 ranks: grid 2, empty rank
    ("healpix", "empty-none-grad"): (2, (2,), "empty-rank"),  # 2 ranks: grid 2, empty rank
    ("healpix", "non-autograd-gather"): (2, (2,), "even"),  # 2 ranks: grid 2
    ("healpix", "grad-scale"): (2, (2,), "even"),  # 2 ranks: grid 2
    ("healpix", "rank-local-nan-check"): (2, (2,), "empty-rank"),  # 2 ranks: grid 2, empty rank
    ("healpix", "same-batch-violated"): (2, (1,), "even"),  # 2 ranks: grid 1, 2 data groups
    ("healpix", "local-sample-key"): (2, (1,), "even"),  # 2 ranks: grid 1, 2 data groups
    ("sfno", "band-start-from-own-size"): (4, (4, 1), "even"),  # 4 ranks: grid 4x1
    ("sfno", "m-slice-from-end"): (3, (1, 3), "even"),  # 3 ranks: grid 1x3
    ("sfno", "noise-per-data-group"): (2, (1, 1), "even"),  # 2 ranks: grid 1x1, 2 data groups
    ("healpix", "empty-rank-mean"): (2, (2,), "empty-rank"),  # 2 ranks: grid 2, empty rank
}


#: case arguments that pin a partition to one spatial size; a sweep drops them, so its own
#: uneven and empty-rank blocks (``SpatialCase.block_variants``) show what they were for
PINNING = {"healpix": ("bounds", "empty_ranks")}


def sweep_case(stepper: str, make: Maker, kwargs: dict[str, object], fault: str) -> SpatialCase:
    """The case whose layouts a sweep checks for ``fault``: its 4-rank case without the
    arguments that pin its partition to 4 ranks (``PINNING``)."""
    kept = {k: v for k, v in kwargs.items() if k not in PINNING.get(stepper, ())}
    return make(**kept, faults=(fault,))


def smallest_layouts(
    max_ranks: int = 4,
    *,
    select: str = "",
    pools: Callable[[int], Runner] | None = None,
    out: Callable[[str], None] = print,
) -> dict[tuple[str, str], tuple[int, tuple[int, ...], str] | None]:
    """Sweep every layout up to ``max_ranks`` of each fault (whose ``stepper:fault`` label
    contains ``select``) and return where each first shows (``None``: on no layout)."""
    from harness.layouts import check_layouts

    found: dict[tuple[str, str], tuple[int, tuple[int, ...], str] | None] = {}
    for stepper, make, kwargs, _s, fault, _expected in fault_matrix(4):
        if select not in f"{stepper}:{fault}":
            continue
        case = sweep_case(stepper, make, kwargs, fault)
        report = check_layouts(
            case, max_ranks=max_ranks, pools=pools, locate=False, exhaustive=True
        )
        smallest = report.smallest_failing
        found[(stepper, fault)] = (
            None if smallest is None else (smallest.world_size, smallest.mesh, smallest.blocks)
        )
        out(f"    ({stepper!r}, {fault!r}): {found[(stepper, fault)]},  # {smallest}")
    return found


def located_text(stepper: str, fault: str) -> str:
    """docs/faults.md's words for where a fault is located."""
    where = LOCATED[(stepper, fault)]
    if where is None:
        return "not located: the run raises or hangs"
    if where == "sync":
        return "gradient synchronisation (a parameter's gradient departs alone)"
    if where == "coverage":
        return "no value departs: items held by no rank or by several, named by key"
    return where.replace("''", "`''`")


def layout_text(stepper: str, fault: str) -> str:
    """docs/faults.md's words for the smallest layout that shows a fault.

    >>> layout_text("sfno", "mean-of-means"), layout_text("sfno", "no-grad-sync")
    ('3 ranks: grid 3x1', '2 ranks: 2 data groups of 1x1')
    >>> layout_text("coupled-mlp", "wrong-shard-index")
    '1 rank'
    >>> layout_text("healpix", "empty-rank-mean")
    '2 ranks: grid 2, a rank owning nothing'
    """
    world, mesh, blocks = SMALLEST_LAYOUT[(stepper, fault)]
    if world == 1:
        return "1 rank"
    grid, data = "x".join(map(str, mesh)), world // math.prod(mesh)
    if blocks != "even":
        grid += {"uneven": ", uneven blocks", "empty-rank": ", a rank owning nothing"}[blocks]
    return f"{world} ranks: " + (f"{data} data groups of {grid}" if data > 1 else f"grid {grid}")


def markdown_table(ranks: int = 4) -> list[str]:
    """docs/faults.md's fault table: one row per fault of the matrix on ``ranks`` ranks."""
    rows = [
        "| stepper | fault | the bug | what goes wrong | caught as | first divergence "
        "| smallest failing layout |",
        "|---|---|---|---|---|---|---|",
    ]
    for stepper, _make, _kw, _s, fault, expected in fault_matrix(ranks):
        bug, effect = DESCRIPTIONS[(stepper, fault)]
        caught = ", ".join(sorted(expected))
        where = located_text(stepper, fault)
        smallest = layout_text(stepper, fault)
        rows.append(
            f"| {stepper} | `{fault}` | {bug} | {effect} | {caught} | {where} | {smallest} |"
        )
    return rows


def inference_table(ranks: int = 4) -> list[str]:
    """FAULTS.md's table of the faults that live only in inference, with the rollout step
    where each enters (what a rollout check names)."""
    rows = [
        "| stepper | fault | the bug | what goes wrong | first divergent step |",
        "|---|---|---|---|---|",
    ]
    for stepper, _make, _kw, _s, fault, enters in inference_matrix(ranks):
        bug, effect = INFERENCE_DESCRIPTIONS[(stepper, fault)]
        rows.append(f"| {stepper} | `{fault}` | {bug} | {effect} | step {enters} |")
    return rows


def document(ranks: int = 4) -> str:
    """FAULTS.md: the catalogue the harness's own tests and ``harness-check`` prove."""
    lines = [
        "# Fault catalogue",
        "",
        "Real bugs that spatial model parallelism has produced in weather and climate models,",
        "each a `faults=` switch on a built-in stepper, placed where that bug really lives.",
        "`tests/faults/test_catalogue.py` shows that `check_equivalence` fails on each with one",
        "of the quantities below (and passes on the same layout without it), and that its first",
        "divergence points where the bug lives; `harness-check`",
        "prints the same matrix. The last column is the smallest layout that shows the fault",
        "(`harness.check_layouts` up to 4 ranks, uneven blocks and a rank owning nothing",
        "included where the case allows them; `tests/distributed/test_layouts.py`): some",
        "faults show only on uneven bands, on 3 or more azimuth ranks, with data groups, or",
        "on a rank with no cells.",
        "Generated from `harness/steppers/catalogue.py`",
        "(`python -m harness.steppers.catalogue > FAULTS.md`); a test fails if it drifts.",
        "",
        *markdown_table(ranks),
        "",
        "## Faults that live only in inference",
        "",
        "A training check runs the model in training mode with gradients: these bugs never",
        "run there, and the steppers' training checks pass with them switched on.",
        "`tests/faults/test_inference_faults.py` shows that a rollout check",
        f"(`check_equivalence(..., rollout={INFERENCE_ROLLOUT})`, `harness.rollout`) fails on each",
        "at the step where it enters (steps numbered from 0), naming that step and the field.",
        "",
        *inference_table(ranks),
        "",
        "The harness's own faults (a rank raises, dies, hangs, returns something unpicklable,",
        "leaves a collective or a send pending; a rank function that cannot be imported) are",
        "tested in `tests/distributed/test_pool.py` and `tests/plugin/`.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if "--smallest" in sys.argv:  # SMALLEST_LAYOUT's entries, measured
        smallest_layouts(select=sys.argv[-1] if sys.argv[-1] != "--smallest" else "")
    elif "--table" in sys.argv or "--readme" in sys.argv:  # --readme: its name before docs/
        print("\n".join(markdown_table()))
    else:
        sys.stdout.write(document())
