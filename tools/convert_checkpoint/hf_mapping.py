"""Megatron GPTModel (local spec) -> a stock Hugging Face architecture, per `ModelShape.arch`:
- `qwen3` -> Qwen3ForCausalLM (pre-norm, QK-norm); `llama` -> LlamaForCausalLM (no QK-norm);
- `paper` -> Gemma3ForCausalLM (gemma3_text), whose blocks have the paper's pre- *and* post-norms
  (input / post_attention / pre_feedforward / post_feedforward) and QK-norm, with Gemma's extras
  neutralised by its own options or by the stored weights: every layer full attention (no sliding
  window), no logit soft-capping, SiLU gate, attention scale head_dim^-0.5 (query_pre_attn_scalar
  = head_dim); Gemma's RMSNorm multiplies by (1 + w), so w - 1 is stored, and it scales the
  embedding output by sqrt(hidden), so the embedding is stored divided by it.
  A Hugging Face model attends causally over the whole input: it reproduces the trainer on one
  document (or any input without an end-of-document token inside); document masking is training-
  time packing, not part of the model.
Conventions shared by all three, matching the trainer's model exactly:
- RoPE: Megatron's non-interleaved rotary embedding rotates halves (x1, x2) of each head with
  inv_freq = base^(-2i/d) over the full head dim, as HF's rotate_half with rope_theta = rotary_base;
- RMSNorm: torch.nn.RMSNorm, weight * x / sqrt(mean(x^2) + eps);
- QK-norm: per head over head_dim, before RoPE;
- fused QKV rows are grouped per query group; `logical_matrices` gives Q, K, V with heads in
  HF's order (query head h uses key/value head h // (heads / groups)); fc1 is [gate; up];
- untied embeddings; the padded vocabulary rows are dropped.
"""
from __future__ import annotations

import math
import re

import torch
from transformers import Gemma3TextConfig, LlamaConfig, PretrainedConfig, Qwen3Config

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
_PAPER_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_self_attn_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight",
}
_FUSED = {
    "self_attention.linear_qkv.weight": {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
                                         "v": "self_attn.v_proj.weight"},
    "mlp.linear_fc1.weight": {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight"},
}
_VOCAB_ROWS = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight"}
_CONFIGS = {"qwen3": Qwen3Config, "llama": LlamaConfig, "paper": Gemma3TextConfig}
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "paper": "Gemma3ForCausalLM"}


def hf_config(meta: CheckpointMeta, special_ids: dict[str, int]) -> PretrainedConfig:
    s = meta.model
    if s.arch == "paper":
        # sliding_window must be set for Gemma3's mask code but is unused: no layer is a sliding one.
        extra = dict(hidden_activation="silu", query_pre_attn_scalar=s.kv_channels, sliding_window=s.seq_length,
                     layer_types=["full_attention"] * s.num_layers, final_logit_softcapping=None,
                     attn_logit_softcapping=None)
    else:
        extra = dict(hidden_act="silu")
    return _CONFIGS[s.arch](
        vocab_size=meta.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.ffn_hidden_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.query_groups, head_dim=s.kv_channels, rms_norm_eps=s.norm_epsilon,
        rope_theta=float(s.rotary_base), max_position_embeddings=s.seq_length, tie_word_embeddings=False,
        attention_bias=False, architectures=[_ARCHITECTURES[s.arch]], dtype="float32", **extra, **special_ids)


def _gemma_stored(hf_name: str, tensor: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """What Gemma3 must store to compute what the trainer computes (see the module docstring)."""
    if hf_name.endswith("norm.weight"):
        return tensor - 1.0
    if hf_name == "model.embed_tokens.weight":
        return tensor / math.sqrt(hidden_size)
    return tensor


def hf_tensors(name: str, full: torch.Tensor, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors one full-layout Megatron parameter becomes."""
    tensors = _hf_tensors(name, full, meta)
    if meta.model.arch == "paper":
        return {k: _gemma_stored(k, t, meta.model.hidden_size) for k, t in tensors.items()}
    return tensors


def _hf_tensors(name: str, full: torch.Tensor, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
    if name in _VOCAB_ROWS:
        return {_VOCAB_ROWS[name]: full[:meta.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(f"no Hugging Face name for checkpoint parameter {name!r}")
    prefix, local = f"model.layers.{m.group(1)}.", m.group(2)
    layer_names = _PAPER_LAYER_NAMES if meta.model.arch == "paper" else _LAYER_NAMES
    if local in _FUSED:
        return {prefix + _FUSED[local][part]: t for part, t in logical_matrices(name, full, meta.model).items()}
    if local in layer_names:
        return {prefix + layer_names[local]: full}
    raise KeyError(f"no Hugging Face name for checkpoint parameter {name!r}")
