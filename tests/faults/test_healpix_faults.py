"""Every HEALPix fault of FAULTS.md fails check_equivalence with the quantity that shows it."""

from __future__ import annotations

import pytest

from harness import ConfigError, check_equivalence
from harness.steppers.healpix import HEALPIX_FAULTS, HealpixCase

RANKS = 4

# Layouts: the smallest that show each bug. Two samples per data group (rank-major
# flattening needs batch >= 2), an uneven partition whose first rank is short (padding moves
# the later ranks' rows), two data groups (the world is not the spatial group), and a rank
# that owns cells but sees no observation and no target (empty-domain bugs).
EVEN = ({"nside": 2}, None)
UNEVEN = ({"nside": 2, "bounds": (0, 8, 20, 34, 48)}, None)
DATA2 = ({"nside": 2, "batch_size": 4}, 2)
QUIET = ({"nside": 2, "bounds": (0, 12, 24, 36, 48), "empty_ranks": (1,)}, None)

# fault -> (what FAULTS.md says catches it, layout, check_equivalence timeout)
CASES = {
    "rank-major-gather": ({"field"}, EVEN, None),
    "padding-kept": ({"field", "error"}, UNEVEN, None),
    "gather-over-world": ({"field"}, DATA2, None),
    "rank-order": ({"field"}, EVEN, None),
    "local-neighbour-index": ({"field"}, EVEN, None),
    "empty-skip": ({"timeout"}, QUIET, 3),
    "empty-none-grad": ({"grad", "error"}, QUIET, None),
    "non-autograd-gather": ({"grad"}, EVEN, None),
    "grad-scale": ({"grad"}, EVEN, None),
    "rank-local-nan-check": ({"timeout", "field"}, QUIET, 3),
    "same-batch-violated": ({"field", "loss"}, EVEN, None),
}


def _check(kwargs, spatial_size, spatial, **extra):
    return check_equivalence(
        HealpixCase(**kwargs), ranks=RANKS, spatial_size=spatial_size,
        pool=spatial._registry.get(RANKS), **extra,
    )


def test_every_healpix_fault_of_the_catalogue_has_a_case_here():
    assert set(CASES) == HEALPIX_FAULTS


def _first_at_sample_1_cell(report):
    first = report.mismatches[0]
    assert report.quantities == {"field"} and first.step == 0 and first.name == "prediction"
    assert first.where.startswith("[1, ") and " cell " in first.where  # sample 1, a cell id


def _grads_exactly_4x(report):
    step0 = [m for m in report.mismatches if m.step == 0]
    assert {m.quantity for m in step0} == {"grad", "param"}  # the loss value itself is right
    assert all("exactly 4x the reference" in m.hint for m in step0 if m.quantity == "grad")


def _others_wait_in_the_latent_gather(report):
    waiting = [m for m in report.mismatches if m.quantity == "timeout"]
    assert {m.rank for m in waiting} == {0, 2, 3}  # rank 1 returned early and is idle
    assert all("all_gather" in m.detail and "gather_latent" in m.detail for m in waiting)


def _error_on_every_rank_naming_the_parameters(report):
    errors = [m for m in report.mismatches if m.quantity == "error"]
    assert {m.rank for m in errors} == {0, 1, 2, 3}
    assert all("left out of the loss graph on ranks {1: 4}" in m.where for m in errors)
    assert "obs_net.0.weight" in next(m for m in errors if m.rank == 1).where


def _every_rank_stuck(report):
    waiting = [m for m in report.mismatches if m.quantity == "timeout"]
    assert {m.rank for m in waiting} == {0, 1, 2, 3}  # rank 1 one collective ahead
    assert "check_graph" in waiting[0].detail


# what else the measured report must say, beyond the quantity
EVIDENCE = {
    "rank-major-gather": _first_at_sample_1_cell,
    "grad-scale": _grads_exactly_4x,
    "empty-skip": _others_wait_in_the_latent_gather,
    "empty-none-grad": _error_on_every_rank_naming_the_parameters,
    "rank-local-nan-check": _every_rank_stuck,
}


@pytest.mark.parametrize("fault", sorted(CASES))
def test_each_fault_fails_with_the_quantity_the_catalogue_names(spatial, fault):
    expected, (kwargs, spatial_size), timeout = CASES[fault]
    broken = _check({**kwargs, "faults": {fault}}, spatial_size, spatial, timeout=timeout)
    assert not broken.ok, f"{fault} went unnoticed"
    assert broken.quantities & expected, broken
    EVIDENCE.get(fault, lambda report: None)(broken)


@pytest.mark.parametrize(
    ("kwargs", "spatial_size"),
    [EVEN, UNEVEN, DATA2, QUIET],
    ids=["even", "uneven", "data2", "quiet"],
)
def test_every_fault_layout_passes_without_the_fault(spatial, kwargs, spatial_size):
    report = _check(kwargs, spatial_size, spatial)
    assert report.ok, report


# A fault the layout cannot show passes: these are the layouts the cases above avoid.
BLIND = {
    "rank-major-gather": {"nside": 2, "batch_size": 1},  # one sample: both orders agree
    "padding-kept": {"nside": 2},  # even split: nothing padded
    "local-neighbour-index": {"nside": 2, "bounds": (0, 48, 48, 48, 48)},  # local == global
}


@pytest.mark.parametrize("fault", sorted(BLIND))
def test_a_layout_without_the_bugs_trigger_cannot_show_it(spatial, fault):
    assert _check({**BLIND[fault], "faults": {fault}}, None, spatial).ok


def test_an_unknown_fault_id_is_refused_with_the_valid_ones_listed():
    with pytest.raises(ConfigError, match=r"valid ids: .*rank-major-gather"):
        HealpixCase(faults={"rank-minor-gather"})
