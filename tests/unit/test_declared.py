"""What a case declares up front (harness/case/declared.py, Shard.grid), refused before any
rank runs with one ConfigError naming the answer and the fix."""

from __future__ import annotations

import re

import pytest
import torch

from harness import ConfigError, Positions, Shard, SpatialCase, Topology
from harness.case.declared import check_activation_shard, check_partition


class Declares(SpatialCase):
    """Answers partition and activation_shard with what it is given."""

    def __init__(self, partition=None, said=None):
        self.given, self.said = partition, said

    def partition(self, topo):
        return self.given


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("junk", "'junk' (a str)"),
        (42, "42 (a int)"),
        (
            [Positions(4, range(2)), 3.5],
            "[Positions(size=4, index=range(0, 2), unit='position'), 3.5] (a list)",
        ),
    ],
    ids=["str", "int", "list-with-junk"],
)
def test_a_partition_locating_cannot_read_is_one_config_error(given, shown):
    with pytest.raises(ConfigError) as info:
        check_partition(Declares(given), Topology.single())
    assert str(info.value) == (
        f"Declares.partition for the reference returned {shown}; return a LatLonPartition, "
        "a CellPartition, harness.Positions, a list of them, or None"
    )
    check_partition(Declares(Positions(4, range(2))), Topology.single())  # a good one passes
    check_partition(Declares(None), Topology.single())


@pytest.mark.parametrize(
    ("said", "says"),
    [
        (7, 'returned 7 (a int); return a Shard, "whole", "skip" or None'),
        ("halo", "returned 'halo' (a str); return a Shard"),
        (Shard(torch.zeros(3), torch.tensor([0, 1]), 0), "has 2 positions in its index but 3"),
        (Shard(torch.zeros(2), torch.tensor([0.0, 1.0]), 0), "has a float32 index"),
        (Shard.keyed(torch.zeros(2, 1), torch.arange(2)), "returned a Shard.keyed"),
    ],
    ids=["int", "str", "index-length", "float-index", "keyed"],
)
def test_an_activation_shard_answer_locating_cannot_read_is_one_config_error(said, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_activation_shard(Declares(), "block", said, " on rank 1")
    for good in (None, "whole", "skip", Shard(torch.zeros(2), torch.tensor([3, 5]), 0)):
        assert check_activation_shard(Declares(), "block", good) is good


@pytest.mark.parametrize("axes", [("l",), ("l", ""), ("l,m", "n"), "lm"])
def test_grid_axes_that_are_not_two_plain_names_are_refused_with_an_example(axes):
    with pytest.raises(ConfigError, match=r'two names without commas.*axes=\("l", "m"\)'):
        Shard.grid(torch.zeros(1, 3), slice(0, 1), slice(0, 3), 2, 3, axes=axes)
