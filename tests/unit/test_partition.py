"""Partition arithmetic: ownership, torch-harmonics' split rule, neighbours, halos, packing."""

from __future__ import annotations

import healpy as hp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_harmonics.distributed import compute_split_shapes

from harness.errors import ConfigError
from harness.partition import (
    CellPartition,
    LatLonPartition,
    cell_of,
    ownership,
    sht_split_rule,
    split_sizes,
)
from harness.strategies import cell_partitions, latlon_partitions

# ---------------------------------------------------------------- split_sizes


def _sht_split(size: int, parts: int) -> list[int] | None:
    """The installed torch-harmonics' split, or None where it refuses (0.9: empty chunks)."""
    try:
        return list(compute_split_shapes(size, parts))
    except (RuntimeError, ValueError, AssertionError):
        return None


def test_split_sizes_equals_torch_harmonics_compute_split_shapes_for_every_small_case():
    for size in range(0, 130):
        for parts in range(1, 17):
            expected = _sht_split(size, parts)
            if expected is not None:
                assert split_sizes(size, parts) == expected, (size, parts)


@given(st.integers(0, 10**7), st.integers(1, 512))
def test_split_sizes_equals_torch_harmonics_for_large_sizes(size, parts):
    expected = _sht_split(size, parts)
    if expected is not None:
        assert split_sizes(size, parts) == expected


def test_the_default_rule_is_the_installed_torch_harmonics_rule():
    import torch_harmonics

    old = tuple(int(p) for p in torch_harmonics.__version__.split(".")[:2]) < (0, 9)
    assert sht_split_rule() == ("ceil" if old else "balanced")


@pytest.mark.parametrize(
    ("size", "parts", "rule", "expected"),
    [
        (10, 4, "ceil", [3, 3, 3, 1]),
        (5, 4, "ceil", [1, 1, 1, 2]),
        (8, 4, "ceil", [2, 2, 2, 2]),
        (7, 1, "ceil", [7]),
        (10, 4, "balanced", [3, 3, 2, 2]),
        (5, 4, "balanced", [2, 1, 1, 1]),
    ],
    ids=["ceil_uneven", "floor_fallback", "even", "one_part", "balanced", "balanced_small"],
)
def test_split_sizes_follows_the_named_rule(size, parts, rule, expected):
    assert split_sizes(size, parts, rule=rule) == expected


def test_an_unknown_split_rule_is_refused():
    with pytest.raises(ConfigError, match="unknown split rule 'floor'"):
        split_sizes(4, 2, rule="floor")


# ---------------------------------------------------------------- lat/lon


@given(latlon_partitions(ranks=6, max_nlat=13, max_nlon=17))
def test_every_latlon_position_is_owned_exactly_once(part):
    owners = np.full(part.nlat * part.nlon, -1)
    for rank in range(part.ranks):
        idx = part.index(rank)
        assert idx.dtype == np.int64
        assert len(idx) == np.prod(part.shape(rank)) > 0
        assert (owners[idx] == -1).all(), "a position owned twice"
        owners[idx] = rank
    assert (owners >= 0).all(), "a position owned by nobody"
    for flat in range(0, part.nlat * part.nlon, 7):
        lat, lon, rank = part.where(flat)
        assert flat == lat * part.nlon + lon
        assert owners[flat] == rank


@given(latlon_partitions(ranks=4))
def test_latlon_blocks_are_row_major_slices_of_the_global_grid(part):
    grid = np.arange(part.nlat * part.nlon).reshape(part.nlat, part.nlon)
    for rank in range(part.ranks):
        lats, lons = part.slices(rank)
        np.testing.assert_array_equal(grid[lats, lons].ravel(), part.index(rank))
        p, a = divmod(rank, part.w)
        assert (lats, lons) == (part.lat_slice(p), part.lon_slice(a))


def test_latlon_sizes_follow_the_sht_split():
    part = LatLonPartition(nlat=10, nlon=5, h=4, w=4)
    assert part.lat_sizes == compute_split_shapes(10, 4)
    assert part.lon_sizes == compute_split_shapes(5, 4)
    assert part.ranks == 16
    assert hash(part) == hash(LatLonPartition(10, 5, 4, 4))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"nlat": 3, "nlon": 8, "h": 4, "w": 1}, "nlat=3 does not fit h=4"),
        ({"nlat": 8, "nlon": 2, "h": 1, "w": 3}, "nlon=2 does not fit w=3"),
        ({"nlat": 0, "nlon": 8}, "nlat must be an integer >= 1"),
        ({"nlat": 4.0, "nlon": 8}, "pass a plain int"),
        ({"nlat": 4, "nlon": 8, "h": 0}, "h must be an integer >= 1"),
    ],
    ids=["lat_too_few", "lon_too_few", "zero_nlat", "float_nlat", "zero_h"],
)
def test_latlon_partition_refuses_impossible_shapes_with_the_fix(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        LatLonPartition(**kwargs)


def test_latlon_lookups_out_of_range_say_the_valid_range():
    part = LatLonPartition(4, 4, 2, 2)
    with pytest.raises(ConfigError, match="use 0 <= rank < 4"):
        part.slices(4)
    with pytest.raises(ConfigError, match="use 0 <= index < 16"):
        part.where(16)
    with pytest.raises(ConfigError, match="0 <= p < 2"):
        part.lat_slice(2)
    with pytest.raises(ConfigError, match="0 <= a < 2"):
        part.lon_slice(-1)


# ---------------------------------------------------------------- cells


@given(cell_partitions(nside=2, ranks=5))
def test_every_cell_is_owned_exactly_once_and_rank_of_agrees(part):
    owners = np.full(part.npix, -1)
    for rank in range(part.ranks):
        cells = np.array(part.cells(rank), dtype=np.int64)
        assert len(cells) == part.sizes[rank]
        assert (owners[cells] == -1).all()
        owners[cells] = rank
    assert (owners >= 0).all()
    np.testing.assert_array_equal(part.rank_of(np.arange(part.npix)), owners)
    assert all(part.rank_of(int(c)) == owners[c] for c in range(0, part.npix, 5))
    assert sum(part.sizes) == part.npix


def test_rank_of_never_names_an_empty_rank():
    part = CellPartition(1, (0, 0, 0, 6, 6, 12, 12))
    assert part.rank_of(np.arange(12)).tolist() == [2] * 6 + [4] * 6
    assert part.rank_of(0) == 2


def test_even_cell_partition_uses_the_lat_lon_split_rule():
    for nside, ranks in [(1, 5), (1, 12), (1, 16), (2, 7), (4, 3)]:
        part = CellPartition.even(nside, ranks)
        assert part.sizes == split_sizes(12 * nside * nside, ranks, rule="balanced")


@pytest.mark.parametrize("nside", [1, 2, 4, 8])
def test_neighbours_have_no_missing_entries_and_start_with_the_cell_itself(nside):
    table = CellPartition.even(nside, 1).neighbours()
    npix = 12 * nside * nside
    assert table.shape == (npix, 9)
    assert table.dtype == np.int64
    assert (table >= 0).all() and (table < npix).all()
    np.testing.assert_array_equal(table[:, 0], np.arange(npix))
    raw = hp.get_all_neighbours(nside, np.arange(npix), nest=True).T
    missing = raw == -1
    # nside 1: every base pixel lacks two neighbours; above, 24 corner cells lack one each
    assert missing.sum() == 24
    assert missing.any(axis=1).sum() == (12 if nside == 1 else 24)
    np.testing.assert_array_equal(table[:, 1:], np.where(missing, np.arange(npix)[:, None], raw))
    assert not table.flags.writeable, "the cached table is shared: it must be read-only"
    assert CellPartition.even(nside, 3).neighbours() is table  # cached per nside


def _halo_brute_force(part: CellPartition, rank: int) -> list[int]:
    own = set(part.cells(rank))
    found = set()
    for cell in own:
        for n in hp.get_all_neighbours(part.nside, cell, nest=True):
            if n >= 0 and n not in own:
                found.add(int(n))
    return sorted(found)


@settings(max_examples=40)
@given(st.sampled_from([1, 2, 4]).flatmap(lambda n: cell_partitions(nside=n, ranks=4)))
def test_halo_equals_a_brute_force_neighbour_search(part):
    for rank in range(part.ranks):
        halo = part.halo(rank)
        assert halo.tolist() == _halo_brute_force(part, rank)
        assert halo.dtype == np.int64


@given(cell_partitions(nside=2, ranks=4))
def test_local_neighbours_index_own_cells_then_halo(part):
    table = part.neighbours()
    for rank in range(part.ranks):
        ext = np.concatenate([np.array(part.cells(rank), dtype=np.int64), part.halo(rank)])
        local = part.local_neighbours(rank)
        assert local.shape == (part.sizes[rank], 9)
        np.testing.assert_array_equal(ext[local], table[part.bounds[rank] : part.bounds[rank + 1]])


@given(cell_partitions(nside=1, ranks=4), st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_packed_slice_matches_packing_by_brute_force(part, counts):
    counts = np.array(counts, dtype=np.int64)
    packed_owner = np.repeat(part.rank_of(np.arange(12)), counts)  # owner of each item
    for rank in range(part.ranks):
        sl = part.packed_slice(counts, rank)
        expected = np.flatnonzero(packed_owner == rank)
        assert list(range(len(packed_owner))[sl]) == expected.tolist()
        if part.sizes[rank] == 0:
            assert sl.start == sl.stop


def test_cell_of_inverts_healpy_cell_centres():
    nside = 4
    cells = np.arange(12 * nside * nside)
    lon, lat = hp.pix2ang(nside, cells, nest=True, lonlat=True)
    np.testing.assert_array_equal(cell_of(nside, lat, lon), cells)


@pytest.mark.parametrize(
    ("nside", "bounds", "says"),
    [
        (3, (0, 108), "power of two.*nearest: 2 or 4"),
        (0, (0, 0), "power of two"),
        (1, (0, 5, 11), "from 0 to npix=12"),
        (1, (1, 12), "from 0 to npix=12"),
        (1, (0, 7, 5, 12), "non-decreasing, but rank 1's range 7:5"),
        (1, (12,), "one more than the ranks"),
        (1, (0, 2.5, 12), "must be integers"),
    ],
    ids=["nside3", "nside0", "short_end", "late_start", "backwards", "one_bound", "float"],
)
def test_cell_partition_refuses_bad_bounds_with_the_fix(nside, bounds, says):
    with pytest.raises(ConfigError, match=says):
        CellPartition(nside, bounds)


def test_cell_lookups_out_of_range_say_what_is_wrong():
    part = CellPartition.even(1, 3)
    with pytest.raises(ConfigError, match="use 0 <= rank < 3"):
        part.cells(3)
    with pytest.raises(ConfigError, match=r"cells in \[0, 12\)"):
        part.rank_of(12)
    with pytest.raises(ConfigError, match=r"shape \(12,\)"):
        part.packed_slice(np.ones(11, dtype=int), 0)
    with pytest.raises(ConfigError, match="non-negative integer"):
        part.packed_slice(-np.ones(12, dtype=int), 0)
    with pytest.raises(ConfigError, match="swap lat and lon"):
        cell_of(1, [100.0], [10.0])
    with pytest.raises(ConfigError, match="ranks must be an integer >= 1"):
        CellPartition.even(1, 0)


# ---------------------------------------------------------------- exact messages and edges


def _message(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


PLAIN_INT = "pass a plain int"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: split_sizes(-1, 2), f"size must be an integer >= 0, got -1 (int); {PLAIN_INT}"),
        (lambda: split_sizes(3, 0), f"parts must be an integer >= 1, got 0 (int); {PLAIN_INT}"),
        (
            lambda: split_sizes(3, True),
            f"parts must be an integer >= 1, got True (bool); {PLAIN_INT}",
        ),
        (lambda: ownership([], -1), f"size must be an integer >= 0, got -1 (int); {PLAIN_INT}"),
        (
            lambda: ownership([[0], [5]], 3),
            "rank 1 claims positions 5..5 outside [0, 3); positions are global, not local",
        ),
        (
            lambda: ownership([[0, 1, 2, 3]], 3),  # one past the end
            "rank 0 claims positions 0..3 outside [0, 3); positions are global, not local",
        ),
        (
            lambda: ownership([[-1, 2]], 3),
            "rank 0 claims positions -1..2 outside [0, 3); positions are global, not local",
        ),
        (
            lambda: LatLonPartition(4, 4, rule="floor"),
            "unknown split rule 'floor'; use one of ('ceil', 'balanced')",
        ),
        (
            # the message shows the split of the partition's own rule, not the default one
            lambda: LatLonPartition(3, 8, 4, 1, rule="balanced"),
            "LatLonPartition: nlat=3 does not fit h=4 ranks: [1, 1, 1, 0] would leave ranks "
            "without a latitude; choose h <= 3 or a grid with nlat >= 4",
        ),
        (
            lambda: LatLonPartition(8, 2, 1, 3, rule="balanced"),
            "LatLonPartition: nlon=2 does not fit w=3 ranks: [1, 1, 0] would leave ranks "
            "without a longitude; choose w <= 2 or a grid with nlon >= 3",
        ),
        (
            lambda: LatLonPartition(4, 4, 2, 2).slices(4),
            "rank 4 is not a spatial rank of this 2x2 partition; use 0 <= rank < 4",
        ),
        (
            lambda: LatLonPartition(4, 4, 2, 2).lon_slice(2),
            "azimuth index 2 out of range for w=2; use 0 <= a < 2",
        ),
        (
            lambda: LatLonPartition(4, 4, 2, 2).lat_slice(2),
            "polar index 2 out of range for h=2; use 0 <= p < 2",
        ),
        (
            lambda: LatLonPartition(4, 4, 2, 2).where(16),
            "flat index 16 is outside the 4x4 grid; use 0 <= index < 16",
        ),
    ],
    ids=[
        "negative_size",
        "zero_parts",
        "bool_parts",
        "ownership_size",
        "ownership_past_end",
        "ownership_one_past_end",
        "ownership_negative",
        "latlon_rule",
        "latlon_lat_too_few",
        "latlon_lon_too_few",
        "latlon_rank",
        "latlon_azimuth",
        "latlon_polar",
        "latlon_flat",
    ],
)
def test_refusals_read_problem_evidence_remedy(call, message):
    assert _message(call) == message


NSIDE = "nside must be a power of two between 1 and 2**29 for NESTED HEALPix, got {}; "
NSIDE += "choose 1, 2, 4, 8, ...{}"
BOUNDS_INT = (
    "CellPartition bounds must be integers, one more than the ranks, got {}; e.g. (0, 6, 12) "
    "for 2 ranks, or CellPartition.even(nside, ranks)"
)


@pytest.mark.parametrize(
    ("nside", "bounds", "message"),
    [
        (0, (0, 0), NSIDE.format(0, "")),
        (3, (0, 108), NSIDE.format(3, " (nearest: 2 or 4)")),
        (100, (0, 120000), NSIDE.format(100, " (nearest: 64 or 128)")),
        (True, (0, 12), NSIDE.format(True, "")),
        (2.0, (0, 48), NSIDE.format(2.0, "")),
        # a power of two, but too fine: no 'nearest' powers beyond the limit are suggested
        (2**30, (0, 12 * 4**30), NSIDE.format(2**30, "")),
        (2**29 + 1, (0, 12), NSIDE.format(2**29 + 1, "")),
        (1, (0, 2.5, 12), BOUNDS_INT.format("(0, 2.5, 12)")),
        (1, None, BOUNDS_INT.format("None")),
        (1, ("a", "b"), BOUNDS_INT.format("('a', 'b')")),
        (
            1,
            (1, 5, 12),
            "CellPartition bounds must run from 0 to npix=12 (nside=1), got 1 .. 12; every "
            "cell must be owned: start at 0 and end at 12",
        ),
        (
            1,
            (0, 5, 11),
            "CellPartition bounds must run from 0 to npix=12 (nside=1), got 0 .. 11; every "
            "cell must be owned: start at 0 and end at 12",
        ),
        (
            1,
            (0, 13, 12),  # the last rank runs backwards
            "CellPartition bounds must be non-decreasing, but rank 1's range 13:12 runs "
            "backwards; sort the bounds (equal bounds give an empty rank)",
        ),
    ],
    ids=[
        "nside0",
        "nside3",
        "nside100",
        "nside_bool",
        "nside_float",
        "nside_too_fine",
        "nside_too_fine_odd",
        "float_bound",
        "no_bounds",
        "text_bounds",
        "late_start",
        "short_end",
        "last_backwards",
    ],
)
def test_cell_partition_refusals_read_problem_evidence_remedy(nside, bounds, message):
    assert _message(lambda: CellPartition(nside, bounds)) == message


def test_the_finest_nside_is_accepted():
    part = CellPartition(2**29, (0, 12 * 4**29))
    assert (part.nside, part.ranks, part.sizes) == (2**29, 1, [12 * 4**29])


def test_cell_partition_stores_plain_ints_in_a_tuple():
    part = CellPartition(np.int64(2), [0, np.int64(20), 48.0])
    assert part.bounds == (0, 20, 48)
    assert type(part.nside) is int and all(type(b) is int for b in part.bounds)
    assert hash(part) == hash(CellPartition(2, (0, 20, 48)))


@pytest.mark.parametrize("method", ["cells", "halo", "local_neighbours", "packed_slice"])
@pytest.mark.parametrize("rank", [3, -1, True, 1.0])
def test_every_cell_lookup_validates_its_rank(method, rank):
    part = CellPartition.even(1, 3)
    args = (np.ones(12, dtype=np.int64), rank) if method == "packed_slice" else (rank,)
    assert _message(lambda: getattr(part, method)(*args)) == (
        f"rank {rank!r} is not a spatial rank of this 3-rank cell partition; use 0 <= rank < 3"
    )


@pytest.mark.parametrize("cell", [-1, 12, 1.5, np.array([0, -1])])
def test_rank_of_refuses_cells_that_do_not_exist(cell):
    assert _message(lambda: CellPartition.even(1, 3).rank_of(cell)) == (
        f"rank_of needs integer cells in [0, 12) for nside=1; got {cell!r}; are these cells "
        "of another nside, or ring-ordered?"
    )


def test_rank_of_returns_a_plain_int_for_one_cell_and_int64_for_an_array():
    part = CellPartition(1, (0, 5, 5, 12))
    assert type(part.rank_of(5)) is int and part.rank_of(5) == 2
    owners = part.rank_of(np.array([0, 4, 11], dtype=np.int32))
    assert owners.dtype == np.int64 and owners.tolist() == [0, 0, 2]


def test_packed_slice_refuses_counts_that_are_not_one_integer_per_cell():
    part = CellPartition.even(1, 3)
    assert _message(lambda: part.packed_slice(np.ones(12), 0)) == (
        "packed_slice needs one non-negative integer count per cell, shape (12,) for nside=1; "
        "got shape (12,) of float64; use np.bincount(cells, minlength=12)"
    )


# ---------------------------------------------------------------- ownership


def test_ownership_counts_claims_and_names_holes_and_double_owners():
    own = ownership([[0], np.array([1, 0]), []], size=4)
    assert own.size == 4 and own.counts.dtype == np.int64
    assert own.counts.tolist() == [2, 1, 0, 0]
    assert (own.missing.tolist(), own.doubled.tolist(), own.complete) == ([2, 3], [0], False)
    assert own.owners_of(0) == [0, 1] and own.owners_of(3) == []
    assert own.describe() == (
        "2 positions owned by no rank (first: 2); 1 owned by several (first: 0, by ranks 0, 1)"
    )
    assert own.describe(lambda p: f"cell {p}") == (
        "2 positions owned by no rank (first: cell 2); 1 owned by several (first: cell 0, "
        "by ranks 0, 1)"
    )


def test_ownership_of_a_complete_cover_describes_nothing():
    own = ownership([[2, 0], [], [1]], size=3)  # an empty rank claims nothing
    assert own.complete and own.describe() == "" and own.owners_of(1) == [2]
    assert ownership([[]], size=0).complete  # nothing to own


def test_ownership_reads_a_rank_s_block_of_positions_as_a_flat_list():
    own = ownership([np.array([[0, 1], [1, 2]])], size=3)  # one rank claims 1 twice
    assert own.counts.tolist() == [1, 2, 1]
    assert own.owners_of(1) == [0, 0]
    assert own.describe() == "1 owned by several (first: 1, by ranks 0, 0)"


def test_ownership_of_one_missing_position_is_singular():
    assert ownership([[1]], size=2).describe() == "1 position owned by no rank (first: 0)"


# ---------------------------------------------------------------- split rules


@pytest.mark.parametrize("rule", ["ceil", "balanced"])
def test_latlon_partition_splits_with_its_own_rule(rule):
    part = LatLonPartition(10, 5, 4, 4, rule=rule)
    assert part.rule == rule
    assert part.lat_sizes == split_sizes(10, 4, rule=rule)
    assert part.lon_sizes == split_sizes(5, 4, rule=rule)
    assert part.lon_slice(3) == slice(sum(part.lon_sizes[:3]), 5)


def test_latlon_partition_records_the_installed_rule_when_none_is_given():
    part = LatLonPartition(10, 5, 4, 4)
    assert part.rule == sht_split_rule()
    assert part == LatLonPartition(10, 5, 4, 4, rule=sht_split_rule())


# ---------------------------------------------------------------- cell_of


def test_cell_of_accepts_the_poles_and_integer_degrees():
    assert cell_of(1, [90.0, -90.0], [0.0, 0.0]).tolist() == [0, 8]
    cells = cell_of(1, [80, -80], [45, 45])
    assert cells.dtype == np.int64 and cells.tolist() == [0, 8]


@pytest.mark.parametrize(
    ("lat", "lon", "shown"),
    [
        ([100], [10.0], "[100.0, 100.0]"),
        ([-90.5, 0.0], [10.0, 10.0], "[-90.5, 0.0]"),
        ([float("nan")], [10.0], "[nan, nan]"),
        ([0.0], [float("inf")], "[0.0, 0.0]"),
    ],
    ids=["over", "just_under_south_pole", "nan_latitude", "infinite_longitude"],
)
def test_cell_of_refuses_impossible_coordinates(lat, lon, shown):
    assert _message(lambda: cell_of(1, lat, lon)) == (
        "cell_of needs latitudes in [-90, 90] degrees and finite longitudes; got latitudes in "
        f"{shown}; did you swap lat and lon?"
    )


# ---------------------------------------------------------------- properties


@settings(max_examples=60)
@given(st.integers(0, 200), st.integers(1, 20), st.sampled_from(["ceil", "balanced"]))
def test_split_sizes_cover_the_size_with_non_negative_parts(size, parts, rule):
    sizes = split_sizes(size, parts, rule=rule)
    assert len(sizes) == parts and sum(sizes) == size and min(sizes) >= 0
    if rule == "balanced":
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
