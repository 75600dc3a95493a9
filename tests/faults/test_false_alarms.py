"""False-alarm sweep: the correct steppers must pass everywhere, not on hand-picked cases.

Hypothesis draws partitions (uneven, and with empty ranks where the stepper allows them),
grid sizes, batch sizes, data × spatial layouts and float32 / float64; every draw must be
equivalent under the default tolerances. Profile ``ci`` runs 25 examples per stepper;
``--hypothesis-profile thorough`` runs 250 for a nightly job.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import check_equivalence
from harness.steppers.mlp import CoupledMLPCase
from harness.strategies import process_grids

RANKS = 4
# a fixture-using test runs many examples through the one warm pool: that is the point
FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)

dtypes = st.sampled_from([torch.float64, torch.float32])
layouts = st.sampled_from([None, 2])  # one spatial group of 4, or spatial 2 x data 2


def _check(spatial, case, spatial_size, *, locate: bool | None = None):
    """``case`` on the warm pool, laid out as drawn (located if it fails, or on request)."""
    return check_equivalence(
        case, ranks=RANKS, spatial_size=spatial_size, pool=spatial.pool(RANKS), locate=locate
    )


@FIXTURE_OK
@given(
    npos=st.integers(1, 40),  # fewer positions than ranks: empty ranks
    batch=st.integers(1, 3),
    dtype=dtypes,
    spatial_size=layouts,
)
def test_the_coupled_mlp_passes_on_every_drawn_layout(spatial, npos, batch, dtype, spatial_size):
    batch_size = batch * (RANKS // (spatial_size or RANKS))
    report = _check(
        spatial, CoupledMLPCase(npos=npos, batch_size=batch_size, dtype=dtype), spatial_size
    )
    assert report.ok, report


@st.composite
def sfno_layouts(draw: st.DrawFn) -> dict:
    spatial_size = draw(layouts)
    s = spatial_size or RANKS
    h, w = draw(process_grids(s))
    return {
        # truncation lmax = mmax = min(nlat - 1, nlon // 2 + 1) modes over h and w ranks
        "nlat": draw(st.integers(max(h, w, 3) + 1, 24)),
        "nlon": draw(st.integers(max(2 * max(h, w), 8), 40)),
        "h": h,
        "w": w,
        "grid": draw(st.sampled_from(["equiangular", "legendre-gauss"])),
        "noise": draw(st.integers(0, 1)),
        "batch_size": draw(st.integers(1, 2)) * (RANKS // s),
        "dtype": draw(dtypes),
        "spatial_size": spatial_size,
    }


@FIXTURE_OK
@given(layout=sfno_layouts())
def test_the_sfno_stepper_passes_on_every_drawn_grid_and_process_grid(spatial, layout):
    pytest.importorskip("torch_harmonics")
    from harness.steppers.sfno import SFNOCase

    spatial_size = layout.pop("spatial_size")
    report = _check(spatial, SFNOCase(**layout), spatial_size)
    assert report.ok, report


@FIXTURE_OK
@given(data=st.data(), nside=st.sampled_from([1, 2, 4]), dtype=dtypes, spatial_size=layouts)
def test_the_healpix_stepper_passes_on_every_drawn_partition_and_observation_set(
    spatial, data, nside, dtype, spatial_size
):
    from harness.steppers.healpix import HealpixCase
    from harness.strategies import cell_partitions, observation_sets

    s = spatial_size or RANKS
    part = data.draw(cell_partitions(nside=nside, ranks=s), label="partition")  # empty ranks too
    per_group = data.draw(st.integers(1, 2), label="samples per data group")
    sets = observation_sets(nside=nside, channels=2, max_points=32, partition=part)
    samples = data.draw(st.lists(sets, min_size=1, max_size=3), label="observations")
    case = HealpixCase(
        nside=nside,
        bounds=part.bounds,
        observations=samples,
        channels=2,
        batch_size=per_group * (RANKS // s),
        dtype=dtype,
    )
    report = _check(spatial, case, spatial_size)
    assert report.ok, report


# ---------------------------------------------------------------------- located, on a subset

#: locating reruns a step hooked three times: a few drawn layouts per stepper keep it cheap
LOCATED = settings(FIXTURE_OK, max_examples=4)


def _nothing_departs(report) -> None:
    assert report.ok, report
    assert report.first_divergence is None, report.first_divergence.line()
    assert report.location is not None and report.location.compared > 0
    assert "First divergence" not in str(report)


@LOCATED
@given(npos=st.integers(1, 40), batch=st.integers(1, 2), dtype=dtypes, spatial_size=layouts)
def test_no_module_of_the_coupled_mlp_departs_on_a_drawn_layout(
    spatial, npos, batch, dtype, spatial_size
):
    batch_size = batch * (RANKS // (spatial_size or RANKS))
    report = _check(
        spatial,
        CoupledMLPCase(npos=npos, batch_size=batch_size, dtype=dtype),
        spatial_size,
        locate=True,
    )
    _nothing_departs(report)


@LOCATED
@given(layout=sfno_layouts())
def test_no_module_of_the_sfno_stepper_departs_on_a_drawn_grid(spatial, layout):
    pytest.importorskip("torch_harmonics")
    from harness.steppers.sfno import SFNOCase

    spatial_size = layout.pop("spatial_size")
    report = _check(spatial, SFNOCase(**layout), spatial_size, locate=True)
    _nothing_departs(report)


@LOCATED
@given(data=st.data(), nside=st.sampled_from([1, 2]), dtype=dtypes, spatial_size=layouts)
def test_no_module_of_the_healpix_stepper_departs_on_a_drawn_partition(
    spatial, data, nside, dtype, spatial_size
):
    from harness.steppers.healpix import HealpixCase
    from harness.strategies import cell_partitions

    s = spatial_size or RANKS
    part = data.draw(cell_partitions(nside=nside, ranks=s), label="partition")
    case = HealpixCase(nside=nside, bounds=part.bounds, batch_size=2 * (RANKS // s), dtype=dtype)
    report = _check(spatial, case, spatial_size, locate=True)
    _nothing_departs(report)
