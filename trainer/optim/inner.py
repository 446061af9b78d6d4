"""The inner optimizer handed to deepspeed.initialize: AdamW, or Muon on hidden matrices with AdamW
on the rest; global-norm clipping over the model-parallel shards happens here too, because
DeepSpeed's own clipping counts TP-replicated parameters on only the first pipeline stage.

One torch Optimizer with two kinds of param groups, so DeepSpeed and the lr scheduler see plain
param groups; it steps exactly once per optimizer step (DeepSpeed calls step() on the boundary).
"""
from __future__ import annotations

import math

import torch

from trainer.model.presets import ModelShape
from trainer.optim.config import OptimizerConfig
from trainer.optim.distributed_muon import DistributedMuon, ShardGroup
from trainer.optim.grad_norm import global_grad_norm, sum_partial_grads
from trainer.optim.muon import MOMENTUM_DTYPES
from trainer.optim.routing import Routing


def adamw_update(p, grad, exp_avg, exp_avg_sq, step: int, lr: float, betas, eps: float, weight_decay: float) -> None:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter), the same math as torch.optim.AdamW."""
    beta1, beta2 = betas
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias1)


class InnerOptimizer(torch.optim.Optimizer):
    def __init__(self, routing: Routing, canonical: dict[str, str], config: OptimizerConfig, clip_grad: float,
                 model_shape: ModelShape, tp_group, dp_group, model_parallel_group):
        self.config = config
        self.clip_grad = clip_grad
        self.tp = ShardGroup.of(tp_group)
        self.model_parallel_group = model_parallel_group
        self._named = routing.adamw + routing.muon
        params = config.params
        groups = []
        if routing.adamw:
            lr_factor, wd_factor = config.adamw_factors
            groups.append({"params": [p for _, p in routing.adamw], "kind": "adamw", "lr": params.lr * lr_factor,
                           "weight_decay": params.weight_decay * wd_factor})
        if routing.muon:
            groups.append({"params": [p for _, p in routing.muon], "kind": "muon", "lr": params.lr,
                           "weight_decay": params.weight_decay})
        super().__init__(groups, {})
        self.muon = None
        if routing.muon:
            self.muon = DistributedMuon([canonical[n] for n, _ in routing.muon], [p for _, p in routing.muon],
                                        model_shape, self.tp, ShardGroup.of(dp_group))
        self.last_grad_norm = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        sum_partial_grads(self._named, self.tp.group)
        norm = global_grad_norm([p for _, p in self._named], self.tp.rank, self.model_parallel_group)
        self.last_grad_norm = float(norm)
        if not math.isfinite(self.last_grad_norm):
            raise FloatingPointError(f"gradient norm is {self.last_grad_norm}: the inner step would corrupt the weights")
        if self.clip_grad > 0 and self.last_grad_norm > self.clip_grad:
            coef = self.clip_grad / (self.last_grad_norm + 1e-6)
            for _, p in self._named:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
            else:
                dtype = MOMENTUM_DTYPES[self.config.params.momentum_dtype]
                buffers = [self._state(p, "momentum_buffer", dtype) for p in group["params"]]
                # The ds_config's Muon params as loaded, at this step's scheduled lr.
                self.muon.step(buffers, self.config.params, group["lr"], group["weight_decay"])

    def _state(self, p, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        state = self.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=dtype)
        elif state[key].dtype != dtype:  # a checkpoint saved with the other muon.momentum_dtype: take it as ours
            state[key] = state[key].to(dtype)
        return state[key]

    def _adamw_step(self, group) -> None:
        c = self.config.params
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            state["step"] = state.get("step", 0) + 1
            adamw_update(p, p.grad, self._state(p, "exp_avg"), self._state(p, "exp_avg_sq"), state["step"],
                         group["lr"], c.betas, c.eps, group["weight_decay"])
