"""The model's core attention (PyTorch SDPA) computes what Megatron's own DotProductAttention does:
causal softmax attention with grouped query heads, forward and backward."""
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from trainer.model.attention import SDPAttention
from trainer.model.builder import transformer_config
from trainer.model.presets import PRESETS
from trainer_harness import megatron_world_of_one


def test_sdpa_matches_megatron_dot_product_attention_with_gqa():
    shape = PRESETS["tiny"]  # 4 heads in 2 query groups, head dim 32
    with megatron_world_of_one():
        config = transformer_config(shape, 1, 1, bf16_autocast=False)
        kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        ours, megatron = SDPAttention(**kwargs), DotProductAttention(**kwargs)
        g = torch.Generator().manual_seed(0)
        s, b, hd = 16, 2, shape.kv_channels
        q = torch.randn(s, b, shape.num_attention_heads, hd, generator=g, requires_grad=True)
        k = torch.randn(s, b, shape.query_groups, hd, generator=g, requires_grad=True)
        v = torch.randn(s, b, shape.query_groups, hd, generator=g, requires_grad=True)
        out = ours(q, k, v, None)
        expected = megatron(q, k, v, None)
        assert out.shape == expected.shape == (s, b, shape.num_attention_heads * hd)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        weights = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
        for a, e in zip(grads, expected_grads):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
