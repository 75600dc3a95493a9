"""Every HEALPix fault of FAULTS.md fails check_equivalence with the quantity that shows it."""

from __future__ import annotations

import pytest

from harness import ConfigError, check_equivalence
from harness._judges import GLOBAL_SAMPLE_HINT
from harness.steppers.healpix import (
    DATA2,
    EVEN,
    FAULT_CHECKS,
    HEALPIX_FAULTS,
    QUIET,
    TOKENS2,
    UNEVEN,
    HealpixCase,
)

RANKS = 4

# Layouts and expected quantities live in the stepper (FAULT_CHECKS), shared with the
# catalogue test (tests/faults/test_catalogue.py) and the main job; here: the extra evidence.
TIMEOUT = 8  # seconds: generous on a loaded 2-core machine, the hang itself is certain


def _check(kwargs, spatial_size, spatial, **extra):
    return check_equivalence(
        HealpixCase(**kwargs),
        ranks=RANKS,
        spatial_size=spatial_size,
        pool=spatial.pool(RANKS),
        **extra,
    )


def test_every_healpix_fault_of_the_catalogue_has_a_layout():
    assert set(FAULT_CHECKS) == HEALPIX_FAULTS


def _first_at_sample_1_cell(report):
    first = report.mismatches[0]
    assert report.quantities == {"field"} and first.step == 0 and first.name == "prediction"
    assert first.where.startswith("[1, ") and " cell " in first.where  # sample 1, a cell id


def _grads_exactly_4x(report):
    step0 = [m for m in report.mismatches if m.step == 0]
    assert {m.quantity for m in step0} == {"grad", "param"}  # the loss value itself is right
    assert all("exactly 4x the reference" in m.hint for m in step0 if m.quantity == "grad")


def _others_wait_in_the_latent_gather(report):
    culprit, *waiting = [m for m in report.mismatches if m.quantity == "deadlock"]
    assert culprit.rank == 1 and "never entered" in culprit.where  # named first
    assert {m.rank for m in waiting} == {0, 2, 3}
    assert all("all_gather" in m.detail and "gather_latent" in m.detail for m in waiting)


def _error_on_every_rank_naming_the_parameters(report):
    errors = [m for m in report.mismatches if m.quantity == "error"]
    assert {m.rank for m in errors} == {0, 1, 2, 3}
    assert all("left out of the loss graph on ranks {1: 4}" in m.where for m in errors)
    assert "obs_net.0.weight" in next(m for m in errors if m.rank == 1).where


def _every_rank_stuck(report):
    waiting = [m for m in report.mismatches if m.quantity == "deadlock"]
    assert {m.rank for m in waiting} == {0, 1, 2, 3}  # rank 1 one collective ahead
    assert any("check_graph" in m.detail for m in waiting)


def _tokens_of_two_groups_share_keys(report):
    several = [m for m in report.mismatches if "held by several ranks" in m.where]
    assert several and all(m.hint == GLOBAL_SAMPLE_HINT for m in several)
    assert any("of the reference held by no rank" in m.where for m in report.mismatches)
    assert all(" in cell " in m.where for m in report.mismatches)  # named by key and cell


# what else the measured report must say, beyond the quantity
EVIDENCE = {
    "local-sample-key": _tokens_of_two_groups_share_keys,
    "rank-major-gather": _first_at_sample_1_cell,
    "grad-scale": _grads_exactly_4x,
    "empty-skip": _others_wait_in_the_latent_gather,
    "empty-none-grad": _error_on_every_rank_naming_the_parameters,
    "rank-local-nan-check": _every_rank_stuck,
}


@pytest.mark.parametrize("fault", sorted(EVIDENCE))
def test_the_report_of_each_fault_carries_the_evidence_that_points_at_it(spatial, fault):
    expected, kwargs, spatial_size = FAULT_CHECKS[fault]
    timeout = TIMEOUT if "deadlock" in expected else None
    broken = _check({**kwargs, "faults": {fault}}, spatial_size, spatial, timeout=timeout)
    assert broken.quantities & expected, broken
    EVIDENCE[fault](broken)


@pytest.mark.parametrize(
    ("kwargs", "spatial_size"),
    [(EVEN, None), (UNEVEN, None), (DATA2, 2), (QUIET, None), (TOKENS2, 2)],
    ids=["even", "uneven", "data2", "quiet", "tokens2"],
)
def test_every_fault_layout_passes_without_the_fault(spatial, kwargs, spatial_size):
    report = _check(kwargs, spatial_size, spatial)
    assert report.ok, report


# A fault the layout cannot show passes: these are the layouts the cases above avoid.
BLIND = {
    "rank-major-gather": {"nside": 2, "batch_size": 1},  # one sample: both orders agree
    "padding-kept": {"nside": 2},  # even split: nothing padded
    "local-neighbour-index": {"nside": 2, "bounds": (0, 48, 48, 48, 48)},  # local == global
    "local-sample-key": {"nside": 2, "tokens": 3},  # one data group: local == global
}


@pytest.mark.parametrize("fault", sorted(BLIND))
def test_a_layout_without_the_bugs_trigger_cannot_show_it(spatial, fault):
    assert _check({**BLIND[fault], "faults": {fault}}, None, spatial).ok


def test_an_unknown_fault_id_is_refused_with_the_valid_ones_listed():
    with pytest.raises(ConfigError, match=r"valid ids: .*rank-major-gather"):
        HealpixCase(faults={"rank-minor-gather"})
