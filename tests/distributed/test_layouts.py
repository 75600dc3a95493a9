"""Every layout, and the smallest that fails: ``check_layouts`` on the stencil model of
``stencil.py``, whose bugs each show on some layouts only, and the grid handed to the
built-in SFNO stepper through ``Topology.mesh``."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import check_equivalence, check_layouts
from harness.steppers import catalogue
from harness.steppers.catalogue import fault_matrix
from harness.steppers.healpix import HealpixCase
from harness.steppers.mlp import CoupledMLPCase
from harness.steppers.sfno import SFNOCase
from tests.distributed.stencil import SMALLEST, StencilCase


class ReturnlessStencil(StencilCase):
    """A stencil whose build forgets ``return model`` on every rank but spatial rank 0 (so
    the reference, spatial rank 0 of one, builds; module level: the ranks import it)."""

    def build(self, topo):
        model = super().build(topo)
        if topo.spatial_rank == 0:
            return model
        return None


#: (world size, grid) of every layout up to 4 ranks where each bug shows (the docstring of
#: stencil.py says why); with a batch of 2, 3 and 4 data groups of 1 rank are refused
SHOWS_ON = {
    "mean-of-means": {(3, (3, 1)), (3, (1, 3)), (4, (4, 1))},
    "transposed": {(4, (2, 2))},
    "halo-2": {(2, (1, 2)), (3, (1, 3)), (4, (1, 2)), (4, (1, 4)), (4, (2, 2))},
}


@pytest.mark.spatial_pool  # the layouts of 1 to 4 ranks: under a launcher only its 4 run
def test_a_correct_stencil_passes_every_layout_up_to_4_ranks(spatial):
    report = spatial.check_layouts(StencilCase(), max_ranks=4, exhaustive=True)
    assert len(report.passed) == 11, report
    refused = {(r.layout.world_size, r.layout.data_size) for r in report.refused}
    assert refused == {(3, 3), (4, 4)}, report  # 2 samples over 3 or 4 data groups


@pytest.mark.parametrize("fault", sorted(SHOWS_ON))
def test_a_bug_is_reported_at_the_smallest_layout_it_shows_on(spatial, fault):
    report = check_layouts(
        StencilCase(fault), max_ranks=4, pools=spatial.pool, locate=False, exhaustive=True
    )
    failing = {(r.layout.world_size, r.layout.mesh) for r in report.failing}
    assert failing == SHOWS_ON[fault], report
    smallest = report.smallest_failing
    assert smallest is not None and (smallest.world_size, smallest.mesh) == SMALLEST[fault]
    assert str(report).index(f"Smallest failing layout, {smallest}:") < str(report).index(
        "Every layout"
    )


@pytest.mark.spatial_pool  # pools of 1 and 2 ranks: a launcher of 4 runs its own 4
def test_the_fixture_fails_with_the_smallest_failing_layout_located_first(spatial):
    with pytest.raises(pytest.fail.Exception) as failed:
        spatial.check_layouts(StencilCase("halo-2"), max_ranks=2)
    text = str(failed.value)
    # up to 2 ranks every layout is the smallest with some level: the covering set is all
    assert text.startswith("stencil-halo-2: layouts 4 of 4 (covering) up to 2 ranks, 3 passed")
    lead = text.split("Every layout")[0]
    assert "Smallest failing layout, 2 ranks: grid 1x2:" in lead
    assert "First divergence:" in lead  # the smallest failing layout is located


def test_the_sfno_stepper_runs_the_grid_it_is_handed_not_its_hard_coded_one(spatial):
    report = check_equivalence(
        SFNOCase(h=2, w=2), ranks=4, mesh=(1, 4), pool=spatial.pool(4), locate=False
    )
    assert report.ok, report
    assert "on 1x4" in report.partition


SWEPT = """
from tests.distributed.stencil import StencilCase


def test_halo(spatial):
    spatial.check(StencilCase("halo-2"))


def test_transposed(spatial):
    spatial.check(StencilCase("transposed"))
"""


# a child pytest with pools of its own; under srun it would take the step's tasks for its ranks
@pytest.mark.spatial_pool
def test_spatial_layouts_turns_every_check_into_a_sweep_that_names_the_smallest_layout(
    pytester, monkeypatch
):
    # the ranks import the case from this repository's tests package
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    pytester.makepyfile(test_swept=SWEPT)
    args = ("--spatial-ranks=4", "-p", "no:cacheprovider")
    # on 4 ranks the stencil's own grid is 4 x 1: neither bug shows
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    swept = pytester.runpytest_subprocess(*args, "--spatial-layouts=2")
    swept.assert_outcomes(passed=1, failed=1)  # the transposed shard needs 2 x 2: 4 ranks
    swept.stdout.fnmatch_lines(
        ["*Smallest failing layout, 2 ranks: grid 1x2:*", "*FAILED test_swept.py::test_halo*"]
    )
    swept.stdout.fnmatch_lines(["*stencil-halo-2: layouts 4 of 4 (covering) up to 2 ranks*"])
    # --spatial-layouts-all: every sweep of the session exhaustive (the nightly job's flag)
    every = pytester.runpytest_subprocess(*args, "--spatial-layouts=2", "--spatial-layouts-all")
    every.assert_outcomes(passed=1, failed=1)
    every.stdout.fnmatch_lines(["*stencil-halo-2: 4 layout(s) up to 2 ranks, 3 passed, 1 failed*"])


CATALOGUE = {(s, f): (make, kwargs) for s, make, kwargs, _sp, f, _q in fault_matrix(4)}


def test_every_fault_of_the_catalogue_has_its_smallest_failing_layout():
    assert set(catalogue.SMALLEST_LAYOUT) == set(CATALOGUE)


@pytest.mark.parametrize(
    "key", sorted(catalogue.SMALLEST_LAYOUT), ids=lambda key: f"{key[0]}:{key[1]}"
)
def test_each_catalogue_fault_shows_first_at_its_recorded_smallest_layout(spatial, key):
    world, mesh, blocks = catalogue.SMALLEST_LAYOUT[key]
    make, kwargs = CATALOGUE[key]
    # the layouts up to its world size, uneven and empty blocks too: every smaller one
    # passes (or is refused)
    case = catalogue.sweep_case(key[0], make, kwargs, key[1])
    report = check_layouts(case, max_ranks=world, pools=spatial.pool, locate=False)
    smallest = report.smallest_failing
    assert smallest is not None, report
    assert (smallest.world_size, smallest.mesh, smallest.blocks) == (world, mesh, blocks), report


def test_the_main_jobs_sweep_prints_each_layout_and_fails_naming_the_smallest(spatial):
    from harness.layouts import sweep_cases

    lines: list[str] = []
    failures = sweep_cases(
        [("stencil", StencilCase()), ("stencil halo", StencilCase("halo-2"))],
        2,
        spatial.pool,
        out=lines.append,
    )
    (failure,) = failures  # the correct stencil passed
    assert failure.startswith("stencil halo: stencil-halo-2: layouts 4 of 4 (covering) up to 2")
    assert failure.endswith("smallest failing layout: 2 ranks: grid 1x2")
    assert any("Smallest failing layout, 2 ranks: grid 1x2:" in text for text in lines)
    assert "  pass  2 ranks: grid 2x1" in lines and "  FAIL  2 ranks: grid 1x2" in lines


#: the built-in steppers, correct, with a batch that splits over 1, 2, 3, 4, 6 and 8 data
#: groups (5 and 7 are refused: 24 samples do not split over them); the SFNO's 4 samples
#: keep its sweep affordable (3, 5, 6, 7 and 8 data groups refused)
BUILT_IN = {
    "coupled-mlp": lambda: CoupledMLPCase(batch_size=24),
    "sfno": lambda: SFNOCase(batch_size=4),
    "healpix": lambda: HealpixCase(nside=2, batch_size=24, n_obs=12),
}


# every layout of 1 to 8 ranks, each pool started once: the slowest tests of this file (a
# minute or more each on 2 busy cores); pools of its own, so not under a launcher
@pytest.mark.spatial_pool
@pytest.mark.parametrize("stepper", sorted(BUILT_IN))
def test_each_correct_built_in_stepper_passes_every_layout_up_to_8_ranks(spatial, stepper):
    report = spatial.check_layouts(BUILT_IN[stepper](), max_ranks=8, locate=False, exhaustive=True)
    assert report.ok and {r.layout.world_size for r in report.passed} == set(range(1, 9))
    # only data splits the batch cannot make are refused, never a grid or blocks
    assert all("samples do not split" in r.refused for r in report.refused), report
    kinds = {r.layout.blocks for r in report.passed}
    assert kinds == ({"even", "uneven", "empty-rank"} if stepper == "healpix" else {"even"})


#: (world size, grid, blocks) of every layout up to 4 ranks where each of the catalogue's
#: layout-only faults shows (its sweep case: the fault's own, partition left to the layouts)
STEPPER_SHOWS_ON = {
    # w >= 3 only: 1x3 and 1x4; the 2x2 grid's second azimuth rank is its last, and passes
    ("sfno", "m-slice-from-end"): {(3, (1, 3), "even"), (4, (1, 4), "even")},
    # uneven bands only: 30 latitudes in bands of [15, 15], [10, 10, 10], [8, 8, 8, 6]
    ("sfno", "band-start-from-own-size"): {(4, (4, 1), "even")},
    # a rank owning no cell only, with or without data groups
    ("healpix", "empty-rank-mean"): {
        (2, (2,), "empty-rank"),
        (3, (3,), "empty-rank"),
        (4, (4,), "empty-rank"),
        (4, (2,), "empty-rank"),
    },
}


@pytest.mark.parametrize("key", sorted(STEPPER_SHOWS_ON), ids=lambda key: f"{key[0]}:{key[1]}")
def test_a_built_in_fault_of_some_layouts_fails_on_those_only(spatial, key):
    make, kwargs = CATALOGUE[key]
    case = catalogue.sweep_case(key[0], make, kwargs, key[1])
    report = check_layouts(case, max_ranks=4, pools=spatial.pool, locate=False, exhaustive=True)
    failing = {(r.layout.world_size, r.layout.mesh, r.layout.blocks) for r in report.failing}
    assert failing == STEPPER_SHOWS_ON[key], report
    assert len(report.passed) >= 8, report  # the others ran, and passed


@pytest.mark.spatial_pool  # pools of 1 and 2 ranks: a launcher of 4 runs its own 4
def test_a_build_that_returns_none_on_some_ranks_fails_those_layouts_not_refuses_them(spatial):
    report = check_layouts(ReturnlessStencil(), max_ranks=2, pools=spatial.pool, locate=False)
    assert not report.ok and not report.refused, report
    assert {r.layout.mesh for r in report.failing} == {(2, 1), (1, 2)}
    first = report.smallest_report.mismatches[0]
    assert (first.quantity, first.rank, first.phase) == ("error", 1, "build")
    assert first.where.startswith("ConfigError: stencil.build returned None; it must return")


@pytest.mark.spatial_pool  # a pool of 1 rank: a launcher of 4 runs its own 4
def test_a_sweep_of_one_rank_split_nothing_and_fails_as_vacuous(spatial):
    report = check_layouts(StencilCase(), max_ranks=1, pools=spatial.pool, locate=False)
    assert len(report.passed) == 1 and report.vacuous and not report.ok, report
    assert "no layout run split the domain (every one has spatial size 1): vacuous" in str(report)
