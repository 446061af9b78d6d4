"""The model's core attention (PyTorch SDPA) computes what Megatron's own DotProductAttention does:
causal softmax attention with grouped query heads, forward and backward."""
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from trainer.model.attention import SDPAttention
from trainer.model.builder import transformer_config
from trainer.model.presets import PRESETS
from megatron_world import megatron_world_of_one


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


def _tokens_with_documents(b: int, s: int, eod: int, g: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(1, 50, (b, s), generator=g)
    tokens[tokens % 7 == 0] = eod  # about one token in seven ends a document
    tokens[0, 0], tokens[-1, -1] = eod, eod  # at either end too
    return tokens


def test_document_mask_built_from_document_ids_is_megatrons_gptdataset_mask():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from trainer.data import document_ids
    from trainer.model.attention import document_causal_mask

    eod, g = 0, torch.Generator().manual_seed(0)
    tokens = _tokens_with_documents(3, 64, eod, g)
    megatron = torch.stack([_get_ltor_masks_and_position_ids(row, eod, True, True, False, True)[0] for row in tokens])
    # Megatron's mask is True where attention is masked out; ours where it is allowed (SDPA's sense).
    assert torch.equal(document_causal_mask(document_ids(tokens, eod)), ~megatron)


def test_document_masked_attention_is_causal_attention_within_each_document():
    """The reference: each document's tokens through plain causal attention on their own."""
    from trainer.data import document_ids

    shape = PRESETS["tiny"]
    with megatron_world_of_one():
        config = transformer_config(shape, 1, 1, bf16_autocast=False)
        attention = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self")
        eod, g = 0, torch.Generator().manual_seed(1)
        s, b, hd = 48, 2, shape.kv_channels
        tokens = _tokens_with_documents(b, s, eod, g)
        q = torch.randn(s, b, shape.num_attention_heads, hd, generator=g)
        k, v = (torch.randn(s, b, shape.query_groups, hd, generator=g) for _ in range(2))
        ids = document_ids(tokens, eod)
        out = attention(q, k, v, ids)
        for row in range(b):
            for doc in ids[row].unique():
                at = (ids[row] == doc).nonzero().flatten()
                piece = attention(q[at, row:row + 1], k[at, row:row + 1], v[at, row:row + 1], None)
                torch.testing.assert_close(out[at, row:row + 1], piece, rtol=1e-5, atol=1e-5)
