"""Megatron GPTModel (local spec) <-> a stock Hugging Face architecture, per `ModelShape.arch`, in
both directions (the exporter and the importer share every table and convention here):
- `qwen3` <-> Qwen3ForCausalLM (pre-norm, QK-norm); `llama` <-> LlamaForCausalLM (no QK-norm);
- `paper` <-> Gemma3ForCausalLM (gemma3_text), whose blocks have the paper's pre- *and* post-norms
  (input / post_attention / pre_feedforward / post_feedforward) and QK-norm, with Gemma's extras
  neutralised by its own options or by the stored weights: every layer full attention (no sliding
  window), no logit soft-capping, SiLU gate, attention scale head_dim^-0.5 (query_pre_attn_scalar
  = head_dim); Gemma's RMSNorm multiplies by (1 + w), so w - 1 is stored, and it scales the
  embedding output by sqrt(hidden) (an fp32 scalar), so the embedding is stored divided by it.
  Importing applies Gemma's own arithmetic (1 + w, embedding x sqrt(hidden), in fp32), so the
  trainer computes what transformers computes; these two conversions round once in fp32, so only
  they can differ from the source in the last bit after a round trip (every other tensor is moved,
  never computed).
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
- untied embeddings. The trainer's vocabulary is padded to a multiple of 128 rows: the export drops
  the padded rows; the import fills them with copies of the last row, as Megatron's checkpoint
  converter pads a vocabulary.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from typing import TYPE_CHECKING

import torch

from trainer.model.sharding import from_logical_matrices, logical_matrices
from trainer.model.presets import ModelShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
_FUSED = {  # parts named as trainer.model.sharding.logical_matrices names them
    "self_attention.linear_qkv.weight": {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
                                         "v": "self_attn.v_proj.weight"},
    "mlp.linear_fc1.weight": {"gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight"},
}
_QK_NORMS = ("self_attention.q_layernorm", "self_attention.k_layernorm")
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_VOCAB_ROWS = {"embedding.word_embeddings.weight": EMBEDDING, "output_layer.weight": HEAD}
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "paper": "gemma3_text"}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "paper": "Gemma3ForCausalLM"}


def config_class(arch: str) -> type[PretrainedConfig]:
    # transformers is imported only where a configuration is made: the importer's shard writers need none.
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    return {"qwen3": Qwen3Config, "llama": LlamaConfig, "paper": Gemma3TextConfig}[arch]


def hf_config(shape: ModelShape, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    s = shape
    if s.arch == "paper":
        # sliding_window must be set for Gemma3's mask code but is unused: no layer is a sliding one.
        extra = dict(hidden_activation="silu", query_pre_attn_scalar=s.kv_channels, sliding_window=s.seq_length,
                     layer_types=["full_attention"] * s.num_layers, final_logit_softcapping=None,
                     attn_logit_softcapping=None)
    else:
        extra = dict(hidden_act="silu")
    return config_class(s.arch)(
        vocab_size=vocab_size, hidden_size=s.hidden_size, intermediate_size=s.ffn_hidden_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.query_groups, head_dim=s.kv_channels, rms_norm_eps=s.norm_epsilon,
        rope_theta=float(s.rotary_base), max_position_embeddings=s.seq_length, tie_word_embeddings=False,
        attention_bias=False, architectures=[ARCHITECTURES[s.arch]], dtype="float32", **extra, **special_ids)


def megatron_names(shape: ModelShape) -> list[str]:
    """The canonical names (global layer indices) of every parameter of the trainer's model of `shape`."""
    layer_names = _PAPER_LAYER_NAMES if shape.arch == "paper" else _LAYER_NAMES
    local = [n for n in [*layer_names, *_FUSED] if shape.qk_layernorm or not n.startswith(_QK_NORMS)]
    return ["embedding.word_embeddings.weight", *(f"decoder.layers.{i}.{n}" for i in range(shape.num_layers)
                                                  for n in local),
            "decoder.final_layernorm.weight", "output_layer.weight"]


def hf_names(name: str, shape: ModelShape) -> dict[str, str]:
    """The Hugging Face tensor of each logical part (`logical_matrices`' keys) of Megatron parameter `name`."""
    if name in _VOCAB_ROWS:
        return {"": _VOCAB_ROWS[name]}
    if name == "decoder.final_layernorm.weight":
        return {"": "model.norm.weight"}
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    layer_names = _PAPER_LAYER_NAMES if shape.arch == "paper" else _LAYER_NAMES
    if m is not None and m.group(2) in _FUSED:
        return {part: f"model.layers.{m.group(1)}.{hf}" for part, hf in _FUSED[m.group(2)].items()}
    if m is not None and m.group(2) in layer_names:
        return {"": f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"}
    raise KeyError(f"no Hugging Face name for checkpoint parameter {name!r}")


def _gemma_embedding_scale(hidden_size: int) -> torch.Tensor:
    return torch.tensor(hidden_size ** 0.5, dtype=torch.float32)  # as Gemma3TextScaledWordEmbedding holds it


def _to_gemma(hf_name: str, tensor: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """What Gemma3 must store to compute what the trainer computes (see the module docstring)."""
    if hf_name.endswith("norm.weight"):
        return tensor - 1.0
    if hf_name == EMBEDDING:
        return tensor / _gemma_embedding_scale(hidden_size)
    return tensor


def _from_gemma(hf_name: str, tensor: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """What the trainer must hold to compute what Gemma3 computes: its own fp32 arithmetic."""
    if hf_name.endswith("norm.weight"):
        return 1.0 + tensor
    if hf_name == EMBEDDING:
        return tensor * _gemma_embedding_scale(hidden_size)
    return tensor


def hf_tensors(name: str, full: torch.Tensor, shape: ModelShape, vocab_size: int) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors one full (T=1) Megatron parameter becomes (padded vocabulary rows dropped)."""
    if name in _VOCAB_ROWS:
        full = full[:vocab_size]
    names = hf_names(name, shape)
    tensors = {names[part]: t for part, t in logical_matrices(name, full, shape).items()}
    if shape.arch == "paper":
        return {k: _to_gemma(k, t, shape.hidden_size) for k, t in tensors.items()}
    return tensors


def megatron_tensor(name: str, read: Callable[[str], torch.Tensor], shape: ModelShape,
                    padded_vocab_size: int) -> torch.Tensor:
    """The full (T=1) fp32 Megatron parameter `name`, from `read(hf_name)` (Hugging Face tensors)."""
    parts = {}
    for part, hf_name in hf_names(name, shape).items():
        tensor = read(hf_name).float()
        parts[part] = _from_gemma(hf_name, tensor, shape.hidden_size) if shape.arch == "paper" else tensor
    full = from_logical_matrices(name, parts, shape)
    if name in _VOCAB_ROWS and full.shape[0] < padded_vocab_size:
        full = torch.cat([full, full[-1:].expand(padded_vocab_size - full.shape[0], -1)])
    return full
