"""Model shapes and architectures: a CPU-sized `tiny` and the paper's presets (arXiv 2505.23725).

An architecture is the block's form around the same Megatron layers (SwiGLU MLP, RoPE, RMSNorm,
untied embeddings, head dim from the shape):
- `paper`: the MuLoCo paper's model (its torchtitan code): pre- *and* post-norm blocks
  (h = x + norm(attn(norm(x))), out = h + norm(mlp(norm(h)))), QK-norm, attention masked at
  end-of-document tokens, and its initialisation (trainer.model.builder);
- `qwen3`: pre-norm with QK-norm, causal across documents, std-0.02 init;
- `llama`: `qwen3` without QK-norm.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from muloco.core.typed_json import ConfigBlock, setting

Architecture = Literal["paper", "qwen3", "llama"]
ARCHITECTURES = get_args(Architecture)
# Far beyond any model's RoPE base (1e4..1e7 are usual); Megatron raises the base, an int64, to float powers.
ROTARY_BASE_MAX = 10 ** 12


@dataclass(frozen=True)
class ModelShape(ConfigBlock):
    num_layers: int = setting(ge=1, flag="--num-layers", doc="transformer layers")
    hidden_size: int = setting(ge=1, flag="--hidden-size", doc="model width")
    num_attention_heads: int = setting(ge=1, flag="--num-attention-heads", doc="attention heads")
    ffn_hidden_size: int = setting(ge=1, flag="--ffn-hidden-size", doc="the SwiGLU MLP's inner width")
    kv_channels: int = setting(128, ge=1, flag="--kv-channels", doc="head dim")
    num_query_groups: int | None = setting(None, ge=1, flag="--num-query-groups",
                                           doc="None: one group per head (no GQA)")
    arch: Architecture = setting("paper", flag="--arch",
                                 doc="paper (pre+post norms, QK-norm, document-masked attention, the paper's init; "
                                     "the paper presets' default), qwen3 (pre-norm, QK-norm), llama (pre-norm, "
                                     "no QK-norm)")
    rotary_base: int = setting(500_000, ge=1, le=ROTARY_BASE_MAX)
    seq_length: int = setting(2048, ge=1, flag="--seq-length", doc="tokens per sequence")
    # Upper bounds no sane model comes near: a checkpoint's or a Hugging Face config's value is input.
    init_std: float = setting(0.02, gt=0, le=1)
    norm_epsilon: float = setting(1e-6, gt=0, le=1)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def qk_layernorm(self) -> bool:
        return self.arch != "llama"

    @property
    def post_norms(self) -> bool:
        """A norm on each residual branch's output, before the residual add (the paper's blocks)."""
        return self.arch == "paper"

    @property
    def document_masking(self) -> bool:
        """Tokens attend only within their document (block-causal at end-of-document tokens)."""
        return self.arch == "paper"

    def with_overrides(self, **overrides) -> "ModelShape":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS: dict[str, ModelShape] = {
    # Seconds per step on a CPU core; GQA (2 query groups) so the fused QKV's query-group packing is exercised.
    # Qwen3-style by default so the checkpoint tests keep covering the stock-architecture exports;
    # `--arch paper` selects the paper's blocks (tests/test_paper_arch.py).
    "tiny": ModelShape(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=352,
                       kv_channels=32, num_query_groups=2, arch="qwen3", seq_length=128),
    "150m": ModelShape(6, 512, 4, 1408),
    "416m": ModelShape(12, 1024, 8, 2816),
    "914m": ModelShape(18, 1536, 12, 4224),
    "1.76b": ModelShape(24, 2048, 16, 5632),
    "3.1b": ModelShape(30, 2560, 20, 7040),
    "15b": ModelShape(54, 4608, 36, 12672),
}

# What makes a model a preset's; the other fields (attention groups, architecture, RoPE base, sequence
# length, init) have flags that vary a preset.
PRESET_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels")


def preset_of(shape: ModelShape) -> str | None:
    """The preset `shape` is a variant of (a checkpoint's model, for --use-checkpoint-args), or None."""
    return next((name for name, preset in PRESETS.items()
                 if all(getattr(preset, f) == getattr(shape, f) for f in PRESET_SIZES)), None)


def parameter_count(shape: ModelShape, vocab_size: int) -> int:
    """Parameters of the whole model: per layer Q, K, V and output projections, SwiGLU (gate, up,
    down), the pre-norms (and the paper's post-norms) and QK-norms; untied embedding and head; the
    final norm. tests/test_plan.py checks it against the built Megatron model."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    attention = h * d * (shape.num_attention_heads + 2 * shape.query_groups) + shape.num_attention_heads * d * h
    norms = 2 * h * (2 if shape.post_norms else 1) + (2 * d if shape.qk_layernorm else 0)
    return shape.num_layers * (attention + 3 * h * f + norms) + 2 * vocab_size * h + h
