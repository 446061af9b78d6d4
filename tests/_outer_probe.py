"""Runs several short trainings, one after another in one torchrun launch (start-up dominates on CPU),
each assembled exactly as trainer/pretrain.py assembles it, and dumps what tests/test_outer_loop.py
compares: per-step losses and weight shards at the start, around every applied outer sync, and at the end.

    deepspeed --num_gpus N tests/_outer_probe.py CASES.json OUT_DIR

CASES.json is a list of cases:
    {"name": str, "ds_config": {...}, "args": [pretrain flags],
     "read_as_worker_of": K,          (optional) a K=1 run reads worker 0's slice of a K-worker stream
     "poison": {"worker": k, "tensor_rank": t, "at": {"STEP": "nan" | "outlier"}}}
                                      (optional) corrupt worker k's weights (only on tensor rank t,
                                      if given) after inner step STEP, just before the outer hook sees them
Each rank writes OUT_DIR/NAME/rank<R>.pt: {rank, coords, sizes, losses {step: loss} (last stage only),
snapshots {"init", "pre@S", "post@S" for every step S whose outer hook applied or skipped a sync, "final"}};
the run's own files (metrics.jsonl, ...) are in OUT_DIR/NAME/run.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path


import torch
import torch.distributed as dist

from tests._probe_common import rank_identity, shard_state
from tools.trainer_runs import init_distributed, run_trainer
from muloco.core.comm import close_distributed
from trainer.data import StreamPosition
from trainer.model.builder import canonical_names
from trainer.training import Trainer


def probe_trainer(case: dict, dump_path: Path) -> type[Trainer]:
    poison = case.get("poison")

    class ProbeTrainer(Trainer):
        def __init__(self, config, topology, engine, *args, **kwargs):
            super().__init__(config, topology, engine, *args, **kwargs)
            self.canonical = canonical_names(self.model)
            self.dump = {**rank_identity(topology), "losses": {}, "snapshots": {}}
            if "read_as_worker_of" in case:
                assert config.batch.workers == 1, "read_as_worker_of is for K=1 reference runs"
                stream = replace(config.batch, workers=case["read_as_worker_of"])
                self.position = StreamPosition(0, self.position.data_rank, stream)

        def snapshot(self) -> dict[str, torch.Tensor]:
            return shard_state(self.model, self.canonical)

        def train_step(self):
            result = super().train_step()
            if result.loss is not None:
                self.dump["losses"][self.step] = result.loss
            return result

        def _observe_outer_loop(self, outer) -> None:
            synced = outer.after_inner_step

            def observed(step: int) -> None:
                coords = self.topology.coords
                if poison and poison["worker"] == coords.worker and poison.get("tensor_rank", coords.tensor) == \
                        coords.tensor and str(step) in poison["at"]:
                    self._corrupt(poison["at"][str(step)])
                done = outer.state.outer_step + outer.state.skipped
                before = self.snapshot()
                synced(step)
                if outer.state.outer_step + outer.state.skipped != done:
                    self.dump["snapshots"][f"pre@{step}"] = before
                    self.dump["snapshots"][f"post@{step}"] = self.snapshot()

            outer.after_inner_step = observed  # the step hook looks the method up at each step

        @torch.no_grad()
        def _corrupt(self, kind: str) -> None:
            params = list(self.model.parameters())
            if kind == "nan":
                params[0].view(-1)[0] = float("nan")
            elif kind == "outlier":  # a worker that drifted far from its peers
                for p in params:
                    p.add_(1.0)
            else:
                raise ValueError(f"unknown poison {kind!r}")

        def train(self) -> dict:
            if "muloco" in self.extra_state:
                self._observe_outer_loop(self.extra_state["muloco"])
            self.dump["snapshots"]["init"] = self.snapshot()
            summary = super().train()
            self.dump["snapshots"]["final"] = self.snapshot()
            torch.save(self.dump, dump_path / f"rank{self.topology.rank}.pt")
            return summary

    return ProbeTrainer


def run_case(case: dict, out_dir: Path) -> None:
    case_dir = out_dir / case["name"]
    case_dir.mkdir(parents=True, exist_ok=True)
    ds_path = case_dir / "ds_config.json"
    if dist.get_rank() == 0:
        ds_path.write_text(json.dumps(case["ds_config"]))
    dist.barrier()
    run_trainer([*case["args"], "--ds_config", str(ds_path), "--run-dir", str(case_dir / "run")],
                probe_trainer(case, case_dir))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--local_rank", type=int)  # from the deepspeed launcher
    args = parser.parse_args()
    init_distributed()
    for case in json.loads(args.cases.read_text()):
        run_case(case, args.out_dir)
    close_distributed()


if __name__ == "__main__":
    main()
