"""Sharded parameters: the SFNO stepper with its spectral weights sharded over the polar
group, as makani holds them (each rank only its l modes), checked against the reference's
whole weights by ``SpatialCase.parameter_shards``."""

from __future__ import annotations

import pytest

from harness import check_equivalence
from harness._judges import SHARD_INIT_HINT
from harness.steppers.sfno import SFNOCase

# (ranks, spatial_size, SFNOCase kwargs): l split 8 + 7 over h = 2 with copies over w = 2;
# uneven l (29 modes: 8, 8, 8, 5) over h = 4; l unsplit (every rank holds every l mode,
# copies over w = 4); spatial x data, where the same shard sits in both data groups.
LAYOUTS = [
    (4, None, {"h": 2, "w": 2}),
    (4, None, {"nlat": 30, "nlon": 62, "h": 4, "w": 1, "grid": "legendre-gauss", "noise": 1}),
    (4, None, {"h": 1, "w": 4}),
    (4, 2, {"h": 2, "w": 1, "batch_size": 4}),
    (2, None, {"h": 2, "w": 1}),
]
IDS = ["h2w2", "h4w1_uneven_l", "h1w4_copies", "h2w1_x_data2", "h2w1"]


@pytest.mark.parametrize(("ranks", "spatial_size", "kwargs"), LAYOUTS, ids=IDS)
def test_sharded_spectral_weights_are_equivalent_to_the_reference_whole_weights(
    spatial, ranks, spatial_size, kwargs
):
    case = SFNOCase(**{"nlat": 16, "nlon": 32, **kwargs}, shard_weights=True)
    report = check_equivalence(
        case, ranks=ranks, spatial_size=spatial_size, pool=spatial.pool(ranks)
    )
    assert report.ok, str(report)
    assert "spectral weights sharded over l" in report.partition
    # float64, as the unsharded stepper: reordered sums only (measured worst ~1e-13)
    assert max(report.stats[q].max_abs for q in ("loss", "grad", "field", "param")) < 1e-11


class Undeclared(SFNOCase):
    """Sharded weights the case does not declare."""

    def parameter_shards(self, model, topo):
        return {}


def test_undeclared_shards_are_a_shape_difference_that_names_parameter_shards_not_seeding(
    spatial,
):
    report = check_equivalence(
        Undeclared(h=2, w=2, shard_weights=True), ranks=4, pool=spatial.pool(4)
    )
    init = [m for m in report.mismatches if m.step is None]
    assert {m.name for m in init} == {"filters.0.weight", "filters.1.weight"}, report
    assert all(m.where.startswith("shape") for m in init)
    assert all("parameter_shards" in m.hint and "seed" not in m.hint for m in init)


def test_shards_initialised_per_rank_differ_from_the_reference_at_build(spatial):
    case = SFNOCase(h=2, w=2, shard_weights=True, shard_init="per-rank")
    report = check_equivalence(case, ranks=4, pool=spatial.pool(4))
    init = [m for m in report.mismatches if m.step is None]
    assert {(m.quantity, m.rank) for m in init} == {("param", r) for r in range(4)}, report
    assert all(m.hint == SHARD_INIT_HINT for m in init)
    assert "initial value at (" in init[0].where


def test_shards_initialised_per_rank_pass_once_the_reference_values_are_loaded(spatial):
    case = SFNOCase(h=2, w=2, shard_weights=True, shard_init="per-rank", load_reference_shards=True)
    report = check_equivalence(case, ranks=4, pool=spatial.pool(4))
    assert report.ok, str(report)
    assert report.notes and report.notes[0].startswith("reference shards loaded")
    assert "filters.0.weight, filters.1.weight" in report.notes[0]
    assert "\nNote: reference shards loaded" in str(report)


def test_a_shard_from_the_wrong_l_range_is_caught_at_build_on_the_ranks_it_moved(spatial):
    # h2w2: l 0..7 on polar rank 0 (ranks 0, 1), 8..14 on polar rank 1 (ranks 2, 3), which
    # the fault gives l 0..6 instead
    case = SFNOCase(h=2, w=2, shard_weights=True, faults=("shard-wrong-l",))
    report = check_equivalence(case, ranks=4, pool=spatial.pool(4))
    init = [m for m in report.mismatches if m.step is None]
    assert {(m.quantity, m.name, m.rank) for m in init} == {
        ("param", f"filters.{b}.weight", r) for b in (0, 1) for r in (2, 3)
    }, report
    assert all("(positions 8..14 along dim 1)" in m.where for m in init)
    assert {"field", "grad"} <= report.quantities


def test_a_shard_gradient_summed_over_the_whole_spatial_group_is_caught_as_grad(spatial):
    case = SFNOCase(nlat=17, nlon=30, h=2, w=2, shard_weights=True)
    report = check_equivalence(
        SFNOCase(nlat=17, nlon=30, h=2, w=2, shard_weights=True, faults=("shard-grad-replicated",)),
        ranks=4,
        pool=spatial.pool(4),
    )
    first = report.mismatches[0]
    assert (first.quantity, first.name, first.step) == ("grad", "filters.0.weight", 0), report
    # the copies over the azimuth group got the same wrong sum: no sync, no coverage finding
    assert not {"sync", "coverage"} & report.quantities
    assert check_equivalence(case, ranks=4, pool=spatial.pool(4)).ok


class Misnamed(SFNOCase):
    """Names a parameter the model does not have, on the ranks only."""

    def parameter_shards(self, model, topo):
        shards = super().parameter_shards(model, topo)
        return {k.replace("filters", "filter"): v for k, v in shards.items()}


def test_a_shard_of_no_parameter_is_one_error_per_rank_naming_it_the_rank_and_the_fix(spatial):
    report = check_equivalence(
        Misnamed(h=2, w=2, shard_weights=True), ranks=4, pool=spatial.pool(4)
    )
    errors = [m for m in report.mismatches if m.quantity == "error"]
    assert sorted(m.rank for m in errors) == [0, 1, 2, 3], report
    assert all(m.phase == "build" for m in errors)
    assert (
        "sfno.parameter_shards on rank 2 names 'filter.0.weight', which is not a parameter "
        "of the model; name parameters as model.named_parameters() does (did you mean "
        "'filters.0.weight'"
    ) in next(m for m in errors if m.rank == 2).detail
