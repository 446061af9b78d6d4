"""The ds_config's "optimizer" block, in DeepSpeed's {"type", "params"} form. The trainer builds the
optimizer itself (trainer/optim/inner.py); DeepSpeed never sees this block.

    "optimizer": {"type": "muon", "params": {"lr": 0.02, "weight_decay": 0.1, "ns_steps": 5, ...}}

`adamw` is AdamW on every parameter; `muon` is Muon on the hidden matrices and AdamW on the
embeddings, the head and 1-D parameters (trainer/optim/routing.py). The params a type takes are its
block's fields: a Muon key under `adamw` is an error, not ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.optim.muon import MuonConfig
from muloco.core.typed_json import ConfigBlock, setting

OptimizerName = Literal["adamw", "muon"]


@dataclass(frozen=True)
class AdamWParams(ConfigBlock):
    """Type adamw's params (and the lr and weight decay every type has)."""

    lr: float = setting(3e-3, gt=0, flag="--lr", doc="peak learning rate; the schedule scales it")
    weight_decay: float = setting(0.1, ge=0, flag="--weight-decay",
                                  doc="decoupled weight decay (each step W *= 1 - lr x weight_decay)")
    betas: tuple[float, float] = setting((0.9, 0.99), ge=0, lt=1, doc="AdamW's (beta1, beta2)")
    eps: float = setting(1e-8, gt=0, doc="AdamW's epsilon")


@dataclass(frozen=True)
class MuonParams(AdamWParams, MuonConfig):
    """Type muon's params: Muon's hyperparameters (this block is the MuonConfig every Muon step reads),
    the lr and weight decay, and AdamW's for the parameters routed to AdamW."""

    adamw_lr_factor: float = setting(1.0, gt=0, doc="the AdamW-routed parameters' lr is this x lr")
    adamw_weight_decay_factor: float = setting(1.0, ge=0, doc="... and their weight decay this x weight_decay")


PARAMS: dict[str, type[AdamWParams]] = {"adamw": AdamWParams, "muon": MuonParams}


@dataclass(frozen=True)
class OptimizerConfig(ConfigBlock):
    type: OptimizerName = setting("adamw", casefold=True, doc="`adamw`, or `muon` (Muon on hidden matrices, AdamW "
                                                             "on the rest); case does not matter")
    params: AdamWParams = setting(factory=AdamWParams, selected_by=("type", PARAMS),
                                  doc="the type's hyperparameters (below)")

    @property
    def adamw_factors(self) -> tuple[float, float]:
        """(lr, weight decay) factors of the AdamW-routed parameters: 1 when AdamW is the whole optimizer."""
        if isinstance(self.params, MuonParams):
            return self.params.adamw_lr_factor, self.params.adamw_weight_decay_factor
        return 1.0, 1.0


def retyped(block: dict[str, Any], name: str) -> dict[str, Any]:
    """The JSON optimizer block as type `name` (the --optimizer flag): params only another type
    takes are dropped, the rest kept (and checked by the load)."""
    params = block.get("params", {})
    if isinstance(params, dict):
        others_only = {f for cls in PARAMS.values() for f in cls.__dataclass_fields__} - set(
            PARAMS[name].__dataclass_fields__)
        params = {k: v for k, v in params.items() if k not in others_only}
    return {**block, "type": name, "params": params}
