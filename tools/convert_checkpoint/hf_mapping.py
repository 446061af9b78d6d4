"""Megatron GPTModel (local spec) -> Hugging Face Qwen3ForCausalLM (with QK-norm) or
LlamaForCausalLM (without). Both conventions match the trainer's model exactly:
- RoPE: Megatron's non-interleaved rotary embedding rotates halves (x1, x2) of each head with
  inv_freq = base^(-2i/d) over the full head dim, as HF's rotate_half with rope_theta = rotary_base;
- RMSNorm: torch.nn.RMSNorm, weight * x / sqrt(mean(x^2) + eps), no zero-centered gamma: HF's too;
- QK-norm: per head over head_dim, before RoPE (Qwen3's q_norm/k_norm);
- fused QKV rows are grouped per query group; `logical_matrices` gives Q, K, V with heads in
  HF's order (query head h uses key/value head h // (heads / groups)); fc1 is [gate; up];
- untied embeddings; the padded vocabulary rows are dropped.
"""
from __future__ import annotations

import re

import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from trainer.checkpoint import CheckpointMeta
from trainer.model.layout import logical_matrices

_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_FUSED = {
    "self_attention.linear_qkv.weight": {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
                                         "v": "self_attn.v_proj.weight"},
    "mlp.linear_fc1.weight": {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight"},
}
_VOCAB_ROWS = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight"}


def hf_config(meta: CheckpointMeta, special_ids: dict[str, int]) -> PretrainedConfig:
    s = meta.model
    cls = Qwen3Config if s.qk_layernorm else LlamaConfig
    return cls(vocab_size=meta.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.ffn_hidden_size,
               num_hidden_layers=s.num_layers, num_attention_heads=s.num_attention_heads,
               num_key_value_heads=s.query_groups, head_dim=s.kv_channels, rms_norm_eps=s.norm_epsilon,
               rope_theta=float(s.rotary_base), max_position_embeddings=s.seq_length, tie_word_embeddings=False,
               attention_bias=False, hidden_act="silu", architectures=[cls.__name__.replace("Config", "ForCausalLM")],
               dtype="float32", **special_ids)


def hf_tensors(name: str, full: torch.Tensor, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors one full-layout Megatron parameter becomes."""
    if name in _VOCAB_ROWS:
        return {_VOCAB_ROWS[name]: full[:meta.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(f"no Hugging Face name for checkpoint parameter {name!r}")
    prefix, local = f"model.layers.{m.group(1)}.", m.group(2)
    if local in _FUSED:
        return {prefix + _FUSED[local][part]: t for part, t in logical_matrices(name, full, meta.model).items()}
    if local in _LAYER_NAMES:
        return {prefix + _LAYER_NAMES[local]: full}
    raise KeyError(f"no Hugging Face name for checkpoint parameter {name!r}")
