"""harness/_base/values.py: what a recorded value is, whatever tensor type the model used: a
DTensor's block from its placements, a ShardTensor's from its spec, anything else gathered
or read as is."""

from __future__ import annotations

import re

import pytest
import torch

from harness._base.values import block, is_distributed, placed, plain
from tests.unit._dtensor_like import Distributed, Mesh, dshard

F64 = torch.float64


def t(*values: float, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_a_replicated_dtensor_is_its_local_values_whole_with_no_gather():
    from torch.distributed.tensor import Replicate

    whole = t(1.0, 2.0, 3.0)
    value = dshard(whole, [Replicate()], (2,), (1,), ("spatial",))
    at = placed(value)
    assert (at.dim, at.gathered, type(at.values)) == (None, False, torch.Tensor)
    assert torch.equal(at.values, whole) and value.gathers == []
    assert at.how == "Distributed (Replicate()) on a 2 mesh ('spatial',)"


@pytest.mark.parametrize(
    ("placements", "shape", "coordinate", "span"),
    [
        ("RS0", (1, 2), (0, 0), (0, 0, 3)),  # 5 rows over 2: torch.chunk gives 3 + 2
        ("RS0", (1, 2), (0, 1), (0, 3, 2)),
        ("S0S0", (2, 2), (1, 0), (0, 3, 1)),  # rows 3..4 (5 over 2), then 1 of them (2 over 2)
        ("S0S0", (2, 2), (1, 1), (0, 4, 1)),
        ("S1", (3,), (1,), (1, 2, 2)),  # 4 columns over 3: chunks of 2, the third empty
        ("S1", (3,), (2,), (1, 4, 0)),
        ("S0", (4,), (3,), (0, 5, 0)),  # 5 rows over 4: chunks of 2 end at rank 2's one row
    ],
    ids=[
        "first",
        "uneven-last",
        "nested",
        "nested-last",
        "columns",
        "columns-empty",
        "past-the-end",
    ],
)
def test_a_dtensor_shard_is_the_block_torch_chunk_gives_its_coordinate(
    placements, shape, coordinate, span
):
    from torch.distributed.tensor import Replicate, Shard

    kinds = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    parts = [kinds[k] for k in re.findall(r"R|S\d", placements)]
    whole = torch.arange(20, dtype=F64).reshape(5, 4)
    value = dshard(whole, parts, shape, coordinate, span=span)
    assert block(value) == span
    at = placed(value)
    assert at.index.tolist() == list(range(span[1], span[1] + span[2]))
    assert torch.equal(at.values, whole.index_select(span[0], at.index)) and not value.gathers


def test_a_dtensor_shard_holding_other_values_than_its_placements_say_keeps_their_positions():
    from torch.distributed.tensor import Shard

    whole = torch.arange(5, dtype=F64)
    value = Distributed(whole, whole[:4], [Shard(0)], Mesh((2,), (1,)))  # 4 values, not 2
    assert block(value) == (0, 3, 2)  # the comparison says the shard has the wrong shape


def test_partial_sums_and_two_sharded_dims_are_gathered_whole_once():
    from torch.distributed.tensor import Partial, Shard

    whole = torch.arange(6, dtype=F64).reshape(2, 3)
    partial = Distributed(whole, whole / 2, [Partial()], Mesh((2,), (0,)))
    both = Distributed(whole, whole[:1, :2], [Shard(0), Shard(1)], Mesh((2, 2), (0, 0)))
    for value in (partial, both):
        assert block(value) is None
        at = placed(value)
        assert at.gathered and at.dim is None and torch.equal(at.values, whole)
        assert value.gathers == [1]


def test_a_shardtensor_spec_places_uneven_shards_by_its_own_offsets():
    from torch.distributed.tensor import Shard

    class Spec:  # physicsnemo's ShardTensorSpec: every shard's shape, offsets per mesh dim
        def __init__(self):
            self._sharding_shapes = {0: (torch.Size([1, 4]), torch.Size([4, 4]))}

        def offsets(self, mesh_dim):
            return 1

    whole = torch.arange(20, dtype=F64).reshape(5, 4)
    value = Distributed(whole, whole[1:], [Shard(0)], Mesh((2,), (1,)), Spec())
    assert block(value) == (0, 1, 4)  # torch.chunk would say rows 3..4


def test_a_subclass_without_placements_is_gathered_and_one_without_either_read_as_is():
    whole = t(1.0, 2.0)
    value = Distributed(whole, whole[:1])
    assert placed(value).gathered and torch.equal(placed(value).values, whole)

    class Tagged(torch.Tensor):
        pass

    tagged = torch.Tensor._make_subclass(Tagged, whole)
    assert type(plain(tagged)) is torch.Tensor and torch.equal(plain(tagged), whole)
    assert placed(tagged).how == "" and not is_distributed(tagged)
