"""How each Megatron parameter is sharded across tensor-parallel ranks, and which logical matrices
it holds. The optimizer (Muon on logical matrices), the initializer (identical weights at every TP
degree), checkpoint resharding and the Hugging Face exporter all go through this one mapping.

The *full* form of a parameter is what it would be at T=1:
- `linear_qkv`: rows grouped by query group g = 0..G-1, each group holding its H/G query heads,
  then one key head, then one value head (head_dim rows each). TP ranks hold contiguous groups, so
  shards concatenate along dim 0 into the full form.
- `linear_fc1`: rows [gate; up]. Each TP rank holds [gate_r; up_r], so the full form is *not*
  the concatenation of shards.
- Row-parallel weights (`linear_proj`, `linear_fc2`) split along dim 1; the vocabulary-parallel
  embedding and the output head along dim 0; norms are replicated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import torch

from trainer.model.presets import ModelShape


class Split(Enum):
    REPLICATED = "replicated"
    CONTIGUOUS = "contiguous"  # shards concatenate along partition_dim into the full form
    GATE_UP = "gate_up"  # each shard is [gate_r; up_r]


@dataclass(frozen=True)
class ParamSharding:
    split: Split
    partition_dim: int | None = None


_RULES: list[tuple[str, ParamSharding]] = [
    (r"embedding\.word_embeddings\.weight$", ParamSharding(Split.CONTIGUOUS, 0)),
    (r"output_layer\.weight$", ParamSharding(Split.CONTIGUOUS, 0)),
    (r"self_attention\.linear_qkv\.weight$", ParamSharding(Split.CONTIGUOUS, 0)),
    (r"self_attention\.linear_proj\.weight$", ParamSharding(Split.CONTIGUOUS, 1)),
    (r"mlp\.linear_fc1\.weight$", ParamSharding(Split.GATE_UP, 0)),
    (r"mlp\.linear_fc2\.weight$", ParamSharding(Split.CONTIGUOUS, 1)),
    (r"(layernorm|norm)\.weight$", ParamSharding(Split.REPLICATED)),
]


def sharding_of(name: str) -> ParamSharding:
    for pattern, sharding in _RULES:
        if re.search(pattern, name):
            return sharding
    raise KeyError(f"no tensor-parallel sharding rule matches parameter {name!r}")


def shard(full: torch.Tensor, sharding: ParamSharding, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of a full (T=1) tensor that TP rank `tp_rank` holds."""
    if sharding.split is Split.REPLICATED or tp_size == 1:
        return full
    dim = sharding.partition_dim
    if sharding.split is Split.GATE_UP:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank], up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def unshard(shards: list[torch.Tensor], sharding: ParamSharding) -> torch.Tensor:
    """Inverse of `shard`: the full (T=1) tensor from every TP rank's slice, in TP-rank order."""
    if sharding.split is Split.REPLICATED or len(shards) == 1:
        return shards[0]
    dim = sharding.partition_dim
    if sharding.split is Split.GATE_UP:
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def logical_matrices(name: str, full: torch.Tensor, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The separate matrices a full (T=1) weight holds, as the paper's model orthogonalizes them:
    Q, K, V for a fused QKV weight; gate and up for a fused fc1; the weight itself otherwise."""
    if name.endswith("linear_qkv.weight"):
        groups, per_group, hd = shape.query_groups, shape.num_attention_heads // shape.query_groups, shape.kv_channels
        g = full.view(groups, (per_group + 2) * hd, full.shape[-1])
        q, k, v = g.split([per_group * hd, hd, hd], dim=1)
        return {"q": q.reshape(-1, full.shape[-1]), "k": k.reshape(-1, full.shape[-1]),
                "v": v.reshape(-1, full.shape[-1])}
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return {"gate": gate, "up": up}
    return {"": full}


def from_logical_matrices(name: str, parts: dict[str, torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """Inverse of `logical_matrices`."""
    if name.endswith("linear_qkv.weight"):
        groups, hd = shape.query_groups, shape.kv_channels
        cols = parts["q"].shape[-1]
        q = parts["q"].view(groups, -1, cols)
        k = parts["k"].view(groups, hd, cols)
        v = parts["v"].view(groups, hd, cols)
        return torch.cat([q, k, v], dim=1).reshape(-1, cols)
    if name.endswith("linear_fc1.weight"):
        return torch.cat([parts["gate"], parts["up"]], dim=0)
    return parts[""]


def logical_shapes(name: str, full_shape: tuple[int, ...], shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Shapes of `logical_matrices` without materializing anything (for planning and ownership)."""
    meta = torch.empty(full_shape, device="meta")
    return {k: tuple(v.shape) for k, v in logical_matrices(name, meta, shape).items()}


def full_shape(local_shape: tuple[int, ...], sharding: ParamSharding, tp_size: int) -> tuple[int, ...]:
    if sharding.split is Split.REPLICATED:
        return tuple(local_shape)
    dims = list(local_shape)
    dims[sharding.partition_dim] *= tp_size
    return tuple(dims)
