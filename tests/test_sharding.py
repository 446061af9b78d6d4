"""The tensor-parallel sharding rules: shard/unshard and logical-matrix splits are exact inverses, a
TP shard of the fused QKV weight is itself the fused QKV of its query groups, and — against
Megatron's own modules — the Q/K/V split (with GQA) and the gate/up split are the ones Megatron's
attention and SwiGLU MLP compute with."""
import pytest
import torch
import torch.nn.functional as F

from trainer.model.sharding import (Split, from_logical_matrices, full_shape, sharding_of, logical_matrices,
                                  logical_shapes, shard, unshard)
from trainer.model.presets import PRESETS
from megatron_world import megatron_world_of_one, tiny_model

SHAPE = PRESETS["tiny"]  # 4 heads in 2 query groups (GQA), head dim 32, hidden 128, ffn 352
H, HD, G, FFN = SHAPE.hidden_size, SHAPE.kv_channels, SHAPE.query_groups, SHAPE.ffn_hidden_size
HEADS = SHAPE.num_attention_heads
QKV_ROWS = (HEADS + 2 * G) * HD
# Full (T=1) shapes of one parameter of each kind, under Megatron's names.
FULL_SHAPES = {
    "embedding.word_embeddings.weight": (1024, H),
    "output_layer.weight": (1024, H),
    "decoder.layers.0.self_attention.linear_qkv.weight": (QKV_ROWS, H),
    "decoder.layers.0.self_attention.linear_proj.weight": (H, HEADS * HD),
    "decoder.layers.0.mlp.linear_fc1.weight": (2 * FFN, H),
    "decoder.layers.0.mlp.linear_fc2.weight": (H, FFN),
    "decoder.layers.0.input_layernorm.weight": (H,),
    "decoder.layers.0.self_attention.q_layernorm.weight": (HD,),
    "decoder.final_layernorm.weight": (H,),
}
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def _random(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(FULL_SHAPES))
def test_shard_unshard_round_trip(name, tp):
    shape = FULL_SHAPES[name]
    sharding = sharding_of(name)
    full = _random(shape)
    shards = [shard(full, sharding, r, tp) for r in range(tp)]
    for s in shards:
        assert full_shape(tuple(s.shape), sharding, tp) == shape
    if sharding.split is not Split.REPLICATED:
        # Disjoint pieces: every element of the full tensor appears in exactly one shard.
        assert sorted(torch.cat([s.reshape(-1) for s in shards]).tolist()) == sorted(full.reshape(-1).tolist())
    assert torch.equal(unshard(shards, sharding), full)


def test_fc1_shard_holds_its_gate_and_up_slices():
    # Megatron's SwiGLU splits each rank's fc1 output in two halves: rank r must hold [gate_r; up_r].
    full = _random(FULL_SHAPES[FC1])
    gate, up = full[:FFN], full[FFN:]
    for r in range(2):
        rows = slice(r * FFN // 2, (r + 1) * FFN // 2)
        assert torch.equal(shard(full, sharding_of(FC1), r, 2), torch.cat([gate[rows], up[rows]]))


def test_qkv_shard_is_the_fused_qkv_of_its_query_groups():
    # Each TP rank runs attention on its own query groups with a local fused weight of the same form.
    full = _random(FULL_SHAPES[QKV])
    parts = logical_matrices(QKV, full, SHAPE)
    local_shape = SHAPE.with_overrides(num_attention_heads=HEADS // 2, num_query_groups=G // 2)
    for r in range(2):
        local = logical_matrices(QKV, shard(full, sharding_of(QKV), r, 2), local_shape)
        for part, per_group_rows in (("q", HEADS // G * HD), ("k", HD), ("v", HD)):
            rows = slice(r * per_group_rows * G // 2, (r + 1) * per_group_rows * G // 2)
            assert torch.equal(local[part], parts[part][rows]), (r, part)


@pytest.mark.parametrize("name", [QKV, FC1, "decoder.layers.0.mlp.linear_fc2.weight"])
def test_logical_matrices_inverse_and_shapes(name):
    full = _random(FULL_SHAPES[name])
    parts = logical_matrices(name, full, SHAPE)
    expected = {QKV: {"q": (HEADS * HD, H), "k": (G * HD, H), "v": (G * HD, H)},
                FC1: {"gate": (FFN, H), "up": (FFN, H)}}.get(name, {"": FULL_SHAPES[name]})
    assert {k: tuple(v.shape) for k, v in parts.items()} == expected
    assert logical_shapes(name, FULL_SHAPES[name], SHAPE) == expected
    assert torch.equal(from_logical_matrices(name, parts, SHAPE), full)


def test_unknown_parameter_has_no_sharding_rule():
    with pytest.raises(KeyError, match="no tensor-parallel sharding rule"):
        sharding_of("decoder.layers.0.mlp.router.weight")


@pytest.fixture(scope="module")
def layer():
    with megatron_world_of_one():
        yield tiny_model().decoder.layers[0]


@torch.no_grad()
def test_qkv_split_matches_megatron_attention(layer):
    attn = layer.self_attention
    x = _random((8, 2, H), seed=1)  # [sequence, batch, hidden]
    query, key, value = attn.get_query_key_value_tensors(x)
    parts = logical_matrices(QKV, attn.linear_qkv.weight, SHAPE)
    ours = {name: (x @ parts[name].T).view(8, 2, -1, HD) for name in "qkv"}
    # Megatron applies QK-norm inside the split; apply the same modules to ours.
    ours["q"], ours["k"] = attn.q_layernorm(ours["q"]), attn.k_layernorm(ours["k"])
    torch.testing.assert_close(ours["q"], query)
    torch.testing.assert_close(ours["k"], key)
    torch.testing.assert_close(ours["v"], value)


@torch.no_grad()
def test_gate_up_split_matches_megatron_swiglu(layer):
    mlp = layer.mlp
    x = _random((8, 2, H), seed=2)
    parts = logical_matrices(FC1, mlp.linear_fc1.weight, SHAPE)
    expected = (F.silu(x @ parts["gate"].T) * (x @ parts["up"].T)) @ mlp.linear_fc2.weight.T
    output, _ = mlp(x)
    torch.testing.assert_close(output, expected)
