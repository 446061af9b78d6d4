"""MuLoCo in a plain DeepSpeed training loop: a Hugging Face Llama built from a config (random init,
nothing downloaded), trained on synthetic tokens by `deepspeed.initialize` + forward/backward/step,
with the outer loop attached by muloco/hook/.

    deepspeed --num_gpus 4 examples/deepspeed_muloco.py --workers 2 --zero-stage 1 --sync-interval 5 --steps 30

(on CPU: DeepSpeed's CPU accelerator and gloo; set OMP_NUM_THREADS=1 with several ranks per core).
Every sync's record is printed by rank 0 ("outer {...}"); last, the first rank of every worker prints
one JSON line: its worker's loss at each step (the mean over its ranks), the outer steps taken and
`global_weights_sha256`, a checksum of the worker's global weights (equal on every worker when they
agree). The tokens are a learnable Markov chain, a different stream on every rank, drawn by step.

Checkpoints: `--save DIR --save-at N` saves DeepSpeed's files and the outer state at step N and goes on;
`--stop-at N` exits right after step N without the final sync, as a crash would; `--load DIR` resumes
from the newest checkpoint in DIR (the same command line otherwise): the resumed run's losses and global
weights are those of the run that was not stopped.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from muloco import attach, data_parallel_workers

COMPRESSION = {"none": {"method": "none"},
               "4bit-ef": {"method": "statistical", "bits": 4, "error_feedback": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="K datacenters (the world splits into K x D ranks)")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--sync-interval", type=int, default=5, help="H inner steps between outer syncs")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.6)
    p.add_argument("--compression", choices=sorted(COMPRESSION), default="4bit-ef")
    p.add_argument("--inner", choices=("adamw", "muon"), default="adamw")
    p.add_argument("--lr", type=float, default=None, help="inner lr (default: 3e-3 AdamW, 2e-2 Muon)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--bf16", action="store_true", help="bf16 weights (DeepSpeed keeps fp32 master partitions)")
    p.add_argument("--key-file", default=os.environ.get("MULOCO_AUTH_KEY_FILE"),
                   help="the job secret (python -m muloco.diloco.auth new-key FILE); without one the workers' "
                        "messages are not authenticated")
    p.add_argument("--save", help="checkpoint folder (the K workers' files in DIR/worker_<k>/)")
    p.add_argument("--save-at", type=int, help="save after this step and go on")
    p.add_argument("--stop-at", type=int, help="exit right after this step, without the final sync (a crash)")
    p.add_argument("--load", help="resume from the newest checkpoint in this folder")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    return p.parse_args(argv)


def llama(vocab: int, seq_length: int) -> LlamaForCausalLM:
    """A small Llama, identical on every rank (the same seed)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_length,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    hidden = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - {id(model.lm_head.weight)}
    for p in model.parameters():  # DeepSpeed's Muon: hidden matrices; AdamW for embeddings, head and norms
        p.use_muon = id(p) in hidden
    return model


def markov_batches(vocab: int, seq_length: int, batch: int, seed: int):
    """Token sequences whose next token is a fixed successor, except with probability 0.1."""
    successor = torch.randint(1, vocab, (vocab,), generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.empty(batch, seq_length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        for i in range(1, seq_length):
            noise = torch.rand(batch, generator=generator) < 0.1
            tokens[:, i] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=generator),
                                       successor[tokens[:, i - 1]])
        yield tokens


def ds_config(args: argparse.Namespace) -> dict:
    lr = args.lr or (2e-2 if args.inner == "muon" else 3e-3)
    optimizer = ({"type": "Muon", "params": {"muon_lr": lr, "momentum": 0.95, "adam_lr": 3e-3, "betas": [0.9, 0.95],
                                             "weight_decay": 0.0}}
                 if args.inner == "muon" else
                 {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0}})
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": optimizer, "zero_optimization": {"stage": args.zero_stage},
            "bf16": {"enabled": args.bf16}, "gradient_clipping": 0.0, "steps_per_print": 10**9}


def muloco_block(args: argparse.Namespace) -> dict:
    key = {"key_file": Path(args.key_file).name} if args.key_file else "none"
    return {"workers": args.workers, "sync_interval": args.sync_interval, "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum, "compression": COMPRESSION[args.compression], "auth": key}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.save_at is not None and not args.save:
        raise SystemExit("--save-at needs --save DIR")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    workers = data_parallel_workers(args.workers)
    engine, *_ = deepspeed.initialize(model=llama(args.vocab, args.seq_length), config=ds_config(args),
                                      mpu=workers.mpu)
    outer = attach(engine, muloco_block(args), workers, last_step=args.steps,
                   config_dir=Path(args.key_file).parent if args.key_file else ".")
    if args.load:
        outer.load_checkpoint(args.load)
    batches = markov_batches(args.vocab, args.seq_length, args.micro_batch, seed=dist.get_rank())
    for _ in range(engine.global_steps):  # the data stream follows the step
        next(batches)
    losses = []
    while engine.global_steps < args.steps:
        tokens = next(batches).to(engine.device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=workers.topology.inner_dp_group)
        losses.append(round(float(mean) / workers.topology.sizes.data, 6))
        if engine.global_steps == args.save_at:
            outer.save_checkpoint(args.save)
        if engine.global_steps == args.stop_at:
            if workers.topology.coords.data == 0:
                print(json.dumps({"worker": workers.topology.coords.worker, "losses": losses,
                                  "stopped_at": args.stop_at}), flush=True)
            os._exit(0)  # as a crash would: no final sync, no clean-up
    outer.detach()
    checksum = outer.global_weights_sha256()
    if workers.topology.coords.data == 0:
        print(json.dumps({"worker": workers.topology.coords.worker, "losses": losses, "outer_steps": outer.outer_step,
                          "global_weights_sha256": checksum}), flush=True)


if __name__ == "__main__":
    main()
