"""The HEALPix stepper: cell-partitioned, it computes what the single-process reference does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ConfigError, Topology, check_equivalence
from harness.partition import cell_of
from harness.steppers.healpix import HealpixCase
from harness.strategies import cell_partitions, observation_sets

RANKS = 4

# (spatial_size, case kwargs): every layout on 4 ranks, so one warm pool serves them all
LAYOUTS = {
    "nside1_even": (None, {"nside": 1}),
    "nside2_even": (None, {"nside": 2}),
    "nside4_even": (None, {"nside": 4, "n_obs": 120}),
    "nside2_uneven": (None, {"nside": 2, "bounds": (0, 5, 20, 31, 48)}),
    "nside1_empty_ranges": (None, {"nside": 1, "bounds": (0, 0, 7, 7, 12)}),
    "nside4_empty_first_and_last": (None, {"nside": 4, "bounds": (0, 0, 100, 192, 192)}),
    "nside2_unobserved_ranks": (
        None,
        {"nside": 2, "bounds": (0, 12, 24, 36, 48), "empty_ranks": (1, 3)},
    ),
    "nside2_batch3_sparse": (None, {"nside": 2, "batch_size": 3, "n_obs": 6}),
    "nside2_spatial2_x_data2": (2, {"nside": 2, "batch_size": 4}),
    "nside2_empty_rank_x_data2": (2, {"nside": 2, "bounds": (0, 0, 48), "batch_size": 4}),
    "nside2_data4": (1, {"nside": 2, "batch_size": 4}),
}


@pytest.mark.parametrize(("spatial_size", "kwargs"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_stepper_is_equivalent_to_its_reference_on_every_cell_partition(
    spatial, spatial_size, kwargs
):
    report = check_equivalence(
        HealpixCase(**kwargs),
        ranks=RANKS,
        spatial_size=spatial_size,
        pool=spatial.pool(RANKS),
    )
    assert report.ok, str(report)
    # float64: the partitioned run only reorders sums (per-rank partial sums, then the
    # all-reduce), so everything agrees to a few 1e-13 (measured); the default bounds
    # (rtol 1e-10, atol 1e-12) hold with room to spare.
    assert max(report.stats[q].max_abs for q in ("loss", "grad", "field", "param")) < 1e-11


@settings(
    max_examples=4,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), nside=st.sampled_from([1, 2]))
def test_any_drawn_partition_and_observation_set_is_equivalent(spatial, data, nside):
    part = data.draw(cell_partitions(nside=nside, ranks=RANKS), label="partition")
    sets = observation_sets(nside=nside, channels=2, max_points=24, partition=part)
    samples = data.draw(st.lists(sets, min_size=2, max_size=2), label="observations")
    case = HealpixCase(nside=nside, bounds=part.bounds, observations=samples, channels=2)
    report = check_equivalence(case, ranks=RANKS, pool=spatial.pool(RANKS))
    assert report.ok, str(report)


def test_the_reference_run_matches_its_golden(spatial):
    case = HealpixCase(nside=2, bounds=(0, 10, 10, 30, 48), batch_size=2)
    report = spatial.check(case, golden=True, ranks=RANKS)
    assert report.partition == "nside 2, cells [0:10|10:10|10:30|30:48]"


# ---------------------------------------------------------------- the batch, without ranks


def _rank_topology(rank: int, size: int) -> Topology:
    """A rank's topology, enough for ``batch`` (which runs no collective)."""
    return Topology(size, rank, size, rank, object(), 1, 0, None)


def _batch(case: HealpixCase, topo: Topology) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # as the harness does before every batch
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return case.batch(topo, 0)
    finally:
        torch.set_default_dtype(old)


def test_each_rank_gets_exactly_its_cells_share_of_the_reference_batch():
    case = HealpixCase(nside=2, bounds=(0, 0, 19, 30, 48), batch_size=3, n_obs=30)
    ref = _batch(case, Topology.single())
    npix, b = 48, 3
    ref_key = ref["slot"]  # sample * npix + cell
    keys, feats, targets, masks = [], [], [], []
    for r in range(4):
        topo = _rank_topology(r, 4)
        lo, hi = case.partition(topo).bounds[r : r + 2]
        got = _batch(case, topo)
        n = max(hi - lo, 1)
        keys.append(got["slot"] // n * npix + lo + got["slot"] % n)
        feats.append(got["obs"])
        targets.append(got["target"])
        masks.append(got["mask"])
        assert got["target"].shape == (b, hi - lo, 2)
    key, feat = torch.cat(keys), torch.cat(feats)
    order = torch.sort(key, stable=True).indices  # rank-major -> sample-major, cell order
    assert torch.equal(key[order], ref_key)
    assert torch.equal(feat[order], ref["obs"])
    assert torch.equal(torch.cat(targets, dim=1), ref["target"])
    assert torch.equal(torch.cat(masks, dim=1), ref["mask"])


def test_unobserved_ranks_get_neither_observations_nor_targets():
    case = HealpixCase(nside=2, bounds=(0, 12, 24, 36, 48), empty_ranks=(2,), n_obs=200)
    quiet = _batch(case, _rank_topology(2, 4))
    assert quiet["obs"].shape == (0, 5) and not quiet["mask"].any()
    ref = _batch(case, Topology.single())
    cells = ref["slot"] % 48
    assert not ((cells >= 24) & (cells < 36)).any()
    assert ref["mask"][:, 24:36].sum() == 0 and ref["mask"].sum() > 0


def test_explicit_observations_land_in_the_cell_cell_of_gives_them():
    lat, lon = np.array([80.0, -80.0, 0.0]), np.array([45.0, 45.0, 10.0])
    obs = type("Obs", (), {"lat": lat, "lon": lon, "values": np.ones((3, 2))})()
    case = HealpixCase(nside=1, observations=[obs], batch_size=2)
    ref = _batch(case, Topology.single())
    expected = cell_of(1, lat, lon)
    per_sample = ref["slot"].reshape(2, 3)
    assert torch.equal(per_sample % 12, torch.as_tensor(np.sort(expected)).expand(2, 3))
    assert torch.equal(per_sample // 12, torch.tensor([[0] * 3, [1] * 3]))


# ---------------------------------------------------------------- configuration


def test_the_partition_is_described_as_cell_ranges():
    assert HealpixCase(nside=2).describe(_rank_topology(0, 4)) == (
        "nside 2, cells [0:12|12:24|24:36|36:48]"
    )
    assert HealpixCase(nside=1).describe(Topology.single()) == "nside 1"
    assert HealpixCase(nside=1, bounds=(0, 0, 12), empty_ranks=(1,)).describe() == (
        "nside 1, cells [0:0|0:12], nothing observed on ranks [1]"
    )


def test_misconfigurations_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="needs bounds"):
        HealpixCase(nside=2, empty_ranks=(1,))
    with pytest.raises(ConfigError, match="outside the 2 ranks"):
        HealpixCase(nside=1, bounds=(0, 6, 12), empty_ranks=(2,))
    with pytest.raises(ConfigError, match="run from 0 to npix=12"):
        HealpixCase(nside=1, bounds=(0, 6, 10))
    with pytest.raises(ConfigError, match="spatial group has 4; give 5 bounds"):
        HealpixCase(nside=1, bounds=(0, 6, 12)).partition(_rank_topology(0, 4))
