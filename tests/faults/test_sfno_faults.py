"""The SFNO fault switches: one per SFNO row of FAULTS.md, unknown ids refused."""

from __future__ import annotations

import pytest

from harness import ConfigError
from harness.steppers.sfno import FAULT_CHECKS, SFNOCase

# The SFNO rows of FAULTS.md, in the order they appear there.
CATALOGUE = [
    "reduce-not-differentiable",
    "reduce-double-count",
    "coupling-identity-backward",
    "no-grad-sync",
    "grad-sync-mean",
    "buffer-broadcast",
    "mean-of-means",
    "split-mismatch",
    "per-rank-noise",
    "local-weights",
    "reduce-over-world",
    "shard-wrong-l",
    "shard-grad-replicated",
    "band-start-from-own-size",
    "m-slice-from-end",
    "noise-per-data-group",
]
# Each fault is run, on and off, by tests/faults/test_catalogue.py from FAULT_CHECKS.


def test_every_sfno_fault_of_the_catalogue_has_a_switch_and_a_check():
    assert sorted(FAULT_CHECKS) == sorted(CATALOGUE)


def test_a_sharded_weight_fault_without_sharded_weights_is_refused():
    with pytest.raises(
        ConfigError, match=r"\['shard-wrong-l'\] live in sharded .*shard_weights=True"
    ):
        SFNOCase(faults={"shard-wrong-l"})


def test_an_unknown_shard_init_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"shard_init 'random' is not known.*'per-rank'"):
        SFNOCase(shard_weights=True, shard_init="random")


def test_an_unknown_fault_id_is_refused_with_the_valid_ones_listed():
    with pytest.raises(ConfigError, match=r"valid ids: .*grad-sync-mean"):
        SFNOCase(faults={"grad-sync-median"})
