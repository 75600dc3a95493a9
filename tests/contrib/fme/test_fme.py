"""ACE / fme 2026.10's spatially parallel SFNO against its own single-process path.

Runs in the fme CI venv (``pip install fme==2026.10.0`` then
``pip install "pytest-spatial-harness[fme]"``), with ``--spatial-preload
fme,torch_harmonics.distributed`` so each rank imports fme once; skipped where fme is not
installed. Tolerances are the harness's float32 defaults (an absolute term on every
quantity: the partitioned float32 SFNO differs from the serial one by up to ~3e-7 in fields
and ~3e-8 in gradients near zero): fme's SHTs and noise are float32 whatever the default
dtype, so a float64 run fails in fme's own reference path.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("fme", reason="fme is not installed here: tox -e fme (and .ci/run) runs these")

from harness import check_equivalence
from harness.contrib.fme import (
    FME_FAULTS,
    INFERENCE_FAULTS,
    FmeCase,
    FmeNotInstalled,
    fault_matrix,
    main_configs,
    require,
)
from harness.errors import ConfigError
from tests.contrib.upstream import assert_fault_caught, finding, upstream_bug

RANKS = 4


def test_missing_fme_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fme", None)
    with pytest.raises(ImportError, match=r"pytest-spatial-harness\[fme\]") as info:
        require()
    assert isinstance(info.value, FmeNotInstalled) and isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match="unknown fme fault"):
        FmeCase(faults=("nope",))


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("config", main_configs(RANKS), ids=lambda c: c[0])
def test_layout_matches_reference(spatial: Any, config: Any) -> None:
    _label, factory, kwargs, spatial_size = config
    spatial.check(factory(**kwargs), spatial_size=spatial_size)


@pytest.mark.spatial(ranks=RANKS)
def test_the_eval_path_matches_reference(spatial: Any) -> None:
    spatial.check(FmeCase(h=2, w=2, eval_output=True), steps=3)


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("fault", list(fault_matrix(RANKS)), ids=lambda f: f[4])
def test_fault_patched_into_fme_is_caught(spatial: Any, fault: Any) -> None:
    assert_fault_caught(spatial, fault, RANKS)


def fme_state() -> dict[str, Any]:
    """What fme and torch-harmonics hold in module globals on this rank."""
    import torch.distributed as dist
    import torch_harmonics.distributed.utils as thu
    from fme.ace.registry import stochastic_sfno
    from fme.ace.stepper.single_module import Stepper
    from fme.core.distributed import _gloo_patch, distributed, model_torch_distributed
    from fme.core.distributed.external.pnd_manager import DistributedManager

    return {
        "singleton": distributed.singleton is None,
        "entered": distributed.Distributed._entered,
        "manager": dict(DistributedManager._shared_state),
        "all_to_all patched": _gloo_patch._original_all_to_all is not None
        or dist.all_to_all.__module__ != "torch.distributed.distributed_c10d",
        "polar group": getattr(thu, "_POLAR_PARALLEL_GROUP", None) is None,
        # what the faults patch: fme's own functions again
        "fme functions": sorted(
            f.__qualname__
            for f in (
                model_torch_distributed.ModelTorchDistributed.spatial_reduce_sum,
                model_torch_distributed.ModelTorchDistributed._register_spatial_grad_hooks,
                model_torch_distributed.ModelTorchDistributed._get_local_spatial_shape,
                model_torch_distributed._AutogradAllReduce.backward,
                model_torch_distributed.patch_gloo_alltoall,
                _gloo_patch._gloo_all_to_all,
                DistributedManager.initialize_mesh,
                Stepper.predict_generator,
                stochastic_sfno.isotropic_noise,
            )
        ),
    }


@pytest.mark.spatial(ranks=RANKS)
def test_a_run_leaves_fme_as_it_found_it_on_every_rank(spatial: Any) -> None:
    # the warm ranks serve the next test: fme's singleton, its manager's adopted group, its
    # gloo all_to_all patch and torch-harmonics' groups must all be gone again
    clean = {
        "singleton": True,
        "entered": False,
        "manager": {},
        "all_to_all patched": False,
        "polar group": True,
        "fme functions": [
            "DistributedManager.initialize_mesh",
            "ModelTorchDistributed._get_local_spatial_shape",
            "ModelTorchDistributed._register_spatial_grad_hooks",
            "ModelTorchDistributed.spatial_reduce_sum",
            "Stepper.predict_generator",
            "_AutogradAllReduce.backward",
            "_gloo_all_to_all",
            "isotropic_noise",
            "patch_gloo_alltoall",
        ],
    }
    assert spatial.run(fme_state) == [clean] * RANKS
    spatial.check(FmeCase(h=2, w=2, faults=()))
    assert spatial.run(fme_state) == [clean] * RANKS
    # a run with every fault patched in (it fails) leaves fme's functions as they were too
    every_fault = FmeCase(h=2, w=2, faults=tuple(FME_FAULTS))
    assert not check_equivalence(every_fault, ranks=RANKS, pool=spatial.pool(RANKS)).ok
    assert spatial.run(fme_state) == [clean] * RANKS
    # and so does a rollout through fme's predict with the inference faults acting in it
    inference = FmeCase(h=2, w=2, faults=INFERENCE_FAULTS, noise_weights_std=0.5)
    assert not check_equivalence(
        inference, ranks=RANKS, steps=1, rollout=2, pool=spatial.pool(RANKS)
    ).ok
    assert spatial.run(fme_state) == [clean] * RANKS
    assert fme_state() == clean  # the reference's process too


@pytest.mark.spatial(ranks=RANKS)
def test_fme_groups_that_differ_from_the_topology_are_one_line_on_every_rank(spatial: Any) -> None:
    # fme builds its own groups from its own mesh; harness.adopt.check_group holds them
    # against the topology, so a layout the two disagree on is refused, never judged
    case = FmeCase(h=2, w=1, batch_size=4, noise_embed_dim=0, faults=("mesh-data-innermost",))
    report = check_equivalence(case, ranks=RANKS, spatial_size=2, pool=spatial.pool(RANKS))
    assert sorted((m.quantity, m.rank, m.phase) for m in report.mismatches) == [
        ("error", rank, "build") for rank in range(RANKS)
    ]
    assert {m.where for m in report.mismatches} == {
        "GroupMismatch: fme's spatial group does not hold the ranks the topology says on "
        "rank 0, 1, 2, 3: rank 0 holds [0, 2], the topology's spatial group is [0, 1]; "
        "rank 1 holds [1, 3], the topology's spatial group is [0, 1] (and 2 more ranks); "
        "build it from topo.spatial_ranks, or hand the model the harness's own group "
        "(harness.adopt)"
    }


def test_harness_check_model_fme_prints_the_table_and_passes(tmp_path: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--model", "fme", "--ranks", str(RANKS)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "harness: checking fme on 4 ranks" in proc.stdout
    assert "worst relative error per quantity, partitioned vs reference:" in proc.stdout
    assert f"{len(list(fault_matrix(RANKS)))}/{len(list(fault_matrix(RANKS)))} faults caught" in (
        proc.stdout
    )
    assert "ALL CHECKS PASSED" in proc.stdout


# ---------------------------- findings (docs/how-to/real-models.md, "Found by harness")


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: global_layer_norm builds nn.LayerNorm over the global "
    "(C, nlat, nlon) image on every rank, so a spatially partitioned block cannot be "
    "normalised; nothing refuses the option under spatial parallelism"
)
def test_global_layer_norm_under_spatial_parallelism(spatial: Any) -> None:
    finding(
        spatial,
        FmeCase(h=2, w=2, global_layer_norm=True),
        RANKS,
        lambda m, _: (
            m.quantity == "error" and m.phase == "step 0 forward" and "normalized_shape" in m.where
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: clip_latent_global_means takes x.mean over the rank's own block "
    "as the 'global' mean and reduces its envelope over the data group only, so in eval "
    "every spatial rank clips by its block's statistics, not the globe's"
)
def test_latent_mean_clipping_under_spatial_parallelism(spatial: Any) -> None:
    finding(
        spatial,
        FmeCase(h=2, w=2, eval_output=True, clip_latent_global_means=True),
        RANKS,
        # only the eval-mode output differs: training itself is equivalent
        lambda m, report: (
            {(x.quantity, x.name) for x in report.mismatches} == {("field", "eval output")}
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: NoiseConditionedModel draws gaussian noise with randn at the "
    "rank's local (nlat/h, nlon/w) shape from the replicated RNG state, so every spatial "
    "tile gets the same noise and none gets its slice of the global field"
)
def test_gaussian_noise_under_spatial_parallelism(spatial: Any) -> None:
    noise_fed = ("W_scale_2d", "W_bias_2d")  # the conditioning layers that read the noise
    finding(
        spatial,
        FmeCase(h=2, w=2, noise_type="gaussian", num_layers=1),
        RANKS,
        lambda m, report: (
            m.quantity == "grad"
            and any(k in m.name for k in noise_fed)
            and "field" in report.quantities
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: the makani-linear SpectralConvS2 keeps modes_lat_local = "
    "modes_lat (its weight is never sliced to the rank's l range), so with h > 1 its "
    "contraction meets the distributed SHT's local modes and fails"
)
def test_makani_linear_filter_with_a_split_latitude(spatial: Any) -> None:
    finding(
        spatial,
        FmeCase(h=2, w=2, filter_type="makani-linear", num_layers=1),
        RANKS,
        lambda m, _: m.quantity == "error" and m.phase == "step 0 forward",
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: SpectralConvS2's spectral LoRA factors (lora_A, lora_B) are "
    "global in l and applied to x[..., :modes_lat, :] while the main weight is sliced to "
    "the rank's l range (self._l_slice), so with h > 1 the LoRA einsum fails"
)
def test_spectral_lora_with_a_split_latitude(spatial: Any) -> None:
    finding(
        spatial,
        FmeCase(h=2, w=2, num_layers=1, options={"spectral_lora_rank": 2}),
        RANKS,
        lambda m, _: m.quantity == "error" and m.phase == "step 0 forward",
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: filter_output runs the output (out_chans channels) through the "
    "distributed SHT, whose transposes (torch-harmonics 0.8.0) split the channel dim over "
    "the w (or h) group and assert channels >= ranks; fme checks nothing, so an SFNO with "
    "fewer output channels than w ranks crashes"
)
def test_output_filter_with_fewer_channels_than_ranks(spatial: Any) -> None:
    finding(
        spatial,
        FmeCase(h=1, w=4, num_layers=1, channels=2, filter_output=True),
        RANKS,
        lambda m, _: (
            m.quantity == "error"
            and m.phase == "step 0 forward"
            and "cannot split dim -3 of size 2 into" in m.where
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: the atmosphere corrector's global means (here "
    "zero_global_mean_moisture_advection) go through spatial_reduce_sum, whose "
    "_AutogradAllReduce has an identity backward (right only for the loss); inside the "
    "model the mean feeds every point, so each rank drops the other ranks' share of its "
    "gradient: forward exact, gradients wrong"
)
def test_corrector_global_mean_under_spatial_parallelism(spatial: Any) -> None:
    finding(
        spatial,
        FmeCase(h=2, w=2, num_layers=1, corrector={"zero_global_mean_moisture_advection": True}),
        RANKS,
        # the forward is exact (step 0's loss and output match); only gradients differ
        lambda m, report: (
            m.quantity == "grad"
            and m.step == 0
            and not {(x.quantity, x.step) for x in report.mismatches} & {("loss", 0), ("field", 0)}
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize(
    "options",
    [
        {"filter_type": "makani-linear"},
        {"options": {"spectral_lora_rank": 2}},
        # 4 channels: torch-harmonics splits channels over the w group (see the finding below)
        {"filter_residual": True, "filter_output": True, "channels": 4},
        {"normalize_big_skip": True, "affine_norms": True},
        {"pos_embed": False, "context_pos_embed_dim": 3},
        {"options": {"local_blocks": [0], "lora_rank": 2}},
        {"corrector": {"force_positive_names": ["var1"]}},
    ],
    ids=["makani", "spectral-lora", "filters", "norms", "context-pos", "disco-lora", "clamp"],
)
def test_options_on_a_longitude_only_split_match_reference(spatial: Any, options: Any) -> None:
    # h = 1: the l axis is whole on every rank, where makani-linear and spectral LoRA work
    spatial.check(FmeCase(h=1, w=4, num_layers=1, **options), steps=1)
