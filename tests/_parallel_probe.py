"""Launched by test_parallel_equivalence on every rank:

    deepspeed --num_gpus N tests/_parallel_probe.py RUN_ROOT [pretrain.py flags, no --ds_config/--run-dir]

For each inner optimizer (muon, adamw) it assembles a run exactly as trainer/run.py does, then
records on global rank 0, into RUN_ROOT/OPTIMIZER/probe.pt, the full model (every parameter in its
T=1 form under its global name, gathered over TP and PP) before training and after each of
--train-iters optimizer steps, with each step's loss and gradient norm.
"""
from __future__ import annotations

import argparse
from pathlib import Path


import torch
import torch.distributed as dist
from megatron.core import parallel_state as mps

from tools.trainer_runs import DS_CONFIGS, init_distributed, run_trainer
from muloco.core.comm import close_distributed
from trainer.model.builder import canonical_names
from trainer.model.sharding import Split, sharding_of, unshard
from trainer.training import Trainer


@torch.no_grad()
def full_weights(model: torch.nn.Module) -> dict | None:
    """On global rank 0: {"weights": {global name: full tensor}, "replica_gap": largest difference
    between copies that must be identical (inner-DP replicas, TP-replicated norms)}; None elsewhere."""
    tp_group, tp = mps.get_tensor_model_parallel_group(), mps.get_tensor_model_parallel_world_size()
    names = canonical_names(model)
    local, gap = {}, 0.0
    for name, p in model.named_parameters():
        shards = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(shards, p.detach().contiguous(), group=tp_group)
        sharding = sharding_of(name)
        if sharding.split is Split.REPLICATED:
            gap = max([gap] + [float((s - shards[0]).abs().max()) for s in shards])
        local[names[name]] = unshard(shards, sharding)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((local, gap), gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for weights, rank_gap in gathered:
        gap = max(gap, rank_gap)
        for name, tensor in weights.items():
            if name in merged:
                gap = max(gap, float((tensor - merged[name]).abs().max()))
            else:
                merged[name] = tensor
    return {"weights": merged, "replica_gap": gap}


class RecordingTrainer(Trainer):
    """Trains --train-iters steps like Trainer.train, recording the full model around each one."""

    def train(self) -> dict:
        record = {"initial": full_weights(self.model), "steps": []}
        while self.step < self.config.schedule.train_iters:
            result = self.train_step()
            loss = self._mean_over_loss_ranks(result.loss, 1, group=None)  # as Trainer.train logs it
            record["steps"].append({"loss": loss, "grad_norm": result.grad_norm, "model": full_weights(self.model)})
        if dist.get_rank() == 0:
            torch.save(record, Path(self.config.run_dir) / "probe.pt")
        return {"steps": self.step, "val_loss": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_root")
    args, pretrain_flags = parser.parse_known_args()  # the rest, with the launcher's --local_rank
    init_distributed()
    for optimizer in ("muon", "adamw"):
        run_dir = Path(args.run_root) / optimizer
        run_trainer(["--ds_config", str(DS_CONFIGS[optimizer]), "--run-dir", str(run_dir), *pretrain_flags],
                    RecordingTrainer)
    close_distributed()


if __name__ == "__main__":
    main()
