"""Core attention through PyTorch's scaled_dot_product_attention, for Megatron's local layer spec.

Megatron's local `DotProductAttention` materialises the [b, heads, s, s] score matrix (and repeats the
keys and values of each query group); SDPA runs fused kernels instead (FlashAttention or the
memory-efficient kernel on GPUs, in bf16 under autocast) with the same math: causal softmax of
q k^T / sqrt(head dim), grouped-query attention without copies. With document masking (the paper's
block-causal attention) the mask is built here, on the compute device, from the tokens' document ids
(FlexAttention's block masks would skip the masked blocks' work, but need torch.compile). Transformer Engine's spec would do
the same on GPUs but is an optional install; this module needs only torch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] boolean, True where query i may attend key j: j <= i in the same document. Built
    where the ids are (the compute device), from b x s ids instead of a host tensor per sample."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)


class SDPAttention(MegatronModule):
    """Megatron's core-attention interface: [s, b, heads, head_dim] query/key/value -> [s, b, heads*head_dim]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **unused):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention is causal self-attention only, got mask type {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes no attention bias or packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, head_dim]
        # Document masking hands the tokens' [b, s] document ids (trainer.data.document_ids) in
        # Megatron's attention_mask argument. Without them: the fused causal kernels.
        masking = {"is_causal": True} if attention_mask is None else {"attn_mask": document_causal_mask(attention_mask)}
        out = F.scaled_dot_product_attention(q, k, v, **masking, scale=self.scale,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             enable_gqa=q.shape[1] != k.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
