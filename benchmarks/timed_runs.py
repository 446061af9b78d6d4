"""What the launched benchmarks of the outer loop share (outer_hook_overhead.py, straggler.py): each
case's ds_config, and a trainer that records every rank's wall clock."""
from __future__ import annotations

import json
import time
from pathlib import Path

BASE_CONFIG = Path(__file__).resolve().parents[1] / "ds_configs" / "cpu_tiny_muloco.json"


def write_config(path: Path, muloco: dict) -> None:
    """The tiny MuLoCo ds_config with its muloco block replaced by `muloco`."""
    base = {k: v for k, v in json.loads(BASE_CONFIG.read_text()).items() if k != "muloco"}
    path.write_text(json.dumps({**base, "muloco": muloco}))


def timed_trainer():
    """The Trainer that writes, to step_times.rank<R>.json in its run folder, this rank's wall clock after
    every inner step it took (step hooks included) and the time of each step's hooks (the outer sync,
    with its wait for the other workers). Imported by a launched rank only: the launcher never loads
    the trainer."""
    import torch.distributed as dist

    from trainer.training import Trainer

    class TimedTrainer(Trainer):
        def train(self) -> dict:
            self.step_times, self.hook_seconds = [], []
            summary = super().train()
            Path(self.config.run_dir, f"step_times.rank{dist.get_rank()}.json").write_text(
                json.dumps({"times": self.step_times, "hooks": self.hook_seconds}))
            return summary

        def train_step(self):
            result = super().train_step()
            self.step_times.append(time.perf_counter())
            return result

        def _run_step_hooks(self) -> dict:
            started = time.perf_counter()
            values = super()._run_step_hooks()
            self.hook_seconds.append(time.perf_counter() - started)
            return values

    return TimedTrainer
