"""The inner training loop: Megatron's forward/backward schedules (pipeline or not) for one worker's
micro-batches, then the engine's step (gradient all-reduce over the inner DP group and the inner
optimizer), then the step hooks (the MuLoCo outer sync, checkpoint saves).

Hooks are the trainer's one extension point: `register_step_hook(fn)` returns a handle whose
`remove()` detaches `fn`; `fn(step)` runs after every optimizer step, in registration order, with
`trainer.step` (THE step counter of a run) already counting that step, and may return a dict of
values to log with the step.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

import torch
from megatron.core import parallel_state as mps
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.utils.hooks import RemovableHandle

from muloco.core import comm
from trainer.config import RunConfig
from trainer.data import StreamPosition, micro_batches, validation_batches
from trainer.engine import Engine
from trainer.metrics import MetricsLogger
from muloco.core.topology import Topology

StepHook = Callable[[int], "dict | None"]


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    # A copy: Megatron's schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = {key: comm.to_compute_device(value) for key, value in next(data_iterator).items() if value is not None}
    # Megatron hands its attention_mask argument to the core attention unchanged: the [b, s] document
    # ids with document masking (trainer.model.attention builds the mask from them), else None (causal).
    output = model(batch["tokens"], batch["position_ids"], batch.get("document_ids"), labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


@dataclass
class StepResult:
    loss: float | None  # None except on the last pipeline stage
    grad_norm: float
    hook_values: dict = field(default_factory=dict)  # what the step hooks returned


class Trainer:
    def __init__(self, config: RunConfig, topology: Topology, engine: Engine, train_dataset, valid_dataset,
                 position: StreamPosition, logger: MetricsLogger):
        self.config, self.topology, self.engine, self.logger = config, topology, engine, logger
        self.model = engine.module
        self.train_dataset, self.valid_dataset, self.position = train_dataset, valid_dataset, position
        self.step = 0  # optimizer steps taken: the run's one step counter
        self._step_hooks: OrderedDict[int, StepHook] = OrderedDict()
        # Components with state_dict()/load_state_dict() that a checkpoint must carry besides the
        # engine (the MuLoCo outer loop registers itself here as "muloco").
        self.extra_state: dict[str, object] = {}
        self.stop_requested = False  # a step hook (preemption) ends the loop after the current step
        self._forward_backward = get_forward_backward_func()

    def register_step_hook(self, hook: StepHook) -> RemovableHandle:
        """Call `hook(step)` after every optimizer step until `handle.remove()`."""
        handle = RemovableHandle(self._step_hooks)
        self._step_hooks[handle.id] = hook
        return handle

    def _run_schedule(self, batches: Iterable[dict], num_micro: int, forward_only: bool) -> float | None:
        outputs = self._forward_backward(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[self.model],
            num_microbatches=num_micro, seq_length=self.config.model.seq_length,
            micro_batch_size=self.config.batch.micro_batch_size, forward_only=forward_only)
        if not mps.is_pipeline_last_stage():
            return None
        return float(torch.stack([o["lm loss"] for o in outputs]).mean())

    def train_step(self) -> StepResult:
        self.model.train()
        loss = self._run_schedule(micro_batches(self.train_dataset, self.position, self.step),
                                  self.config.batch.gradient_accumulation_steps, forward_only=False)
        self.engine.step()  # inner-DP all-reduce, clipping and the inner optimizer, lr schedule
        self.step += 1
        return StepResult(loss, self.engine.optimizer.last_grad_norm, self._run_step_hooks())

    def _run_step_hooks(self) -> dict:
        values = {}
        for hook in list(self._step_hooks.values()):  # a hook may remove itself
            values.update(hook(self.step) or {})
        return values

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        batches = list(validation_batches(self.valid_dataset, self.position, self.config.eval_iters))
        loss = self._run_schedule(batches, len(batches), forward_only=True)
        return self._mean_over_loss_ranks(loss, 1, group=self.topology.worker_group)

    def _mean_over_loss_ranks(self, loss_sum: float | None, steps: int, group) -> float:
        """Mean over `steps` steps of the losses summed on last-stage ranks in `group` (the logging rank
        is on stage 0)."""
        holds = loss_sum is not None and mps.get_tensor_model_parallel_rank() == 0
        t = torch.tensor([loss_sum if holds else 0.0, steps if holds else 0.0], dtype=torch.float64,
                         device=comm.group_device(group))
        comm.all_reduce(t, group=group)
        return float(t[0] / t[1])

    def train(self) -> dict:
        cfg = self.config
        tokens_per_step = cfg.batch.global_batch * cfg.model.seq_length
        last_val = None
        window_start, window_steps, window_loss = time.time(), 0, None
        while self.step < cfg.schedule.train_iters and not self.stop_requested:
            result = self.train_step()
            window_steps += 1
            if result.loss is not None:
                window_loss = (window_loss or 0.0) + result.loss
            record = None
            if self.step % cfg.log_interval == 0 or self.step == cfg.schedule.train_iters:
                # The logging worker's mean over the interval: logging must not add a cross-datacenter
                # collective, so the loss is worker-local (each worker's own data).
                loss = self._mean_over_loss_ranks(window_loss, window_steps, group=self.topology.worker_group)
                elapsed = time.time() - window_start
                record = {"step": self.step, "tokens": self.step * tokens_per_step, "loss": loss,
                          "loss_steps": window_steps,
                          "lr": self.engine.optimizer.param_groups[-1]["lr"], "grad_norm": result.grad_norm,
                          "tokens_per_s": window_steps * tokens_per_step / max(elapsed, 1e-9), **result.hook_values}
                window_start, window_steps, window_loss = time.time(), 0, None
            if cfg.eval_interval and (self.step % cfg.eval_interval == 0 or self.step == cfg.schedule.train_iters):
                last_val = self.evaluate()
                record = record or {"step": self.step, "tokens": self.step * tokens_per_step}
                record["val_loss"] = last_val
            if record is not None:
                self.logger.log(record, self.step)
                self.logger.progress(self.step, " ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items() if k != "step"))
        return {"steps": self.step, "val_loss": last_val}
