"""Every SFNO fault of FAULTS.md fails check_equivalence with the quantity that shows it."""

from __future__ import annotations

import pytest

from harness import ConfigError, check_equivalence
from harness.steppers.sfno import FAULT_CHECKS, SFNOCase

# The SFNO rows of FAULTS.md, in the order they appear there.
CATALOGUE = [
    "reduce-not-differentiable", "reduce-double-count", "coupling-identity-backward",
    "no-grad-sync", "grad-sync-mean", "buffer-broadcast", "mean-of-means", "split-mismatch",
    "per-rank-noise", "local-weights", "reduce-over-world",
]
RANKS = 4  # FAULT_CHECKS layouts are sized for 4 ranks


def test_every_sfno_fault_of_the_catalogue_has_a_switch_and_a_check():
    assert sorted(FAULT_CHECKS) == sorted(CATALOGUE)


@pytest.mark.parametrize("fault", CATALOGUE)
def test_each_fault_fails_with_its_quantity_and_the_same_layout_passes_without_it(
    spatial, fault
):
    expected, kwargs, spatial_size = FAULT_CHECKS[fault]
    ranks = RANKS
    pool = spatial._registry.get(ranks)
    broken = check_equivalence(SFNOCase(**kwargs, faults={fault}), ranks=ranks,
                               spatial_size=spatial_size, pool=pool)
    assert not broken.ok, f"{fault} went unnoticed"
    assert broken.quantities & expected, str(broken)
    fixed = check_equivalence(SFNOCase(**kwargs), ranks=ranks, spatial_size=spatial_size,
                              pool=pool)
    assert fixed.ok, str(fixed)


def test_an_unknown_fault_id_is_refused_with_the_valid_ones_listed():
    with pytest.raises(ConfigError, match=r"valid ids: .*grad-sync-mean"):
        SFNOCase(faults={"grad-sync-median"})
