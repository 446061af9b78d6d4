"""The inner optimizer's share of a full training step, tiny preset, one CPU process, for Muon and
AdamW: the DeepSpeed engine's step (gradient reduction, clipping, the inner optimizer, lr schedule)
timed inside each step of a run assembled exactly as pretrain.py does.

python benchmarks/optimizer_step_share.py [--steps 30]

The first steps are left out (warm-up). The last line printed is a JSON object, for scripts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


import torch

from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import TINY_VOCAB, init_distributed, run_trainer, tiny_flags
from trainer.training import Trainer

WARMUP_STEPS = 5


class StepTimingTrainer(Trainer):
    """Trainer that times each whole step and the engine step inside it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_seconds: list[float] = []
        self.engine_step_seconds: list[float] = []
        engine_step = self.engine.step

        def timed_engine_step(*a, **kw):
            start = time.perf_counter()
            engine_step(*a, **kw)
            self.engine_step_seconds.append(time.perf_counter() - start)

        self.engine.step = timed_engine_step

    def train_step(self):
        start = time.perf_counter()
        result = super().train_step()
        self.step_seconds.append(time.perf_counter() - start)
        return result

    def train(self) -> dict:
        summary = super().train()
        steps, optimizer = self.step_seconds[WARMUP_STEPS:], self.engine_step_seconds[WARMUP_STEPS:]
        summary.update(step_ms=round(1e3 * sum(steps) / len(steps), 2),
                       optimizer_ms=round(1e3 * sum(optimizer) / len(optimizer), 2),
                       optimizer_share=round(sum(optimizer) / sum(steps), 4))
        return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    init_distributed()
    result = {"threads": torch.get_num_threads(), "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=TINY_VOCAB)
        for optimizer in ("muon", "adamw"):
            summary = run_trainer(tiny_flags(data, Path(tmp) / optimizer, optimizer, "--train-iters", str(args.steps),
                                             "--eval-interval", "0", "--log-interval", str(args.steps)),
                                  StepTimingTrainer)
            result[optimizer] = {k: summary[k] for k in ("step_ms", "optimizer_ms", "optimizer_share")}
    for optimizer in ("muon", "adamw"):
        r = result[optimizer]
        print(f"{optimizer}: step {r['step_ms']} ms, optimizer {r['optimizer_ms']} ms "
              f"({100 * r['optimizer_share']:.1f}% of the step)")
    print(f"muon optimizer step / adamw optimizer step: "
          f"{result['muon']['optimizer_ms'] / result['adamw']['optimizer_ms']:.2f}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
