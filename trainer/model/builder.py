"""Builds the Megatron-core GPTModel (the paper's blocks, or Qwen3/Llama style; see
trainer.model.presets) for this rank's TP/PP shard, with initial weights that are identical, as full
tensors, at every TP and PP size for a given seed."""
from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig

from trainer.model.attention import SDPAttention
from trainer.model.sharding import from_logical_matrices, full_shape, sharding_of, logical_matrices, shard
from trainer.model.paper_spec import layer_spec
from trainer.model.presets import ModelShape
from trainer.model.stages import uneven_stage_sizes

VOCAB_PADDING = 128  # padded vocab must not depend on T, so that weights match across TP degrees


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tensor_parallel:
        raise ValueError(f"padded vocabulary {padded} is not divisible by tensor-model-parallel-size {tensor_parallel}")
    return padded


def transformer_config(shape: ModelShape, tensor: int, pipeline: int, bf16_autocast: bool) -> TransformerConfig:
    first_stage_layers, last_stage_layers = uneven_stage_sizes(shape.num_layers, pipeline)
    return TransformerConfig(
        num_layers=shape.num_layers,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        kv_channels=shape.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        qk_layernorm=shape.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        params_dtype=torch.float32,  # master weights; bf16 compute comes from autocast
        # Activations cross pipeline stages in bf16 under autocast (as in Megatron's bf16 runs): half the
        # bytes; see build_model for the cast at the sending end.
        pipeline_dtype=torch.bfloat16 if bf16_autocast else torch.float32,
        enable_autocast=bf16_autocast,
        autocast_dtype=torch.bfloat16 if bf16_autocast else None,
        use_cpu_initialization=True,
        perform_initialization=False,  # we initialize from full tensors, see initialize_weights
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        init_method_std=shape.init_std,
    )


def _layer_spec(shape: ModelShape):
    """The local layer spec of `shape.arch` with fused attention (PyTorch SDPA) as its core attention."""
    spec = layer_spec(shape)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(shape: ModelShape, vocab_size: int, bf16_autocast: bool = False) -> GPTModel:
    """This rank's stage of the model (fp32 parameters); call after Megatron's groups exist."""
    tensor = mps.get_tensor_model_parallel_world_size()
    pipeline = mps.get_pipeline_model_parallel_world_size()
    config = transformer_config(shape, tensor, pipeline, bf16_autocast)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(shape),
        vocab_size=vocab_size,
        max_sequence_length=shape.seq_length,
        pre_process=mps.is_pipeline_first_stage(),
        post_process=mps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
        parallel_output=True,
    )
    if bf16_autocast and not mps.is_pipeline_last_stage():
        # The residual stream leaves a stage in fp32 (fp32 parameters under autocast); Megatron's p2p
        # buffers are `pipeline_dtype`, so the sending stage casts its output.
        # (`config.pipeline_dtype` read at each call: the checkpoint's fp32 probe switches it off.)
        model.register_forward_hook(lambda module, args, output: output.to(config.pipeline_dtype))
    return model


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name with the *global* layer index, the same at every PP size."""
    offsets = {}
    for module_name, module in model.named_modules():
        m = re.fullmatch(r"(.*decoder\.layers)\.(\d+)", module_name)
        if m and hasattr(module, "layer_number"):
            offsets[module_name] = f"{m.group(1)}.{module.layer_number - 1}"
    names = {}
    for name, _ in model.named_parameters():
        canonical = name
        m = re.match(r"(.*decoder\.layers\.\d+)(\..*)", name)
        if m:
            canonical = offsets[m.group(1)] + m.group(2)
        names[name] = canonical
    return names


def _init_std(canonical: str, shape: ModelShape) -> float:
    # Output projections of residual branches are scaled down with depth (GPT-2 / Megatron practice).
    if canonical.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return shape.init_std / math.sqrt(2.0 * shape.num_layers)
    return shape.init_std


def _generator(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))


def _paper_initial_tensor(canonical: str, full: tuple[int, ...], shape: ModelShape, seed: int) -> torch.Tensor:
    """The paper's initialisation (its torchtitan Llama-3 code with depth-scaled init): embedding
    N(0, 1); Q, K, V and the gate (w1) truncated-normal std 0.02; the attention output (wo), the up
    (w3) and down (w2) projections std 0.02 / sqrt(2 (layer + 1)); the head std hidden^-0.5 cut at
    +-3 std. Fused weights get one draw per logical matrix, so the value does not depend on how
    the fused rows are laid out."""
    if canonical.endswith("word_embeddings.weight"):
        return torch.empty(full).normal_(0.0, 1.0, generator=_generator(seed, canonical))
    if canonical.endswith("output_layer.weight"):
        std = shape.hidden_size ** -0.5
        return torch.nn.init.trunc_normal_(torch.empty(full), 0.0, std, -3 * std, 3 * std,
                                           generator=_generator(seed, canonical))
    layer = int(re.search(r"layers\.(\d+)\.", canonical).group(1))
    depth_std = shape.init_std / math.sqrt(2.0 * (layer + 1))
    parts = {}
    for part, meta in logical_matrices(canonical, torch.empty(full, device="meta"), shape).items():
        depth_scaled = (canonical.endswith(("linear_proj.weight", "linear_fc2.weight"))
                        or (canonical.endswith("linear_fc1.weight") and part == "up"))
        std = depth_std if depth_scaled else shape.init_std
        # torchtitan's trunc_normal_ bounds are absolute (+-2), i.e. no truncation at std 0.02.
        parts[part] = torch.nn.init.trunc_normal_(torch.empty(meta.shape), 0.0, std, -2.0, 2.0,
                                                  generator=_generator(seed, f"{canonical}:{part}"))
    return from_logical_matrices(canonical, parts, shape)


def full_initial_tensor(canonical: str, full: tuple[int, ...], shape: ModelShape, seed: int) -> torch.Tensor:
    """The T=1 initial value of one parameter, from (seed, global name) only."""
    if canonical.endswith("norm.weight"):
        return torch.ones(full)
    if shape.arch == "paper":
        return _paper_initial_tensor(canonical, full, shape, seed)
    return torch.empty(full).normal_(0.0, _init_std(canonical, shape), generator=_generator(seed, canonical))


def tag_parameters(model: torch.nn.Module) -> None:
    """Set Megatron's own parameter attributes (its layers set them only when they initialize
    weights themselves): the tensor-parallel split, and the embedding/output flag that Megatron's
    optimizers use to keep those matrices out of Muon."""
    for name, param in model.named_parameters():
        sharding = sharding_of(name)
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, sharding.partition_dim is not None,
                                                 -1 if sharding.partition_dim is None else sharding.partition_dim, 1)
        param.is_embedding_or_output_parameter = name.endswith(("word_embeddings.weight", "output_layer.weight"))


@torch.no_grad()
def assign_full_weights(model: torch.nn.Module, full_of: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """Set every parameter to this TP rank's shard of `full_of(canonical name, full shape)`, its T=1 value
    (initial weights, or weights loaded from a checkpoint of any parallel layout)."""
    tp_rank = mps.get_tensor_model_parallel_rank()
    tp_size = mps.get_tensor_model_parallel_world_size()
    names = canonical_names(model)
    for name, param in model.named_parameters():
        sharding = sharding_of(name)
        param.copy_(shard(full_of(names[name], full_shape(tuple(param.shape), sharding, tp_size)), sharding, tp_rank, tp_size))


def initialize_weights(model: torch.nn.Module, shape: ModelShape, seed: int) -> None:
    assign_full_weights(model, lambda name, full: full_initial_tensor(name, full, shape, seed))
    tag_parameters(model)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters this rank holds, of which replicated across TP) for the global count."""
    total = replicated = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if sharding_of(name).partition_dim is None:
            replicated += p.numel()
    return total, replicated
