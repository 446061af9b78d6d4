"""Muon on whole (logical) matrices: its config, its per-matrix steps, and a single-process optimizer.

The per-matrix functions (update_momentum, orthogonalize_direction, lr_scale, apply_update) are
what the distributed optimizer calls once it holds a full logical matrix; `Muon` chains them for
local parameters and is the reference every distributed variant is tested against.

Momentum is the plain sum M = mu*M + G (as in the paper). torch.optim.Muon keeps the moving
average B = mu*B + (1-mu)*G = (1-mu)*M instead; since Newton-Schulz normalizes its input the
updates agree, but the stored buffers differ by that factor (1-mu).

The buffer may be stored in bf16 (`momentum_dtype`, half the memory); the sum is still formed in
fp32 each step and the direction is that fp32 sum, only the stored copy is rounded (to nearest).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from trainer.optim.newton_schulz import (
    DEFAULT_SCHEDULE,
    DEFAULT_STEPS,
    NSDtype,
    NSForm,
    ScheduleName,
    orthogonalize,
)
from muloco.core.typed_json import ConfigBlock, Problem, setting

# How the step size of an (rows, cols) = (fan_out, fan_in) matrix is scaled.
LRScaling = Literal["spectral_norm", "match_rms_adamw", "torch_original", "none"]
LR_SCALINGS = get_args(LRScaling)

MomentumDtype = Literal["float32", "bfloat16"]
MOMENTUM_DTYPES: dict[MomentumDtype, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MuonConfig(ConfigBlock):
    """Muon's hyperparameters (the paper's defaults). The lr and weight decay are the optimizer's
    param groups', which the lr schedule changes every step."""

    momentum: float = setting(0.9, ge=0, lt=1, doc="momentum mu of the sum M = mu M + G")
    nesterov: bool = setting(False, doc="orthogonalize G + mu M instead of M")
    ns_schedule: ScheduleName | tuple[tuple[float, float, float], ...] = setting(
        DEFAULT_SCHEDULE, doc="Newton-Schulz coefficients: `paper` (its 5 steps), `keller` "
                              "(3.4445, -4.7750, 2.0315, as torch.optim.Muon) or a list of (a, b, c)")
    ns_steps: int = setting(DEFAULT_STEPS, ge=1, doc="Newton-Schulz iterations (the schedule's last triple repeats)")
    ns_dtype: NSDtype = setting("float32", doc="Newton-Schulz compute dtype; Muon's exchange travels in it")
    ns_form: NSForm = setting("auto", doc="Newton-Schulz form: `standard` (iterate on X), `gram` (iterate on the "
                                          "small Gram matrix X X^T, restarted every 3 steps; same result), `auto` "
                                          "(per matrix, the one with fewer FLOPs: Gram for rectangular, standard "
                                          "for square)")
    momentum_dtype: MomentumDtype = setting("float32", doc="dtype the momentum buffer is stored in; `bfloat16` "
                                                           "halves it (the sum is still formed in fp32)")
    lr_scaling: LRScaling = setting("spectral_norm", doc="lr factor per matrix: `spectral_norm` sqrt(fan_out/fan_in) "
                                                         "(the paper's), `match_rms_adamw` 0.2 sqrt(max(fan_out, fan_in)), "
                                                         "`torch_original` sqrt(max(1, fan_out/fan_in)), `none`")

    def problems(self) -> list[Problem]:
        if isinstance(self.ns_schedule, tuple) and not self.ns_schedule:
            return [("ns_schedule", "must hold at least one (a, b, c) triple")]
        return []


def update_momentum(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Accumulate grad into buf in place (M = mu*M + G); return the direction to orthogonalize.

    The direction is M itself, or G + mu*M with Nesterov (torch.optim.Muon's Nesterov direction
    up to the factor 1-mu, see the module docstring). Without Nesterov the returned tensor is buf
    when buf is fp32, else the fp32 sum that buf holds rounded.
    """
    total = buf.float()  # buf itself when it is fp32
    total.mul_(momentum).add_(grad)
    if total is not buf:
        buf.copy_(total)
    return grad.add(total, alpha=momentum) if nesterov else total


def orthogonalize_direction(direction: Tensor, config: MuonConfig) -> Tensor:
    """Newton-Schulz with the config's schedule, steps, dtype and form (2-D or a 3-D batch)."""
    return orthogonalize(direction, schedule=config.ns_schedule, steps=config.ns_steps, dtype=config.ns_dtype,
                         form=config.ns_form)


def lr_scale(shape: Sequence[int], mode: str) -> float:
    """Factor on lr for the orthogonalized update of a (rows, cols) = (fan_out, fan_in) matrix."""
    if len(shape) != 2:
        raise ValueError(f"lr_scale expects a 2-D (rows, cols) shape, got {tuple(shape)}")
    rows, cols = shape
    if mode == "spectral_norm":  # the paper: sqrt(fan_out / fan_in)
        return math.sqrt(rows / cols)
    if mode == "match_rms_adamw":  # Moonshot: update RMS ~ AdamW's, so AdamW's lr carries over
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "torch_original":  # torch.optim.Muon's default adjust_lr_fn ("original")
        return math.sqrt(max(1.0, rows / cols))
    if mode == "none":
        return 1.0
    raise ValueError(f"unknown lr scaling {mode!r}; expected one of {list(LR_SCALINGS)}")


@torch.no_grad()
def apply_update(param: Tensor, ortho: Tensor, lr: float, weight_decay: float, scale: float) -> None:
    """W *= 1 - lr*wd; W -= lr*scale*O, in place.

    Decoupled weight decay uses the unscaled lr, the update the scaled one (as torch.optim.Muon).
    """
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-lr * scale)


class Muon(torch.optim.Optimizer):
    """Single-process Muon over 2-D parameters; each param group may override lr, weight_decay and
    any MuonConfig field.

    State per parameter: 'momentum_buffer' (the sum-form M, see the module docstring).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], config: MuonConfig, lr: float,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **dataclasses.asdict(config)})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._group_config(group)  # validates the group's hyperparameters now, not at the first step
        for p in group["params"]:
            if p.dim() != 2:
                raise ValueError(
                    f"Muon only optimizes 2-D matrices, got a parameter of shape {tuple(p.shape)}; "
                    "give embeddings, the output head and 1-D parameters to AdamW"
                )

    @staticmethod
    def _group_config(group: dict[str, Any]) -> MuonConfig:
        if not group["lr"] >= 0 or not group["weight_decay"] >= 0:
            raise ValueError(f"Muon lr and weight_decay must be >= 0, got {group['lr']}, {group['weight_decay']}")
        return MuonConfig(**{f.name: group[f.name] for f in dataclasses.fields(MuonConfig)})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            config = self._group_config(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=MOMENTUM_DTYPES[config.momentum_dtype])
                direction = update_momentum(state["momentum_buffer"], p.grad, config.momentum, config.nesterov)
                ortho = orthogonalize_direction(direction, config)
                apply_update(p, ortho, group["lr"], group["weight_decay"], lr_scale(p.shape, config.lr_scaling))
        return loss
