"""The paper's transformer block on Megatron-core's local layer spec: pre- *and* post-norm,
    h   = x + post_self_attn_layernorm(attention(input_layernorm(x)))
    out = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))
(torchtitan's "pa_pf" blocks in the MuLoCo code). Megatron's TransformerLayer already has the
pre-norms; the post-norms sit between each branch and its residual add, which in Megatron is the
layer's bias-dropout-add, so the subclass wraps those two functions and leaves the rest of the
layer (attention, MLP, tensor/pipeline parallelism) untouched. The new norms are 1-D, replicated
across TP ranks and named `*layernorm.weight`, so the optimizer routing (AdamW), the TP sharding
(replicated) and the outer loop treat them as they treat the other norms.
"""
from __future__ import annotations

from dataclasses import replace

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer

from trainer.model.presets import ModelShape


def _post_normed(norm, bias_dropout_add):
    """Megatron's bias-dropout-add factory (training, fused) -> f(x_with_bias, residual, p), with
    `norm` applied to the branch output before the residual add."""
    def factory(training: bool, fused: bool):
        add = bias_dropout_add(training, fused)

        def apply(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:  # the trainer's linears have no bias (add_bias_linear=False)
                x = x + bias
            return add((norm(x), None), residual, prob)
        return apply
    return factory


class PrePostNormTransformerLayer(TransformerLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        norm = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.input_layernorm, **norm)
        self.post_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm)
        self.self_attn_bda = _post_normed(self.post_self_attn_layernorm, self.self_attn_bda)
        self.mlp_bda = _post_normed(self.post_mlp_layernorm, self.mlp_bda)


def layer_spec(shape: ModelShape) -> ModuleSpec:
    """The local (no Transformer Engine) layer spec of `shape.arch`."""
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    if shape.post_norms:
        spec = replace(spec, module=PrePostNormTransformerLayer)
    return spec
