"""NVIDIA makani's spatially parallel SFNO (model parallel over h, spectral weights sharded
by degree l) against its own single-process path (checked on makani 0.2.0, commit 2dfc4c8,
with torch 2.14.1 and torch-harmonics 0.9.3).

makani cannot be a CI dependency: it is not on the package index, and it needs
torch-harmonics >= 0.9 (``torch_harmonics.quadrature.precompute_latitudes``) where the
project's CI pins 0.8.0. These tests run where makani is installed and skip otherwise,
naming the install command. Tolerances are the harness's float32 defaults: makani's spectral
weights are complex64 and its transforms float32 whatever the default dtype.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from harness.contrib.makani import EXPECTED, INSTALL, MakaniCase, MakaniNotInstalled, require
from harness.errors import ConfigError

RANKS = 4  # h = 2 model parallel x 2 data-parallel groups


def _installed() -> bool:
    try:
        require()
    except MakaniNotInstalled:
        return False
    return True


needs_makani = pytest.mark.skipif(
    not _installed(), reason=f"makani is not installed here; install it with: {INSTALL}"
)


def test_missing_makani_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "makani.models.networks", None)
    with pytest.raises(ImportError, match="not on the package index") as info:
        require()
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match="unknown makani fault"):
        MakaniCase(faults=("nope",))


@needs_makani
@pytest.mark.spatial(ranks=RANKS)
def test_makani_h2_with_sharded_spectral_weights_matches_reference(spatial: Any) -> None:
    from harness import check_equivalence

    report = check_equivalence(MakaniCase(), ranks=RANKS, spatial_size=2, pool=spatial.pool(RANKS))
    assert report.ok, report
    # the spectral weights were declared as shards and loaded from the reference's
    assert "reference initial values loaded" in str(report)
    assert "net.blocks.0.filter.filter.weight" in str(report)


@needs_makani
@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("fault", ["grad-not-summed-over-model", "input-slices-mirrored"])
def test_a_bug_patched_into_makani_fails_with_a_report(spatial: Any, fault: str) -> None:
    from harness import check_equivalence

    case = MakaniCase(faults=(fault,))
    report = check_equivalence(case, ranks=RANKS, spatial_size=2, pool=spatial.pool(RANKS))
    assert not report.ok, f"{fault} not caught"
    # a verdict, not a crash: the first mismatch is of the quantities the bug must break
    assert report.mismatches[0].quantity in EXPECTED[fault], str(report)


class DrawnOnRanks(MakaniCase):
    """makani as it is built, without the reference's initial values."""

    load_reference_init = False


@needs_makani
@pytest.mark.spatial(ranks=RANKS)
def test_without_the_reference_init_makani_h2_cannot_start_where_the_reference_does(
    spatial: Any,
) -> None:
    # why MakaniCase sets load_reference_init: each rank draws its spectral-weight shard at
    # the shard's shape (fewer random numbers, and makani's l = 0 scale on every rank's own
    # block), so that shard and every parameter drawn after it differ from the reference's
    from harness import check_equivalence

    report = check_equivalence(
        DrawnOnRanks(), ranks=RANKS, spatial_size=2, pool=spatial.pool(RANKS)
    )
    assert not report.ok
    first = report.mismatches[0]
    assert (first.quantity, first.step) == ("param", None), str(report)  # at the initial value
    # a replicated parameter drawn after the first shard is off too
    assert first.name == "net.blocks.0.outer_skip.weight", str(report)
