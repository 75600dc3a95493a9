"""Strategies: valid objects, edge cases drawn often, mistakes caught up front, good shrinks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from harness.partition import CellPartition, LatLonPartition
from harness.strategies import (
    ObservationSet,
    cell_partitions,
    latlon_partitions,
    observation_sets,
    process_grids,
    register_profiles,
)

# ---------------------------------------------------------------- valid objects


@given(st.integers(1, 24).flatmap(lambda r: st.tuples(st.just(r), process_grids(r))))
def test_process_grids_multiply_to_the_ranks(case):
    ranks, (h, w) = case
    assert h * w == ranks and h >= 1 and w >= 1


@given(latlon_partitions(ranks=4, min_nlat=2, max_nlat=9, max_nlon=6))
def test_latlon_partitions_have_a_non_empty_block_on_every_rank(part):
    assert isinstance(part, LatLonPartition)
    assert 2 <= part.nlat <= 9 and part.nlon <= 6
    assert all(n > 0 for n in part.lat_sizes + part.lon_sizes)


@given(latlon_partitions(ranks=6, grid=(3, 2), max_nlat=8, max_nlon=8))
def test_latlon_partitions_keep_a_given_grid(part):
    assert (part.h, part.w) == (3, 2)


@settings(max_examples=200)
@given(cell_partitions(nside=1, ranks=5))
def test_cell_partitions_are_valid_monotone_ranges(part):
    assert isinstance(part, CellPartition)
    assert part.bounds[0] == 0 and part.bounds[-1] == 12
    assert all(a <= b for a, b in zip(part.bounds, part.bounds[1:], strict=False))


@given(cell_partitions(nside=1, ranks=6, allow_empty=False))
def test_cell_partitions_without_empty_ranks_give_every_rank_a_cell(part):
    assert min(part.sizes) >= 1


def test_cell_partitions_draw_empty_ranks_and_uneven_splits_often():
    seen = {"empty": 0, "uneven": 0, "even": 0}

    @settings(max_examples=100, derandomize=True, database=None)
    @given(cell_partitions(nside=2, ranks=4))
    def record(part):
        sizes = part.sizes
        seen["empty"] += 0 in sizes
        seen["even"] += part == CellPartition.even(2, 4)
        seen["uneven"] += len(set(sizes)) > 1

    record()
    assert seen["empty"] >= 20, seen  # collectives hang at empty ranks: they must be common
    assert seen["uneven"] >= 50, seen
    assert seen["even"] >= 1, seen


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(observation_sets(nside=2, max_points=20, channels=3))
def test_observation_sets_hold_finite_points_on_the_sphere(obs):
    assert isinstance(obs, ObservationSet)
    n = len(obs)
    assert obs.lat.shape == obs.lon.shape == (n,) and obs.values.shape == (n, 3)
    assert obs.values.dtype == np.float64 and np.isfinite(obs.values).all()
    assert (np.abs(obs.lat) <= 90).all()
    assert obs.counts().sum() == n
    packed = obs.sorted_by_cell()
    assert (np.diff(packed.cells) >= 0).all()


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_observation_sets_can_leave_whole_ranks_empty_or_give_each_a_point(data):
    part = data.draw(cell_partitions(nside=1, ranks=4))
    obs = data.draw(observation_sets(nside=1, partition=part, allow_empty_ranks=False))
    owners = set(part.rank_of(obs.cells).tolist()) if len(obs) else set()
    assert owners == {r for r in range(4) if part.sizes[r]}


def test_observation_sets_often_leave_a_whole_rank_empty():
    part = CellPartition.even(2, 4)
    empty_rank_seen = 0

    @settings(max_examples=60, derandomize=True, database=None)
    @given(observation_sets(nside=2, min_points=8, max_points=16, partition=part))
    def record(obs):
        nonlocal empty_rank_seen
        empty_rank_seen += len(set(part.rank_of(obs.cells).tolist())) < 4

    record()
    assert empty_rank_seen >= 10


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: process_grids(0), r"ranks=0 must be >= 1"),
        (lambda: process_grids(st.just(4)), "not strategies"),
        (lambda: latlon_partitions(ranks=4, min_nlat=9, max_nlat=5), "did you swap them"),
        (lambda: latlon_partitions(ranks=4, grid=(3, 1)), r"h \* w == ranks=4"),
        (lambda: latlon_partitions(ranks=4, grid=(4, 1), max_nlat=3), "raise max_nlat"),
        (lambda: latlon_partitions(ranks=8, max_nlat=1, max_nlon=4), "grid 1x8 needs"),
        (lambda: cell_partitions(nside=3, ranks=2), "not a power of two.*nside=2"),
        (lambda: cell_partitions(nside=1, ranks=13, allow_empty=False), "raise nside to 2"),
        (lambda: observation_sets(nside=1, min_points=5, max_points=2), "swapped"),
        (lambda: observation_sets(nside=2, partition=CellPartition.even(1, 2)), "same nside"),
        (lambda: observation_sets(nside=1, allow_empty_ranks=False), "needs partition"),
        (
            lambda: observation_sets(
                nside=1, max_points=2, partition=CellPartition.even(1, 3), allow_empty_ranks=False
            ),
            "raise max_points to 3",
        ),
    ],
    ids=[
        "zero_ranks",
        "strategy_ranks",
        "swapped_nlat",
        "grid_wrong_product",
        "grid_too_tall",
        "no_grid_fits",
        "nside3",
        "too_many_ranks",
        "swapped_points",
        "nside_mismatch",
        "no_partition",
        "too_few_points",
    ],
)
def test_strategies_refuse_mistakes_when_made_not_when_drawn(make, says):
    with pytest.raises(InvalidArgument, match=says):
        make()


# ---------------------------------------------------------------- shrinking


def test_a_failure_on_any_cell_partition_shrinks_to_the_even_split():
    smallest = find(cell_partitions(nside=2, ranks=4), lambda p: True)
    assert smallest == CellPartition.even(2, 4)


def test_a_failure_needing_an_empty_rank_shrinks_to_one_empty_rank():
    smallest = find(
        cell_partitions(nside=1, ranks=4),
        lambda p: 0 in p.sizes,
        settings=settings(max_examples=500, database=None),
    )
    assert smallest.sizes.count(0) == 1


def test_a_failure_on_an_uneven_latlon_split_shrinks_to_the_smallest_uneven_grid():
    smallest = find(
        latlon_partitions(ranks=2, max_nlat=40, max_nlon=40),
        lambda p: len(set(p.lat_sizes)) > 1,
        settings=settings(max_examples=500, database=None),
    )
    assert smallest == LatLonPartition(nlat=3, nlon=1, h=2, w=1)


def test_a_failure_with_points_shrinks_to_one_point_valued_zero():
    smallest = find(
        observation_sets(nside=1, channels=2),
        lambda o: len(o) > 0,
        settings=settings(database=None),
    )
    assert len(smallest) == 1
    assert smallest.values.tolist() == [[0.0, 0.0]]


def test_profiles_are_registered_with_no_deadline():
    register_profiles()
    for name, examples in [("ci", 25), ("dev", 10), ("thorough", 250)]:
        profile = settings.get_profile(name)
        assert profile.deadline is None
        assert profile.max_examples == examples
    assert settings.get_profile("ci").derandomize
    assert HealthCheck.too_slow in settings.get_profile("ci").suppress_health_check


def test_no_profile_and_not_the_recipe_s_settings_run_the_explain_phase():
    from hypothesis import Phase

    from harness.strategies import check_settings

    was = settings.get_current_profile_name()
    settings.load_profile("default")  # a session without a profile: Hypothesis's own phases
    try:
        register_profiles()  # (this session loads ci, whose phases others would inherit)
        for name in ("ci", "dev", "thorough"):
            assert Phase.explain not in settings.get_profile(name).phases, name
    finally:
        settings.load_profile(was)
    assert Phase.explain not in check_settings().phases
    assert Phase.shrink in check_settings().phases  # a failure still shrinks


def test_the_recipe_s_settings_shrink_a_failure_to_the_same_example_every_run():
    from harness.strategies import check_settings

    recipe = check_settings()
    # reproducible: the same examples drawn every run, none replayed from a database
    assert recipe.derandomize and recipe.database is None
    assert recipe.deadline is None and recipe.max_examples == 10
    assert HealthCheck.function_scoped_fixture in recipe.suppress_health_check

    def shrunk() -> tuple[int, ...]:
        seen: list[tuple[int, ...]] = []

        @recipe
        @given(part=cell_partitions(nside=1, ranks=4))
        def uneven_is_a_bug(part):
            if len(set(part.sizes)) > 1:
                seen.append(part.bounds)
                raise AssertionError("uneven")

        with pytest.raises(AssertionError):
            uneven_is_a_bug()
        return seen[-1]  # Hypothesis replays the shrunk example last

    first = shrunk()
    assert shrunk() == first and len(set(CellPartition(1, first).sizes)) > 1
