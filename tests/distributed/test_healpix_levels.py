"""A two-level HEALPix UNet (``healpix_levels``): its partition is one ``CellPartition`` per
level, and a failing check draws an error map for every field, each at its own level."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import check_equivalence
from tests.distributed.healpix_levels import LevelsCase


def test_the_two_level_healpix_unet_is_equivalent_on_four_ranks(spatial):
    report = check_equivalence(LevelsCase(), ranks=4, pool=spatial.pool(4))
    assert report.ok, report


def test_a_failing_two_level_model_gets_an_error_map_for_each_level(spatial, tmp_path):
    pytest.importorskip("matplotlib")
    from harness.plugin import write_error_maps

    report = check_equivalence(LevelsCase("local-mean"), ranks=4, steps=1, pool=spatial.pool(4))
    assert not report.ok
    fields = {(fe.name, fe.error.numel()) for fe in report.field_errors}
    assert fields == {("forecast", 192), ("latent", 48)}  # nside 4 and nside 2
    paths = write_error_maps(report, str(tmp_path), "tests/x.py::test_levels")
    assert sorted(Path(p).name for p in paths) == [
        "tests.x.test_levels.forecast.step0.png",
        "tests.x.test_levels.latent.step0.png",
    ]


def test_locating_places_the_coarse_level_only_when_partition_returns_both_levels(spatial):
    pool = spatial.pool(4)
    both = check_equivalence(LevelsCase("local-mean"), ranks=4, steps=1, locate=True, pool=pool)
    assert both.first_divergence is not None and both.location is not None
    # the missing reduction is in the coarse level's mean: first seen entering 'mix'
    assert both.first_divergence.quantity == "input of 'mix'"
    assert both.location.not_compared == {}
    fine = LevelsCase("local-mean", both_levels=False)
    one = check_equivalence(fine, ranks=4, steps=1, locate=True, pool=pool)
    assert one.location is not None and one.first_divergence is not None
    # the coarse tensors fit no declared layout: listed, and the bug is seen a level later
    assert one.location.not_compared == {"mix": ["input (2, 12, 3)", "output (2, 12, 3)"]}
    assert one.first_divergence.quantity == "input of 'decode'"
