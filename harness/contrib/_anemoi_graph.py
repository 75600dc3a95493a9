"""A small hand-built anemoi graph and model config for ``harness.contrib.anemoi``.

The graph is what anemoi-graphs would produce for an encoder-processor-decoder model, built
with torch and torch_geometric only: ``data`` and ``hidden`` node sets with (lat, lon)
coordinates in radians, and ``data->hidden`` (encoder), ``hidden->hidden`` (processor) and
``hidden->data`` (decoder) edges to the ``k`` nearest nodes, each with an ``edge_length``
(great-circle distance) and ``edge_dirs`` (the unit direction in the lat/lon plane)
attribute. Everything is drawn from a private generator, so the graph does not depend on
(or disturb) the global RNG, and the reference and every rank build the same graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: processor kind -> (encoder, processor, decoder) hydra targets of anemoi-models 0.13.0
KINDS: dict[str, tuple[str, str, str]] = {
    "gnn": (
        "anemoi.models.layers.mapper.GNNForwardMapper",
        "anemoi.models.layers.processor.GNNProcessor",
        "anemoi.models.layers.mapper.GNNBackwardMapper",
    ),
    "transformer": (
        "anemoi.models.layers.mapper.GraphTransformerForwardMapper",
        "anemoi.models.layers.processor.TransformerProcessor",
        "anemoi.models.layers.mapper.GraphTransformerBackwardMapper",
    ),
    "graphtransformer": (
        "anemoi.models.layers.mapper.GraphTransformerForwardMapper",
        "anemoi.models.layers.processor.GraphTransformerProcessor",
        "anemoi.models.layers.mapper.GraphTransformerBackwardMapper",
    ),
}


def _points(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` (lat, lon) points in radians, roughly uniform on the sphere."""
    z = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
    lon = torch.rand(n, generator=gen, dtype=torch.float64) * 2 * math.pi
    return torch.stack([torch.asin(z), lon], dim=1)


def _xyz(p: torch.Tensor) -> torch.Tensor:
    lat, lon = p[:, 0], p[:, 1]
    return torch.stack([lat.cos() * lon.cos(), lat.cos() * lon.sin(), lat.sin()], dim=1)


def _knn_edges(src: torch.Tensor, dst: torch.Tensor, k: int, self_loops: bool) -> torch.Tensor:
    """(2, n_dst * k) edge index: each destination node receives from its ``k`` nearest
    sources (edges sorted by destination, as anemoi-graphs' builders give them)."""
    dist = torch.cdist(_xyz(dst), _xyz(src))
    if not self_loops:
        dist.fill_diagonal_(math.inf)
    k = min(k, src.shape[0] - (0 if self_loops else 1))
    nearest = dist.topk(k, dim=1, largest=False).indices  # (n_dst, k)
    dst_idx = torch.arange(dst.shape[0]).repeat_interleave(k)
    return torch.stack([nearest.reshape(-1), dst_idx])


def _edge_attributes(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor) -> dict[str, Any]:
    a, b = _xyz(src)[index[0]], _xyz(dst)[index[1]]
    length = torch.arccos((a * b).sum(1).clamp(-1, 1))[:, None]
    d = dst[index[1]] - src[index[0]]
    dirs = torch.nn.functional.normalize(d, dim=1)
    return {"edge_length": length / length.std().clamp_min(1e-12), "edge_dirs": dirs}


def build_graph(n_grid: int, n_hidden: int, k: int = 3, seed: int = 1234) -> Any:
    """The ``HeteroData`` graph: ``n_grid`` data nodes, ``n_hidden`` hidden nodes."""
    from torch_geometric.data import HeteroData

    gen = torch.Generator().manual_seed(seed)
    data, hidden = _points(n_grid, gen), _points(n_hidden, gen)
    graph = HeteroData()
    dtype = torch.get_default_dtype()  # the model's dtype: its buffers are made from these
    graph["data"].x = data.to(dtype)
    graph["hidden"].x = hidden.to(dtype)
    for src_name, dst_name, src, dst, self_loops in (
        ("data", "hidden", data, hidden, True),
        ("hidden", "hidden", hidden, hidden, False),
        ("hidden", "data", hidden, data, True),
    ):
        index = _knn_edges(src, dst, k, self_loops)
        store = graph[src_name, "to", dst_name]
        store.edge_index = index
        for name, value in _edge_attributes(src, dst, index).items():
            store[name] = value.to(dtype)
    return graph


def model_config(
    kind: str,
    *,
    num_channels: int = 8,
    num_layers: int = 1,
    num_heads: int = 4,
    dropout: float = 0.0,
    trainable_size: int = 0,
    num_chunks: int = 1,
    shard_strategy: str = "edges",
    latent_skip: bool = True,
    multistep: int = 1,
) -> dict[str, Any]:
    """The ``model_config`` dict anemoi-training would pass (the parts the model reads)."""
    # long: one nested literal, shaped as anemoi's own config is, so it reads against it
    enc, proc, dec = KINDS[kind]
    edges = ["edge_length", "edge_dirs"]
    kernels = {
        "LayerNorm": {"_target_": "torch.nn.LayerNorm"},
        "Linear": {"_target_": "torch.nn.Linear"},
        "Activation": {"_target_": "torch.nn.GELU"},
    }
    common: dict[str, Any] = {
        "trainable_size": trainable_size,
        "sub_graph_edge_attributes": edges,
        "num_chunks": num_chunks,
        "cpu_offload": False,
        "layer_kernels": kernels,
    }
    gt: dict[str, Any] = {
        "num_heads": num_heads,
        "mlp_hidden_ratio": 2,
        "qk_norm": False,
        "shard_strategy": shard_strategy,
        "graph_attention_backend": "pyg",  # the triton kernel needs a GPU
    }
    if kind == "gnn":
        mapper: dict[str, Any] = {**common, "mlp_extra_layers": 0}
        processor: dict[str, Any] = {**common, "mlp_extra_layers": 0, "num_layers": num_layers}
    else:
        mapper = {**common, **gt}
        processor = {**common, **gt, "num_layers": num_layers}
        if kind == "transformer":
            processor = {
                **common,
                "trainable_size": 0,  # no edges in a transformer processor: nothing to train
                "num_layers": num_layers,
                "num_heads": num_heads,
                "mlp_hidden_ratio": 2,
                "dropout_p": dropout,
                "attention_implementation": "scaled_dot_product_attention",
                "window_size": None,
            }
        elif dropout:
            processor["dropout_p"] = dropout
    return {
        "training": {"multistep_input": multistep, "multistep_output": 1},
        "model": {
            "num_channels": num_channels,
            "cpu_offload": False,
            "layer_kernels": kernels,
            "trainable_parameters": {
                "data": trainable_size,
                "hidden": trainable_size,
                "data2hidden": trainable_size,
                "hidden2data": trainable_size,
                "hidden2hidden": 0 if kind == "transformer" else trainable_size,
            },
            "model": {"hidden_nodes_name": "hidden", "latent_skip": latent_skip},
            "encoder": {"_target_": enc, **mapper},
            "processor": {"_target_": proc, **processor},
            "decoder": {"_target_": dec, **mapper, "initialise_data_extractor_zero": False}
            if kind != "gnn"
            else {"_target_": dec, **mapper},
            "residual": {"_target_": "anemoi.models.layers.residual.SkipConnection", "step": -1},
            "bounding": [],
        },
    }
