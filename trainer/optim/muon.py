"""Muon on whole (logical) matrices: its config, its per-matrix steps, and a single-process optimizer.

The per-matrix functions (update_momentum, orthogonalize_direction, lr_scale, apply_update) are
what the distributed optimizer calls once it holds a full logical matrix; `Muon` chains them for
local parameters and is the reference every distributed variant is tested against.

Momentum is the plain sum M = mu*M + G (as in the paper). torch.optim.Muon keeps the moving
average B = mu*B + (1-mu)*G = (1-mu)*M instead; since Newton-Schulz normalizes its input the
updates agree, but the stored buffers differ by that factor (1-mu).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.optim.newton_schulz import NS_DTYPES, Schedule, orthogonalize, resolve_schedule

# How the step size of an (rows, cols) = (fan_out, fan_in) matrix is scaled.
LR_SCALINGS = ("spectral_norm", "match_rms_adamw", "torch_original", "none")


@dataclass(frozen=True)
class MuonConfig:
    """Muon hyperparameters. Defaults are the MuLoCo paper's, except lr which has none."""

    lr: float
    momentum: float = 0.9
    nesterov: bool = False
    ns_schedule: Schedule = "paper"
    ns_steps: int = 5
    ns_dtype: str = "float32"  # "float32" | "bfloat16"
    lr_scaling: str = "spectral_norm"  # one of LR_SCALINGS
    weight_decay: float = 0.0
    eps: float = 1e-7

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise ValueError(f"Muon lr must be a number >= 0, got {self.lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ValueError(f"Muon momentum must be in [0, 1), got {self.momentum!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"Muon nesterov must be a bool, got {self.nesterov!r}")
        resolve_schedule(self.ns_schedule, self.ns_steps)  # raises on a bad schedule or step count
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon ns_dtype must be one of {sorted(NS_DTYPES)}, got {self.ns_dtype!r}")
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"Muon lr_scaling must be one of {list(LR_SCALINGS)}, got {self.lr_scaling!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(f"Muon weight_decay must be a number >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise ValueError(f"Muon eps must be a number > 0, got {self.eps!r}")


def update_momentum(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Accumulate grad into buf in place (M = mu*M + G); return the direction to orthogonalize.

    The direction is M itself, or G + mu*M with Nesterov (torch.optim.Muon's Nesterov direction
    up to the factor 1-mu, see the module docstring). Without Nesterov the returned tensor is buf.
    """
    buf.mul_(momentum).add_(grad)
    return grad.add(buf, alpha=momentum) if nesterov else buf


def orthogonalize_direction(direction: Tensor, config: MuonConfig) -> Tensor:
    """Newton-Schulz with the config's schedule, steps, eps and dtype (2-D or a 3-D batch)."""
    return orthogonalize(
        direction, schedule=config.ns_schedule, steps=config.ns_steps, eps=config.eps, dtype=config.ns_dtype
    )


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
    """Single-process Muon over 2-D parameters; each param group may override any MuonConfig field.

    State per parameter: 'momentum_buffer' (the sum-form M, see the module docstring).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], config: MuonConfig) -> None:
        super().__init__(params, dataclasses.asdict(config))

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
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                direction = update_momentum(state["momentum_buffer"], p.grad, config.momentum, config.nesterov)
                ortho = orthogonalize_direction(direction, config)
                apply_update(p, ortho, config.lr, config.weight_decay, lr_scale(p.shape, config.lr_scaling))
        return loss
