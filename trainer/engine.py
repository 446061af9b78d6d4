"""The DeepSpeed adapter: the one module that calls `deepspeed.initialize` and knows its quirks.

What the trainer asks of DeepSpeed is small: reduce the gradients over the inner data-parallel group
(in fp32: the parameters, hence their gradients, are fp32 master weights), call the inner optimizer
and the lr scheduler once per optimizer step. Everything else is decided here:

- the ds_config DeepSpeed sees: the user's keys (RunConfig.ds_config) plus the batch keys, written as
  DeepSpeed checks them for ONE worker (train_batch_size = micro x accumulation x D = B/K; the
  worker count is invisible to DeepSpeed), `gradient_clipping: 0` (the inner optimizer clips over
  all TP/PP shards; DeepSpeed's clip would count TP-replicated parameters on one stage only) and
  `managed_gradient_accumulation: false` (Megatron's schedules run the micro-batches and call
  backward themselves; `step()` is then the accumulation boundary);
- the engine's counters: `global_steps`/`global_samples` follow the trainer's step, the one step
  counter of a run (`set_step` after a resume).
"""
from __future__ import annotations

from typing import Any

import deepspeed
import torch

from megatron_patches import DeepSpeedMpu
from trainer.config import BatchConfig, RunConfig


def deepspeed_config(user_keys: dict[str, Any], batch: BatchConfig) -> dict[str, Any]:
    """The config handed to deepspeed.initialize."""
    return {**user_keys,
            "train_micro_batch_size_per_gpu": batch.micro_batch_size,
            "gradient_accumulation_steps": batch.gradient_accumulation_steps,
            "train_batch_size": batch.per_worker,
            "gradient_clipping": 0.0,
            "managed_gradient_accumulation": False}


class Engine:
    """A DeepSpeed engine over the model, the inner optimizer and the lr scheduler."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, config: RunConfig):
        self._engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(config.ds_config, config.batch), mpu=DeepSpeedMpu)
        self._samples_per_step = config.batch.per_worker

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (DeepSpeed wraps nothing around a client optimizer without ZeRO/fp16)."""
        return self._engine.optimizer

    @property
    def lr_scheduler(self):
        return self._engine.lr_scheduler

    def step(self) -> None:
        """Reduce gradients over the inner DP group, step the optimizer and the lr schedule, zero the
        gradients. Without fp16 loss scaling DeepSpeed never skips a step; if it ever did, the run's
        step count and the data stream would part, so that stops the run."""
        self._engine.step()
        if not self._engine.was_step_applied():
            raise RuntimeError("DeepSpeed skipped an optimizer step (an fp16 loss-scale overflow?); "
                               "this trainer supports fp32 and bf16 only")
        # DeepSpeed counts samples per engine.backward(), which Megatron's schedules never call.
        self._engine.global_samples = self._engine.global_steps * self._samples_per_step

    def set_step(self, step: int) -> None:
        """Make DeepSpeed's counters agree with the trainer's step (after a resume)."""
        self._engine.global_steps = step
        self._engine.global_samples = step * self._samples_per_step
        self._engine.skipped_steps = 0

    def counters(self) -> dict[str, int]:
        """DeepSpeed's own counters, recorded in checkpoints (they follow the trainer's step)."""
        return {"global_steps": self._engine.global_steps, "global_samples": self._engine.global_samples,
                "skipped_steps": self._engine.skipped_steps}
