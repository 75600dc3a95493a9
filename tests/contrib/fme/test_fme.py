"""ACE / fme 2026.10's spatially parallel SFNO against its own single-process path.

Runs in the fme CI venv (``pip install fme==2026.10.0`` then
``pip install "pytest-spatial-harness[fme]"``), with ``--spatial-preload
fme,torch_harmonics.distributed`` so each rank imports fme once; skipped where fme is not
installed. Tolerances are the harness's float32 defaults: fme's spectral weights are float32
whatever the default dtype (a float64 run fails in fme's own ``_contract_dhconv``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("fme", reason="fme is not installed here: tox -e fme (and .ci/run) runs these")

from harness.contrib.fme import FmeCase, fault_matrix, main_configs, require
from harness.errors import ConfigError
from tests.contrib.upstream import UpstreamBug, assert_fault_caught, finding

RANKS = 4


def test_missing_fme_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fme", None)
    with pytest.raises(ConfigError, match=r"pytest-spatial-harness\[fme\]"):
        require()
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
    from fme.core.distributed import _gloo_patch, distributed
    from fme.core.distributed.external.pnd_manager import DistributedManager

    return {
        "singleton": distributed.singleton is None,
        "entered": distributed.Distributed._entered,
        "manager": dict(DistributedManager._shared_state),
        "all_to_all patched": _gloo_patch._original_all_to_all is not None
        or dist.all_to_all.__module__ != "torch.distributed.distributed_c10d",
        "polar group": getattr(thu, "_POLAR_PARALLEL_GROUP", None) is None,
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
    }
    assert spatial.run(fme_state) == [clean] * RANKS
    spatial.check(FmeCase(h=2, w=2, faults=()))
    assert spatial.run(fme_state) == [clean] * RANKS
    assert fme_state() == clean  # the reference's process too


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


# ---------------------------------------------------------------------- findings (README)


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.xfail(
    strict=True,
    raises=UpstreamBug,
    reason="fme 2026.10.0: global_layer_norm builds nn.LayerNorm over the global "
    "(C, nlat, nlon) image on every rank, so a spatially partitioned block cannot be "
    "normalised; nothing refuses the option under spatial parallelism",
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
@pytest.mark.xfail(
    strict=True,
    raises=UpstreamBug,
    reason="fme 2026.10.0: clip_latent_global_means takes x.mean over the rank's own block "
    "as the 'global' mean and reduces its envelope over the data group only, so in eval "
    "every spatial rank clips by its block's statistics, not the globe's",
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
