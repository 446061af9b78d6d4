"""MuLoCo in a plain DeepSpeed loop over a Megatron-core GPT with tensor and pipeline parallelism: the
model built by megatron-core for this rank's shard, trained by Megatron's own schedules under
`deepspeed.initialize` (not this project's trainer), with the outer loop attached by muloco/hook/.

    deepspeed --num_gpus 4 examples/megatron_muloco.py --workers 2 --tensor-parallel 2 --steps 30 --sync-interval 5
    deepspeed --num_gpus 4 examples/megatron_muloco.py --workers 2 --pipeline-parallel 2 --steps 30 --sync-interval 5

(on CPU: DeepSpeed's CPU accelerator and gloo, with megatron_patches' shims; set OMP_NUM_THREADS=1 with
several ranks per core). The world is K workers x D x P x T ranks, the worker slowest (Megatron's
groups in "tp-pp-dp" order); DeepSpeed's data parallelism stays inside a worker and each rank syncs
its own shard with the same shard in the other workers. Every rank prints one JSON line at the end:
its place (worker, data, pipeline, tensor), its replica's losses (last stage), the outer steps taken and
`global_weights_sha256`, a checksum of its shard's global weights (equal on every worker for the same
shard). The weights start from full tensors drawn by parameter name and cut into this rank's shard,
so the model is the same at every T and P.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import zlib
from pathlib import Path

import deepspeed
import torch
from megatron.core import parallel_state as mps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from muloco import attach, data_parallel_workers

COMPRESSION = {"none": {"method": "none"},
               "4bit-ef": {"method": "statistical", "bits": 4, "error_feedback": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="K datacenters (the world splits into K x D x P x T ranks)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="T")
    p.add_argument("--pipeline-parallel", type=int, default=1, help="P")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1))
    p.add_argument("--sync-interval", type=int, default=5, help="H inner steps between outer syncs")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.6)
    p.add_argument("--compression", choices=sorted(COMPRESSION), default="4bit-ef")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW lr")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2, help="per step (gradient accumulation; the pipeline's)")
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--key-file", default=os.environ.get("MULOCO_AUTH_KEY_FILE"),
                   help="the job secret (python -m muloco.diloco.auth new-key FILE); without one the workers' "
                        "messages are not authenticated")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    return p.parse_args(argv)


def initialize_model_parallel(tensor: int, pipeline: int) -> None:
    """Megatron's groups in "tp-pp-dp" order (the workers are then contiguous blocks of ranks), after
    torch.distributed; on a machine without an accelerator, megatron-core's CPU shims first."""
    if not torch.cuda.is_available():
        from megatron_patches import apply_cpu_shims_if_needed
        apply_cpu_shims_if_needed()
    mps.initialize_model_parallel(tensor, pipeline, order="tp-pp-dp")
    model_parallel_cuda_manual_seed(0)


def gpt(vocab: int, seq_length: int, hidden: int, layers: int) -> GPTModel:
    """This rank's stage and tensor shard of a small GPT (RoPE, LayerNorm, GELU MLP, no biases, untied
    head), its weights cut from full tensors drawn by global parameter name (`full_tensor`). Megatron
    initializes them first: its layers mark their tensor-parallel split only when they do."""
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, params_dtype=torch.float32, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq_length, pre_process=mps.is_pipeline_first_stage(),
                     post_process=mps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    names = global_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(local_shard(full_tensor(names[name], full_shape(p)), p))
    return model


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name on this stage -> its name in the whole model (layers numbered globally)."""
    offsets = {name: f"{m.group(1)}.{module.layer_number - 1}" for name, module in model.named_modules()
               if (m := re.fullmatch(r"(.*decoder\.layers)\.\d+", name)) and hasattr(module, "layer_number")}
    names = {}
    for name, _ in model.named_parameters():
        m = re.match(r"(.*decoder\.layers\.\d+)(\..*)", name)
        names[name] = offsets[m.group(1)] + m.group(2) if m else name
    return names


def _split_dim(p: torch.nn.Parameter) -> int | None:
    return p.partition_dim if getattr(p, "tensor_model_parallel", False) else None


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    shape, dim = list(p.shape), _split_dim(p)
    if dim is not None:
        shape[dim] *= mps.get_tensor_model_parallel_world_size()
    return tuple(shape)


def local_shard(full: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """This tensor rank's contiguous slice of a full tensor (Megatron's packing: a fused QKV weight is
    grouped by query group, so the query groups split across ranks)."""
    dim = _split_dim(p)
    if dim is None:
        return full
    return full.chunk(mps.get_tensor_model_parallel_world_size(), dim)[mps.get_tensor_model_parallel_rank()]


def full_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole parameter, the same on every rank and at every T and P: norms start at one (weights)
    and zero (biases), matrices and embeddings at N(0, 0.02) from a generator seeded by the name."""
    if len(shape) == 1:
        return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * 0.02


def markov_batches(vocab: int, seq_length: int, batch: int, seed: int):
    """Token sequences of seq_length + 1 whose next token is a fixed successor, except with probability 0.1."""
    successor = torch.randint(1, vocab, (vocab,), generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.empty(batch, seq_length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        for i in range(1, seq_length + 1):
            noise = torch.rand(batch, generator=generator) < 0.1
            tokens[:, i] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=generator),
                                       successor[tokens[:, i - 1]])
        yield tokens


def _loss(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach().clone()}  # a copy: the schedule divides the loss in place


def forward_step(data_iterator, model):
    """Megatron's forward step: next-token cross-entropy per token on the last stage, the hidden
    states on the others (the first stage reads the tokens, the last the labels)."""
    tokens = next(data_iterator).to(next(model.parameters()).device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    return model(inputs, positions, None, labels=labels), _loss


def ds_config(args: argparse.Namespace) -> dict:
    """Megatron's schedules run the micro-batches and call backward themselves: step() is the
    accumulation boundary (managed_gradient_accumulation false), where DeepSpeed reduces the gradients."""
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.micro_batches,
            "managed_gradient_accumulation": False,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
            "zero_optimization": {"stage": args.zero_stage}, "gradient_clipping": 0.0, "steps_per_print": 10**9}


def muloco_block(args: argparse.Namespace) -> dict:
    key = {"key_file": Path(args.key_file).name} if args.key_file else "none"
    return {"workers": args.workers, "sync_interval": args.sync_interval, "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum, "compression": COMPRESSION[args.compression], "auth": key}


def train_step(engine, batches, args: argparse.Namespace) -> float | None:
    """One optimizer step: Megatron's schedule over the micro-batches (the pipeline's 1F1B at P > 1),
    then the engine's step; the mean loss on the last stage."""
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=[engine.module],
        num_microbatches=args.micro_batches, seq_length=args.seq_length, micro_batch_size=args.micro_batch)
    engine.step()
    return float(torch.stack([o["lm loss"] for o in outputs]).mean()) if mps.is_pipeline_last_stage() else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    initialize_model_parallel(args.tensor_parallel, args.pipeline_parallel)
    workers = data_parallel_workers(args.workers, mps)
    model = gpt(args.vocab, args.seq_length, args.hidden, args.layers)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args),
                                      mpu=workers.mpu)
    outer = attach(engine, muloco_block(args), workers, last_step=args.steps,
                   config_dir=Path(args.key_file).parent if args.key_file else ".")
    c, sizes = workers.topology.coords, workers.topology.sizes
    batches = markov_batches(args.vocab, args.seq_length, args.micro_batch, seed=c.worker * sizes.data + c.data)
    losses = [train_step(engine, batches, args) for _ in range(args.steps)]
    outer.detach()
    checksum = outer.global_weights_sha256()
    print(json.dumps({"worker": c.worker, "data": c.data, "pipeline": c.pipeline, "tensor": c.tensor,
                      "losses": [round(x, 6) for x in losses] if losses[-1] is not None else None,
                      "outer_steps": outer.outer_step, "global_weights_sha256": checksum}), flush=True)


if __name__ == "__main__":
    main()
