"""anemoi-models 0.13.0's sharded encoder-processor-decoder against its single-process path.

Runs in the anemoi CI venv (``pip install "pytest-spatial-harness[anemoi]"``); skipped
where anemoi-models is not installed.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

pytest.importorskip(
    "anemoi.models",
    reason="anemoi-models is not installed here: tox -e anemoi (and .ci/run) runs these",
)

from harness.contrib.anemoi import AnemoiCase, fault_matrix, main_configs, require_anemoi
from harness.errors import ConfigError
from tests.contrib.upstream import assert_fault_caught, finding, upstream_bug

RANKS = 4


def test_missing_anemoi_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "anemoi.models", None)
    with pytest.raises(ConfigError, match=r"pytest-spatial-harness\[anemoi\]"):
        require_anemoi()
    with pytest.raises(ConfigError, match="unknown anemoi fault"):
        AnemoiCase(faults="nope")


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("config", main_configs(RANKS), ids=lambda c: c[0])
def test_layout_matches_reference(spatial: Any, config: Any) -> None:
    _label, factory, kwargs, spatial_size = config
    spatial.check(factory(**kwargs), spatial_size=spatial_size)


@pytest.mark.spatial(ranks=RANKS)
@pytest.mark.parametrize("fault", list(fault_matrix(RANKS)), ids=lambda f: f[4])
def test_fault_in_anemoi_is_caught(spatial: Any, fault: Any) -> None:
    assert_fault_caught(spatial, fault, RANKS)


# ---------------------------------------------------------------------- findings (FINDINGS.md)


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "anemoi-models 0.13.0: GraphConvMapperBlock shards its message sum with "
    "shard_tensor(gather_in_backward=False), whose backward returns the shard-sized gradient "
    "for the full-sized input: the GNN mappers fail in backward on any model group > 1"
)
def test_gnn_backward_on_a_model_group(spatial: Any) -> None:
    finding(
        spatial,
        AnemoiCase(kind="gnn"),
        RANKS,
        lambda m, _: (
            m.quantity == "error"
            and m.phase == "step 0 backward"
            and "_ShardParallelSectionBackward returned an invalid gradient" in m.where
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "anemoi-models 0.13.0: distributed.primitives._reduce(use_fp32=True) all-reduces "
    "float64 tensors in float32 (sync_tensor backward, reduce_tensor): float64 gradients of "
    "the sharded path are rounded to float32"
)
def test_float64_edge_sharding_keeps_float64(spatial: Any) -> None:
    # float64 tolerances (rtol 1e-10): only reordered sums may differ
    case = AnemoiCase(kind="graphtransformer", shard_strategy="edges")
    # the harness's own diagnosis: errors at float32 rounding in a float64 run
    finding(spatial, case, RANKS, lambda m, report: "float32" in report.likely)


@pytest.mark.spatial(ranks=RANKS)
@upstream_bug(
    "anemoi-models 0.13.0: a model-group rank whose grid shard is empty "
    "(grid_shard_shapes with a 0) fails in the encoder's edge sharding (IndexError)"
)
def test_empty_grid_shard(spatial: Any) -> None:
    case = AnemoiCase(
        kind="graphtransformer",
        shard_input=True,
        grid_shards=(20, 0, 10, 10),
        dtype=torch.float32,
    )
    finding(
        spatial,
        case,
        RANKS,
        lambda m, _: (
            m.quantity == "error"
            and m.rank == 1
            and m.phase == "step 0 forward"
            and "IndexError" in m.where
        ),
    )


@pytest.mark.spatial(ranks=RANKS)
def test_fewer_hidden_nodes_than_ranks(spatial: Any) -> None:
    """3 hidden nodes on 4 ranks: one rank's hidden shard is empty, and that works."""
    spatial.check(AnemoiCase(kind="graphtransformer", n_hidden=3, shard_strategy="heads"))
