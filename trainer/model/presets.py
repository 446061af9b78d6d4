"""Model shapes: a CPU-sized `tiny` and the paper's presets (arXiv 2505.23725)."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    kv_channels: int = 128  # head dim
    num_query_groups: int | None = None  # None = one group per head (no GQA)
    qk_layernorm: bool = True
    rotary_base: int = 500_000
    seq_length: int = 2048
    init_std: float = 0.02
    norm_epsilon: float = 1e-6

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def with_overrides(self, **overrides) -> "ModelShape":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS: dict[str, ModelShape] = {
    # Seconds per step on a CPU core; GQA (2 query groups) so the fused-QKV layout is exercised.
    "tiny": ModelShape(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=352,
                       kv_channels=32, num_query_groups=2, seq_length=128),
    "150m": ModelShape(6, 512, 4, 1408),
    "416m": ModelShape(12, 1024, 8, 2816),
    "914m": ModelShape(18, 1536, 12, 4224),
    "1.76b": ModelShape(24, 2048, 16, 5632),
    "3.1b": ModelShape(30, 2560, 20, 7040),
    "15b": ModelShape(54, 4608, 36, 12672),
}
