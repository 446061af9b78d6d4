"""Learning-rate schedule: linear warmup, then cosine decay to a fraction of the peak (the paper);
its config is the ds_config's "scheduler" block."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from muloco.core.typed_json import ConfigBlock, setting


@dataclass(frozen=True)
class ScheduleConfig(ConfigBlock):
    train_iters: int = setting(100, ge=1, flag="--train-iters", doc="optimizer steps of the run")
    warmup_iters: int = setting(10, ge=0, flag="--lr-warmup-iters",
                                doc="linear warmup steps from lr/warmup to the peak")
    min_lr_ratio: float = setting(0.1, ge=0, le=1, flag="--min-lr-ratio",
                                  doc="the cosine decays to this fraction of the peak (0.1, the paper's)")

    def warmup_warning(self) -> str | None:
        """A line for a warm-up longer than the run: the lr never reaches its peak (allowed: short test
        runs of a config made for a long one)."""
        if self.warmup_iters <= self.train_iters:
            return None
        return (f"warning: the warm-up ({self.warmup_iters} steps, --lr-warmup-iters) is longer than the run "
                f"({self.train_iters} steps, --train-iters): the lr ends at {self.train_iters / self.warmup_iters:.0%} "
                "of its peak")


@dataclass(frozen=True)
class SchedulerConfig(ConfigBlock):
    type: Literal["WarmupCosine"] | None = setting(None, doc="the one schedule, linear warmup then cosine decay "
                                                             "(may be omitted)")
    params: ScheduleConfig = setting(factory=ScheduleConfig, doc="its settings (below)")


def lr_multiplier(step: int, schedule: ScheduleConfig) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based)."""
    if schedule.warmup_iters > 0 and step < schedule.warmup_iters:
        return (step + 1) / schedule.warmup_iters
    decay_steps = max(1, schedule.train_iters - schedule.warmup_iters)
    progress = min(1.0, (step - schedule.warmup_iters) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * cosine
