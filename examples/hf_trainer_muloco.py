"""MuLoCo in Hugging Face's Trainer with its DeepSpeed integration: a `transformers` Llama built from a
config (random init, nothing downloaded), trained by `Trainer.train()` on synthetic tokens, with the
outer loop attached by muloco/hook/hf_trainer.py.

    deepspeed --num_gpus 4 examples/hf_trainer_muloco.py --workers 2 --steps 12 --sync-interval 3

(on CPU: DeepSpeed's CPU accelerator and gloo; set OMP_NUM_THREADS=1 with several ranks per core). Each
worker writes the Trainer's checkpoints into OUTPUT/worker_<k>/ every --save-steps; `--resume` goes on
from the newest. Last, the first rank of every worker prints one JSON line: its worker, the outer steps
taken and `global_weights_sha256` (equal on every worker when they agree).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
from transformers import Trainer, TrainingArguments

import muloco
from deepspeed_muloco import COMPRESSION, llama, markov_batches  # the plain DeepSpeed example, beside this one
from muloco.hook.hf_trainer import attach_to_trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="K datacenters (the world splits into K x D ranks)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sync-interval", type=int, default=3, help="H inner steps between outer syncs")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--compression", choices=sorted(COMPRESSION), default="4bit-ef")
    p.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint every N steps (0: none)")
    p.add_argument("--output", default="runs/hf_trainer_muloco", help="each worker's checkpoints in OUTPUT/worker_<k>")
    p.add_argument("--resume", action="store_true", help="go on from each worker's newest checkpoint")
    p.add_argument("--key-file", default=os.environ.get("MULOCO_AUTH_KEY_FILE"),
                   help="the job secret (python -m muloco.diloco.auth new-key FILE)")
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    return p.parse_args(argv)


class MarkovTokens(torch.utils.data.Dataset):
    """Sample i: a Markov-chain sequence of its own seed (the Trainer's sampler spreads them over ranks)."""

    def __init__(self, samples: int, vocab: int = 128, seq_length: int = 16):
        self.samples, self.vocab, self.seq_length = samples, vocab, seq_length

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict:
        tokens = next(markov_batches(self.vocab, self.seq_length, 1, seed=i))[0]
        return {"input_ids": tokens, "labels": tokens}


def ds_config(args: argparse.Namespace) -> dict:
    key = {"key_file": Path(args.key_file).name} if args.key_file else "none"  # relative to the key's folder
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
            "zero_optimization": {"stage": args.zero_stage}, "gradient_clipping": "auto", "steps_per_print": 10**9,
            "muloco": {"workers": args.workers, "sync_interval": args.sync_interval, "outer_lr": 0.7,
                       "outer_momentum": 0.6, "compression": COMPRESSION[args.compression], "auth": key}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    workers = muloco.data_parallel_workers(args.workers)
    config = ds_config(args)
    training = TrainingArguments(output_dir=f"{args.output}/worker_{workers.worker}", deepspeed=config,
                                 max_steps=args.steps, per_device_train_batch_size=2, learning_rate=3e-3,
                                 adam_beta2=0.95, weight_decay=0.0, lr_scheduler_type="constant",
                                 save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 1,
                                 logging_steps=10**9, report_to=[], use_cpu=not torch.cuda.is_available(),
                                 dataloader_num_workers=0, seed=0, data_seed=0)
    samples = args.steps * workers.data_size * 2
    trainer = Trainer(model=llama(128, 16), args=training, train_dataset=MarkovTokens(samples))
    callback = attach_to_trainer(trainer, config["muloco"], workers,
                                 config_dir=Path(args.key_file).parent if args.key_file else None)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    checksum = callback.outer.global_weights_sha256()
    if workers.topology.coords.data == 0:
        print(json.dumps({"worker": workers.worker, "outer_steps": callback.outer.outer_step,
                          "global_weights_sha256": checksum}), flush=True)


if __name__ == "__main__":
    main()
