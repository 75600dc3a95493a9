"""The covering sweep loses nothing: every fault of the catalogue, and every bug of the
held-out lat x lon stencil, swept up to 4 ranks both ways; the covering sweep fails
wherever the exhaustive one does, at the same smallest failing layout. Up to 8 ranks:
``python benchmarks/layouts_cost.py --proof`` (too long for the suite on 2 cores).

The slowest tests of the suite after the 8-rank sweeps: each runs two sweeps."""

from __future__ import annotations

import pytest

from harness import ConfigError, check_layouts
from harness.layouts import LayoutsReport
from harness.steppers import catalogue
from harness.steppers.catalogue import fault_matrix
from tests.distributed.stencil import FAULTS, StencilCase

CATALOGUE = {(s, f): (make, kwargs) for s, make, kwargs, _sp, f, _q in fault_matrix(4)}


def both_sweeps(case, pools) -> tuple[LayoutsReport, LayoutsReport]:
    every = check_layouts(case, max_ranks=4, pools=pools, locate=False, exhaustive=True)
    cover = check_layouts(case, max_ranks=4, pools=pools, locate=False)
    return every, cover


def assert_covering_loses_nothing(every: LayoutsReport, cover: LayoutsReport) -> None:
    __tracebackhide__ = True
    assert cover.covering and not every.covering
    # the same layout gives the same verdict in either sweep (the covering set is a subset)
    statuses = {r.layout: r.status for r in every.results}
    assert {r.layout: r.status for r in cover.results}.items() <= statuses.items(), cover
    assert cover.smallest_failing == every.smallest_failing, f"{every}\n\n{cover}"
    assert len(cover.results) + len(cover.left_out) == len(every.results)


@pytest.mark.parametrize("key", sorted(CATALOGUE), ids=lambda key: f"{key[0]}:{key[1]}")
def test_the_covering_sweep_of_a_catalogue_fault_fails_first_where_every_layout_does(spatial, key):
    make, kwargs = CATALOGUE[key]
    case = catalogue.sweep_case(key[0], make, kwargs, key[1])
    every, cover = both_sweeps(case, spatial.pool)
    assert not every.ok, every  # every fault of the catalogue shows up to 4 ranks
    assert_covering_loses_nothing(every, cover)
    # up to 4 ranks its smallest failing layout is the catalogue's
    smallest = cover.smallest_failing
    assert (smallest.world_size, smallest.mesh, smallest.blocks) == catalogue.SMALLEST_LAYOUT[key]


@pytest.mark.spatial_pool  # the layouts of 1 to 4 ranks: under a launcher only its 4 run
@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_the_covering_sweep_of_the_held_out_stencil_fails_first_where_every_layout_does(
    spatial, fault
):
    every, cover = both_sweeps(StencilCase(fault), spatial.pool)
    assert every.ok is (fault is None), every
    assert_covering_loses_nothing(every, cover)
    # left out: 3 and 4 data groups (replicas, met at 2), 2 data groups of 1 x 2 (data groups
    # beside a split, met on 2 x 1)
    assert len(cover.results) == 10 and len(every.results) == 13


#: refused before any rank runs: the fixture rightly says it checked nothing
UNUSED = pytest.mark.filterwarnings("ignore::harness.plugin.fixtures.SpatialUnusedWarning")


@UNUSED
@pytest.mark.parametrize("value", [0, "3", -1])
def test_the_fixtures_sweep_takes_no_max_ranks_but_an_integer_of_at_least_one(spatial, value):
    with pytest.raises(ConfigError, match=r"^max_ranks must be an integer >= 1, got") as raised:
        spatial.check_layouts(StencilCase(), max_ranks=value)
    assert "\n" not in str(raised.value)


@UNUSED
def test_the_fixtures_sweep_refuses_oversubscription_naming_the_flag(spatial):
    with pytest.raises(pytest.fail.Exception) as failed:
        spatial.check_layouts(StencilCase(), max_ranks=100_000)  # beyond any machine's cores
    text = str(failed.value)
    assert text.startswith("check_layouts(max_ranks=100000): 100000 rank processes on a")
    assert text.endswith("pass --spatial-oversubscribe to insist.") and "\n" not in text
