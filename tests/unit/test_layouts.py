"""Layouts as data: ``Topology.mesh``, the layouts a sweep runs, their order, and the
report of a sweep (``harness.layouts``), without ranks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis.errors import InvalidArgument

from harness import ConfigError, EquivalenceReport, Mismatch, SpatialCase, Topology
from harness import strategies as hs
from harness.equivalence import check_equivalence
from harness.layouts import (
    BLOCKS,
    Layout,
    LayoutResult,
    LayoutsReport,
    block_cases,
    check_layouts,
    layouts,
    refusal,
)
from harness.partition import CellPartition, uneven_sizes
from harness.plugin.options import _parse_layouts
from harness.steppers.healpix import HealpixCase
from harness.steppers.sfno import SFNOCase, SFNOConfig
from harness.topology import check_mesh


def rank_topology(size: int, mesh: tuple[int, ...] = ()) -> Topology:
    """Rank 0 of a spatial group of ``size`` (a stand-in group: nothing communicates)."""
    return Topology(size, 0, size, 0, object(), 1, 0, None, mesh)


# ---------------------------------------------------------------------- Topology.mesh


def test_a_mesh_whose_ranks_are_not_the_spatial_group_is_one_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"holds 6 ranks but the spatial group has 4.*\(4, 1\)"):
        check_mesh((2, 3), 4)
    with pytest.raises(ConfigError, match="tuple of integers >= 1"):
        check_mesh((2, 0), 4)
    with pytest.raises(ConfigError, match="tuple of integers >= 1"):
        check_mesh((2.0, 2), 4)


def test_no_mesh_means_the_case_chooses_and_the_reference_sees_a_grid_of_ones():
    assert check_mesh(None, 4) == () and check_mesh([2, 2], 4) == (2, 2)
    assert Topology.single().mesh == ()
    assert Topology.single().mesh_shape(2) == (1, 1)
    assert rank_topology(4).mesh_shape(2) == (4, 1)  # no grid handed: all on the first axis
    assert rank_topology(4, (1, 4)).mesh_shape(2) == (1, 4)


def test_a_mesh_of_other_axes_than_the_case_asks_for_is_an_error():
    with pytest.raises(ConfigError, match="mesh_dims = 2"):
        rank_topology(4, (4,)).mesh_shape(2)


class _Plain(SpatialCase):
    name = "plain"


def test_check_equivalence_refuses_a_mesh_of_the_wrong_axes_before_any_rank_runs():
    with pytest.raises(ConfigError, match=r"has 2 axes but plain\.mesh_dims is 1"):
        check_equivalence(_Plain(), ranks=4, mesh=(2, 2))
    with pytest.raises(ConfigError, match="holds 3 ranks"):
        check_equivalence(_Plain(), ranks=4, mesh=(3,))


def test_the_sfno_stepper_takes_its_grid_from_the_mesh_and_keeps_a_hard_coded_one_otherwise():
    config = SFNOConfig(h=2, w=2)
    assert config.process_grid(rank_topology(4)) == (2, 2)
    assert config.process_grid(rank_topology(4, (1, 4))) == (1, 4)
    assert config.process_grid(rank_topology(4, (4, 1))) == (4, 1)
    assert SFNOCase.mesh_dims == 2 and HealpixCase.mesh_dims == 1


def test_the_healpix_stepper_splits_its_cells_over_the_mesh():
    assert HealpixCase(nside=1).partition(rank_topology(5, (5,))).sizes == [3, 3, 2, 2, 2]


# ---------------------------------------------------------------------- the layouts


def brute_force(max_ranks: int, dims: int) -> set[tuple[int, int, tuple[int, ...]]]:
    """(world, spatial, mesh) of every grid of ``dims`` axes and world sizes up to max."""
    found = set()
    for world in range(1, max_ranks + 1):
        for mesh in itertools.product(range(1, world + 1), repeat=dims):
            if world % math.prod(mesh) == 0:
                found.add((world, math.prod(mesh), mesh))
    return found


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_every_world_size_split_and_grid_is_a_layout_exactly_once(dims):
    got = layouts(6, dims)
    assert len(got) == len(set(got))
    assert {(x.world_size, x.spatial_size, x.mesh) for x in got} == brute_force(6, dims)
    assert all(x.spatial_size * x.data_size == x.world_size for x in got)


def test_layouts_run_smallest_first_fewest_ranks_then_the_simplest_grid():
    got = [(x.world_size, x.data_size, x.grid) for x in layouts(4, 2)]
    assert got == [
        (1, 1, "1x1"),
        (2, 2, "1x1"),
        (2, 1, "2x1"),
        (2, 1, "1x2"),
        (3, 3, "1x1"),
        (3, 1, "3x1"),
        (3, 1, "1x3"),
        (4, 4, "1x1"),
        (4, 2, "2x1"),
        (4, 2, "1x2"),
        (4, 1, "4x1"),
        (4, 1, "1x4"),
        (4, 1, "2x2"),
    ]


def test_only_some_world_sizes_can_be_swept():
    assert {x.world_size for x in layouts(8, 2, world_sizes=[4, 2])} == {2, 4}


def test_a_bad_sweep_size_is_one_error():
    with pytest.raises(ConfigError, match="max_ranks must be an integer >= 1"):
        layouts(0)


def test_a_layout_reads_as_ranks_grid_and_data_groups():
    assert str(Layout(4, 2, 2, (1, 2))) == "4 ranks: grid 1x2, 2 data groups"
    assert str(Layout(1, 1, 1, (1,))) == "1 rank: grid 1"


# ---------------------------------------------------------------------- uneven and empty blocks


def test_uneven_and_empty_blocks_run_right_after_the_even_layouts_of_their_size():
    got = [(x.world_size, x.data_size, x.row) for x in layouts(3, 1, blocks=BLOCKS)]
    assert got == [
        (1, 1, "1"),
        (2, 2, "1"),  # one rank per spatial group: nothing to cut unevenly
        (2, 1, "2"),
        (2, 1, "2 uneven"),
        (2, 1, "2 empty-rank"),
        (3, 3, "1"),
        (3, 1, "3"),
        (3, 1, "3 uneven"),
        (3, 1, "3 empty-rank"),
    ]
    two_d = [x.row for x in layouts(2, 2, blocks=("uneven", "even")) if x.spatial_size == 2]
    assert two_d == ["2x1", "1x2", "2x1 uneven", "1x2 uneven"]


def test_a_layout_of_uneven_or_empty_blocks_says_so():
    assert str(Layout(2, 2, 1, (2,), "uneven")) == "2 ranks: grid 2, uneven blocks"
    assert str(Layout(4, 2, 2, (2,), "empty-rank")) == (
        "4 ranks: grid 2, a rank owning nothing, 2 data groups"
    )


def test_an_unknown_block_kind_is_one_error_naming_the_kinds():
    with pytest.raises(ConfigError, match=r"unknown block kind\(s\) \['ragged'\].*'empty-rank'"):
        layouts(2, blocks=("even", "ragged"))
    with pytest.raises(InvalidArgument, match="unknown block kind"):
        hs.layouts(blocks=("ragged",))


def test_uneven_sizes_differ_by_more_than_one_and_leave_no_rank_empty():
    for size, parts in [(48, 2), (48, 8), (12, 3), (16, 4), (30, 4)]:
        sizes = uneven_sizes(size, parts)
        assert sum(sizes) == size and min(sizes) >= 1 and max(sizes) - min(sizes) > 1, sizes
    with pytest.raises(ConfigError, match="uneven blocks need size >= 8"):
        uneven_sizes(7, 4)


def test_the_healpix_case_offers_uneven_cells_and_an_empty_rank_unless_its_bounds_are_pinned():
    case = HealpixCase(nside=2, batch_size=4)
    variants = block_cases(case, (4,))
    assert set(variants) == {"uneven", "empty-rank"}
    uneven = variants["uneven"].partition(rank_topology(4, (4,)))
    empty = variants["empty-rank"].partition(rank_topology(4, (4,)))
    assert uneven.sizes == [6, 14, 14, 14] and empty.sizes == [16, 0, 16, 16]
    # the same model and data: only the split differs
    assert variants["uneven"].batch_size == 4 and case.bounds is None
    assert block_cases(case, (1,)) == {}
    assert block_cases(HealpixCase(nside=2, bounds=(0, 24, 48)), (2,)) == {}
    assert block_cases(SFNOCase(), (2, 2)) == {}  # the SHT fixes the SFNO's split


def test_a_drawn_layout_gives_the_case_that_runs_it_or_none_where_the_case_has_no_such_blocks():
    case = HealpixCase(nside=1)
    assert Layout(2, 2, 1, (2,)).case_for(case) is case
    empty = Layout(3, 3, 1, (3,), "empty-rank").case_for(case)
    assert (
        isinstance(empty, HealpixCase)
        and empty.bounds == CellPartition.with_empty_rank(1, 3).bounds
    )
    assert Layout(2, 2, 1, (2, 1), "uneven").case_for(SFNOCase()) is None


class _BadVariants(SpatialCase):
    name = "bad-variants"

    def block_variants(self, mesh):
        return {"ragged": self}


def test_a_block_variant_of_an_unknown_kind_is_one_error_before_any_rank_runs():
    with pytest.raises(ConfigError, match=r"gave 'ragged'.*keys are \('uneven', 'empty-rank'\)"):
        check_layouts(_BadVariants(), max_ranks=2, pools=_NoRanks)


def test_an_uneven_layout_of_fewer_ranks_is_smaller_than_an_even_one_of_more():
    uneven2, even3 = Layout(2, 2, 1, (2,), "uneven"), Layout(3, 3, 1, (3,))
    even2 = Layout(2, 2, 1, (2,))
    report = LayoutsReport(
        case="demo",
        max_ranks=3,
        mesh_dims=1,
        results=[
            LayoutResult(even3, report_of(even3, loss_off(0))),
            LayoutResult(uneven2, report_of(uneven2, loss_off(0))),
            LayoutResult(even2, report_of(even2)),
        ],
    )
    assert report.smallest_failing == uneven2
    assert (
        str(report)
        .splitlines()[0]
        .endswith("smallest failing layout: 2 ranks: grid 2, uneven blocks")
    )
    rows = {
        line.split()[0] + (" " + line.split()[1] if "uneven" in line else ""): line
        for line in report.map().splitlines()
    }
    assert rows["2 uneven"].split()[-2:] == ["FAIL", "."]
    assert rows["2"].split()[-2:] == ["pass", "."]


@given(hs.layouts(max_ranks=6, mesh_dims=2, blocks=BLOCKS))
def test_drawn_layouts_with_blocks_are_layouts_of_the_sweep(layout):
    assert layout in layouts(6, 2, blocks=BLOCKS)


def test_drawn_layouts_shrink_to_the_smallest_failing_uneven_one():
    from hypothesis import find

    # a bug of uneven bands: on uneven blocks of 3 or more polar ranks, and on 4 x 1 even
    def fails(x):
        return (x.blocks == "uneven" and x.mesh[0] >= 3) or (x.mesh == (4, 1))

    found = find(hs.layouts(max_ranks=6, mesh_dims=2, blocks=BLOCKS), fails)
    assert found == Layout(3, 3, 1, (3, 1), "uneven")

    # far apart in the list: the smallest is 2 ranks, every layout between passes
    def far(x):
        empty_lon = x.blocks == "empty-rank" and x.mesh[1] >= 2
        return empty_lon or (x.world_size >= 5 and x.mesh == (1, 1))

    found = find(hs.layouts(max_ranks=8, mesh_dims=2, blocks=BLOCKS), far)
    assert found == Layout(2, 2, 1, (1, 2), "empty-rank")


# ---------------------------------------------------------------------- the report


def report_of(layout: Layout, *mismatches: Mismatch) -> EquivalenceReport:
    return EquivalenceReport(
        case="demo",
        ranks=layout.world_size,
        spatial_size=layout.spatial_size,
        partition="",
        steps=2,
        dtype="float64",
        tolerance=None,
        mismatches=list(mismatches),
    )


def loss_off(rank: int) -> Mismatch:
    return Mismatch("loss", "loss", 0, rank, max_abs=1.0, max_rel=1.0, count=1, total=1)


#: a rank's traceback through the case's own build (``user_traceback``: its frames kept)
CASES_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/src/demo_case.py", line 12, in build\n'
    '    raise ConfigError("embed=8 is too small")\n'
    "harness.errors.ConfigError: embed=8 is too small\n"
)


def refused_error() -> Mismatch:
    return Mismatch(
        "error",
        "demo",
        None,
        0,
        where="ConfigError: embed=8 is too small",
        detail=CASES_TRACEBACK,
        phase="build",
    )


def sweep(results: list[LayoutResult]) -> LayoutsReport:
    return LayoutsReport(case="demo", max_ranks=4, mesh_dims=2, results=results)


def test_the_smallest_failing_layout_is_fewest_ranks_then_the_simplest_grid():
    late, early = Layout(4, 4, 1, (2, 2)), Layout(3, 3, 1, (1, 3))
    simplest = Layout(3, 3, 1, (3, 1))
    report = sweep(
        [
            LayoutResult(late, report_of(late, loss_off(0))),
            LayoutResult(early, report_of(early, loss_off(1))),
            LayoutResult(simplest, report_of(simplest, loss_off(2))),
            LayoutResult(Layout(2, 2, 1, (1, 2)), report_of(Layout(2, 2, 1, (1, 2)))),
        ]
    )
    assert not report.ok
    assert report.smallest_failing == simplest
    assert report.smallest_report is report.results[2].report


def test_the_text_leads_with_the_smallest_failing_report_then_the_map():
    bad, good = Layout(2, 2, 1, (1, 2)), Layout(2, 2, 1, (2, 1))
    text = str(
        sweep([LayoutResult(good, report_of(good)), LayoutResult(bad, report_of(bad, loss_off(1)))])
    )
    assert text.splitlines()[0].endswith("smallest failing layout: 2 ranks: grid 1x2")
    smallest = text.index("Smallest failing layout, 2 ranks: grid 1x2:\ndemo on 2 ranks")
    assert smallest < text.index("Every layout")
    rows = dict(line.split(None, 1) for line in text.splitlines()[-3:])
    assert rows == {"grid": "W=2", "2x1": "pass", "1x2": "FAIL"}


def test_a_layout_the_case_refuses_is_listed_with_its_reason_and_is_no_failure():
    fine, refused = Layout(2, 2, 1, (2, 1)), Layout(3, 1, 3, (1, 1))
    report = sweep(
        [LayoutResult(fine, report_of(fine)), LayoutResult(refused, None, "embed=8 is too small")]
    )
    assert report.ok and report.smallest_failing is None
    assert "Not run (the case refused the layout):\n  3 ranks: grid 1x1, 3 data groups: embed" in (
        str(report)
    )
    assert "n/a" in report.map()


def test_a_sweep_that_ran_nothing_is_not_ok():
    refused = Layout(3, 1, 3, (1, 1))
    report = sweep([LayoutResult(refused, None, "no")])
    assert not report.ok
    assert "no layout ran" in report.summary()
    with pytest.raises(AssertionError, match="no layout ran"):
        report.raise_if_failed()


def test_a_config_error_while_building_is_a_refusal_but_one_in_forward_is_a_failure():
    layout = Layout(2, 2, 1, (2, 1))
    assert refusal(report_of(layout, refused_error())) == "embed=8 is too small"
    in_batch = Mismatch(
        "error",
        "demo",
        0,
        1,
        where="ConfigError: 2 samples",
        detail=CASES_TRACEBACK,
        phase="step 0 batch",
    )
    assert refusal(report_of(layout, in_batch)) == "2 samples"
    shard = Mismatch("error", "demo", 0, 1, where="ConfigError: Shard.grid", phase="step 0 forward")
    assert refusal(report_of(layout, shard)) == ""
    other = Mismatch("error", "demo", None, 0, where="ValueError: no", phase="build")
    assert refusal(report_of(layout, other)) == ""


def test_what_the_harness_refuses_in_what_build_or_batch_returned_is_a_failure_not_a_refusal():
    layout = Layout(2, 2, 1, (2, 1))
    # user_traceback of the harness's own check: no frame of the case's, the message alone
    for phase, what in [("build", "build returned None"), ("step 0 batch", "batch returned None")]:
        junk = Mismatch(
            "error",
            "demo",
            None,
            1,
            where=f"ConfigError: demo.{what}; it must return ...",
            detail=f"harness.errors.ConfigError: demo.{what}; it must return ...\n",
            phase=phase,
        )
        assert refusal(report_of(layout, junk)) == ""


def test_a_sweep_whose_layouts_split_nothing_is_vacuous_not_equivalent():
    one, data = Layout(1, 1, 1, (1,)), Layout(2, 1, 2, (1,))
    report = sweep([LayoutResult(one, report_of(one)), LayoutResult(data, report_of(data))])
    assert report.vacuous and not report.ok
    assert report.summary().endswith(
        "2 passed, 0 failed, 0 refused by the case (0.0 s); no layout run split the domain "
        "(every one has spatial size 1): vacuous, nothing about the parallel code was "
        "checked; sweep layouts that split the domain (max_ranks=2 or more)"
    )
    with pytest.raises(AssertionError, match="vacuous"):
        report.raise_if_failed()
    split = Layout(2, 2, 1, (2,))
    report.results.append(LayoutResult(split, report_of(split)))
    assert report.ok and not report.vacuous


def test_a_sweep_that_split_nothing_passes_where_the_case_says_why_it_is_replicated():
    one = Layout(1, 1, 1, (1,))
    report = sweep([LayoutResult(one, report_of(one))])
    report.vacuous_ok = "replicated on purpose"
    assert report.ok
    assert report.summary().endswith("(vacuous_ok: replicated on purpose)")


def test_check_layouts_refuses_the_arguments_it_chooses_itself():
    with pytest.raises(ConfigError, match="chooses ranks= itself"):
        check_layouts(_Plain(), max_ranks=2, ranks=4)
    with pytest.raises(ConfigError, match=r"needs a harness\.SpatialCase"):
        check_layouts(object(), max_ranks=2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- strategies, options


@given(hs.layouts(max_ranks=6, mesh_dims=2))
def test_drawn_layouts_are_layouts_of_the_sweep(layout):
    assert layout in layouts(6, 2)


def test_drawn_layouts_shrink_to_the_smallest_failing_one():
    from hypothesis import find

    fails = {(3, (3, 1)), (3, (1, 3)), (4, (4, 1)), (6, (1, 3))}
    found = find(hs.layouts(max_ranks=6, mesh_dims=2), lambda x: (x.world_size, x.mesh) in fails)
    assert (found.world_size, found.mesh) == (3, (3, 1))


def test_a_bad_layouts_strategy_fails_when_made():
    with pytest.raises(InvalidArgument, match="mesh_dims=0 must be >= 1"):
        hs.layouts(mesh_dims=0)


@pytest.mark.parametrize("raw", ["0", "x", "-2", "1.5"])
def test_spatial_layouts_must_be_a_rank_count(raw):
    with pytest.raises(pytest.UsageError, match="--spatial-layouts must be an integer >= 1"):
        _parse_layouts(raw, oversubscribe=False)


def test_spatial_layouts_beyond_the_cores_needs_oversubscribe():
    with pytest.raises(pytest.UsageError, match="--spatial-oversubscribe"):
        _parse_layouts("100000", oversubscribe=False)
    assert _parse_layouts("8", oversubscribe=False) == 8


def test_the_map_is_drawn_as_a_picture_with_the_smallest_failing_layout_framed(tmp_path):
    pytest.importorskip("matplotlib")  # the plots extra
    import matplotlib.image

    bad, good = Layout(2, 2, 1, (1, 2)), Layout(2, 2, 1, (2, 1))
    report = sweep(
        [LayoutResult(good, report_of(good)), LayoutResult(bad, report_of(bad, loss_off(1)))]
    )
    path = report.plot(tmp_path / "maps" / "layouts.png")
    pixels = matplotlib.image.imread(path)[..., :3]
    red = (pixels[..., 0] > 0.8) & (pixels[..., 1] < 0.3)
    green = (pixels[..., 1] > 0.6) & (pixels[..., 0] < 0.4)
    assert red.sum() > 100 and green.sum() > 100  # one FAIL cell and one pass cell
    # the FAIL row (1x2, drawn second) lies below the pass row (2x1)
    assert red.nonzero()[0].mean() > green.nonzero()[0].mean()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_harness_check_refuses_a_layouts_sweep_of_no_ranks(value, capsys):
    from harness.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--layouts", value])
    assert exited.value.code == 2
    assert f"--layouts {value}: N must be an integer >= 1" in capsys.readouterr().err


def test_a_sweep_of_some_world_sizes_says_which_it_ran_not_up_to_max_ranks():
    # under torchrun/srun only the launcher's world size runs: the header must not claim more
    four = Layout(4, 4, 1, (2, 2))
    restricted = sweep([LayoutResult(four, report_of(four))])
    assert "1 layout(s) of 4 ranks only (up to 4 asked)" in restricted.summary()
    whole = sweep(
        [
            LayoutResult(Layout(w, w, 1, (w, 1)), report_of(Layout(w, w, 1, (w, 1))))
            for w in (1, 2, 3, 4)
        ]
    )
    assert "4 layout(s) up to 4 ranks," in whole.summary()


class _RaisingReference(SpatialCase):
    """A case whose reference raises in build (its ranks would be fine)."""

    name = "raising-reference"

    def build(self, topo):
        if topo.is_reference:
            raise RuntimeError("the reference cannot build")
        return torch.nn.Linear(2, 2)


class _NoRanks:
    """A runner that must never be asked to run: the reference failed first."""

    def __init__(self, world_size):
        self.world_size = world_size

    def run(self, *args, **kwargs):
        raise AssertionError("the ranks ran although the reference raised")


def test_a_reference_that_raises_is_each_layouts_error_not_an_exception():
    report = check_layouts(_RaisingReference(), max_ranks=2, pools=_NoRanks, locate=False)
    assert not report.ok and report.smallest_failing == Layout(1, 1, 1, (1,))
    first = report.failing[0].report.mismatches[0]
    assert (first.quantity, first.run) == ("error", "reference")
    assert "RuntimeError: the reference cannot build" in first.where
    # the traceback is the case's (its raising line), as a rank's is, not the harness's run
    assert 'raise RuntimeError("the reference cannot build")' in first.detail
    assert "harness/" not in first.detail.replace(__file__, "")


def test_the_picture_has_a_row_per_grid_and_blocks_and_frames_a_failing_empty_rank(tmp_path):
    pytest.importorskip("matplotlib")  # the plots extra
    import matplotlib.image

    results = [
        LayoutResult(x, report_of(x, *([loss_off(1)] if x.blocks == "empty-rank" else [])))
        for x in layouts(2, 1, blocks=BLOCKS)
    ]
    report = LayoutsReport(case="demo", max_ranks=2, mesh_dims=1, results=results)
    assert report.smallest_failing == Layout(2, 2, 1, (2,), "empty-rank")
    pixels = matplotlib.image.imread(report.plot(tmp_path / "layouts.png"))[..., :3]
    red = (pixels[..., 0] > 0.8) & (pixels[..., 1] < 0.3)
    green = (pixels[..., 1] > 0.6) & (pixels[..., 0] < 0.4)
    # rows 1 (W=1 and W=2), 2 and 2 uneven pass: four cells of one size; the last row, 2
    # empty-rank, fails: one cell, drawn below them all
    assert red.sum() > 100 and green.sum() > 3 * red.sum()
    assert red.nonzero()[0].min() > green.nonzero()[0].max()


# ---------------------------------------------------------------------- oversubscription


class _Runner:
    """A stand-in pool of ``world_size`` ranks (never run: ``check_equivalence`` is)."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.last_outputs: list[str] = []


@pytest.mark.parametrize(("given", "base"), [(None, 10.0), (5.0, 5.0)])
def test_an_oversubscribed_layout_gets_its_timeout_times_its_ranks_per_core(
    monkeypatch, given, base
):
    import harness.equivalence
    import harness.layouts._run

    asked: dict[int, float] = {}

    def check(case, *, ranks, spatial_size, mesh, pool, timeout, **kwargs):
        asked[ranks] = timeout
        return report_of(Layout(ranks, spatial_size, ranks // spatial_size, mesh))

    monkeypatch.setattr(harness.equivalence, "check_equivalence", check)
    monkeypatch.setattr(harness.layouts._run, "cores", lambda: 2)
    extra = {} if given is None else {"timeout": given}
    report = check_layouts(
        HealpixCase(), world_sizes=[1, 2, 3, 8], pools=lambda w: _Runner(w, 10.0), **extra
    )
    assert report.ok
    # up to 2 ranks on 2 cores: the clock as given; 3 ranks: 1.5x; 8 ranks: 4x
    assert asked == {1: base, 2: base, 3: 1.5 * base, 8: 4 * base}


def test_a_sweeps_reference_runs_with_the_checks_options_and_defaults():
    # the one reference every layout is judged against: the steps, learning rate and seed
    # a check would run, given or check_equivalence's own defaults (read off its signature)
    import inspect

    from harness.layouts._run import reference_run

    default = inspect.signature(check_equivalence).parameters["steps"].default
    case = HealpixCase()
    assert len(reference_run(case, {}, None).steps) == default
    assert len(reference_run(case, {"steps": default + 1}, None).steps) == default + 1
    seeded = [reference_run(case, {"seed": s}, None).steps[0].loss for s in (0, 0, 1)]
    assert torch.equal(seeded[0], seeded[1]) and not torch.equal(seeded[0], seeded[2])
