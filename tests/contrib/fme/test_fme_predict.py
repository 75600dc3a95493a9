"""fme's own inference path (its ``Stepper.predict``, the seed's ``predict`` golden) rolled
out on 2 x 2 against its single-process path, step by step (``rollout=N``).

Runs in the fme CI venv like ``test_fme.py`` (``--spatial-preload
fme,torch_harmonics.distributed``); skipped where fme is not installed. The rollout's
tolerance is its own rounding spread (``harness.rollout``), so no tolerance is set here.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fme", reason="fme is not installed here: tox -e fme (and .ci/run) runs these")

import torch

from harness import check_equivalence
from harness.contrib.fme import INFERENCE_FAULTS, FmeCase, main_configs
from harness.errors import ConfigError
from harness.topology import Topology
from tests.contrib.upstream import expect_upstream, upstream_bug

RANKS = 4
#: forward steps of fme's predict: past the step where each inference fault enters (0, 1)
ROLLOUT = 6
#: the step where each inference-only fault first shows: per-rank noise in the first
#: forward step already, a forcing kept from step 0 once step 1 reads its own forcing
ENTERS = {"inference-noise-per-rank": 0, "inference-stale-forcing": 1}
#: fme initialises its noise conditioning to zero (the noise moves no output until trained):
#: the rollouts run with trained-like weights there, so fme's noise is compared too
TRAINED = {"noise_weights_std": 0.5}


def test_fme_predict_refuses_what_it_cannot_roll_out_in_one_line() -> None:
    single = Topology.single()
    with pytest.raises(ConfigError, match=r"corrector=\{.*\}: roll out with .*corrector=None"):
        FmeCase(corrector={"force_positive_names": ["var1"]}).predict(
            torch.nn.Module(), {}, single, 2
        )
    with pytest.raises(ConfigError, match="pass clip_latent_global_means=True"):
        FmeCase(latent_mean_envelope=(-0.1, 0.1)).predict(torch.nn.Module(), {}, single, 2)


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("weights", [{}, TRAINED], ids=["as-built", "trained-noise"])
def test_fmes_own_predict_on_2x2_matches_its_single_process_predict(
    spatial: Any, weights: dict[str, Any]
) -> None:
    case = FmeCase(h=2, w=2, **weights)
    report = check_equivalence(
        case, ranks=RANKS, steps=1, rollout=ROLLOUT, pool=spatial.pool(RANKS)
    )
    assert report.ok, report
    # every forward step of both of fme's outputs was compared (prognostic and diagnostic)
    assert report.rollout is not None
    compared = {(p.step, p.name) for p in report.rollout.curve}
    assert compared == {(k, n) for k in range(ROLLOUT) for n in ("var1", "diagnostic")}


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("config", main_configs(RANKS), ids=lambda c: c[0])
def test_fmes_own_predict_matches_on_every_main_layout(spatial: Any, config: Any) -> None:
    # uneven blocks and data groups too (the data layout runs without noise: main_configs)
    _label, factory, kwargs, spatial_size = config
    weights = TRAINED if kwargs.get("noise_embed_dim", 4) else {}
    report = check_equivalence(
        factory(**kwargs, **weights),
        ranks=RANKS,
        spatial_size=spatial_size,
        steps=1,
        rollout=ROLLOUT,
        pool=spatial.pool(RANKS),
    )
    assert report.ok, report


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("fault", INFERENCE_FAULTS)
def test_an_inference_fault_in_fmes_predict_fails_at_the_step_where_it_enters(
    spatial: Any, fault: str
) -> None:
    report = check_equivalence(
        FmeCase(h=2, w=2, faults=(fault,), **TRAINED),
        ranks=RANKS,
        steps=1,
        rollout=ROLLOUT,
        pool=spatial.pool(RANKS),
    )
    # training stays equivalent: only fme's inference path carries the fault
    assert report.quantities == {"rollout"}, report
    assert report.rollout is not None
    first = report.rollout.first
    assert first is not None and first.step == ENTERS[fault], report
    assert f"First divergent step: step {ENTERS[fault]} of {ROLLOUT}, field '{first.name}'" in str(
        report
    ), report


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "fme 2026.10.0: in eval, clip_latent_global_means clips x.mean over the rank's own "
    "block (not the globe's) to the checkpoint's envelope, so fme's predict on a spatial "
    "layout shifts every tile's latent by its own block's excess: rank-local in inference"
)
def test_latent_mean_clipping_in_fmes_predict_on_2x2(spatial: Any) -> None:
    # a checkpoint's envelope narrower than the latent means the inputs give, so fme clips
    case = FmeCase(h=2, w=2, clip_latent_global_means=True, latent_mean_envelope=(-0.05, 0.05))
    report = check_equivalence(
        case, ranks=RANKS, steps=1, rollout=ROLLOUT, pool=spatial.pool(RANKS)
    )
    expect_upstream(
        report,
        # training equivalent (the clip acts in eval only); fme's predict fails at step 0
        lambda m, r: (
            r.quantities == {"rollout"}
            and r.rollout is not None
            and r.rollout.first is not None
            and r.rollout.first.step == 0
        ),
    )
