"""Learning-rate schedule: linear warmup, then cosine decay to a fraction of the peak (the paper)."""
from __future__ import annotations

import math

from trainer.config import ScheduleConfig


def lr_multiplier(step: int, schedule: ScheduleConfig) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based)."""
    if schedule.warmup_iters > 0 and step < schedule.warmup_iters:
        return (step + 1) / schedule.warmup_iters
    decay_steps = max(1, schedule.train_iters - schedule.warmup_iters)
    progress = min(1.0, (step - schedule.warmup_iters) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * cosine
