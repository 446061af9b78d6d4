"""The shipped GPU ds_configs: the catalogue of runs and the writer that makes each config from the
paper's recipe (trainer/recipe.py) plus the deployment choices the paper does not fix (layout,
micro-batch, collective, and an inner lr where it publishes none).

    python tools/write_gpu_configs.py      # rewrites ds_configs/gpu_*.json

tests/test_recipe.py checks every shipped GPU config against this catalogue.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from muloco.diloco.config import MuLoCoConfig
from trainer.optim.config import MuonParams
from trainer.recipe import Recipe, paper_recipe, unpublished_lr

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
COMMAND = "python tools/write_gpu_configs.py"


@dataclass(frozen=True)
class ShippedConfig:
    """One GPU ds_config: the recipe's inputs plus the deployment choices the paper does not fix."""

    name: str
    preset: str
    optimizer: str
    workers: int | None  # None: data-parallel baseline (no muloco block)
    global_batch: int
    micro_batch: int
    tensor: int
    pipeline: int
    data: int
    unpublished_lr: float | None = None  # this trainer's choice where the paper gives none
    collective: str = "all_gather"

    @property
    def accumulation(self) -> int:
        per_step = self.micro_batch * self.data * (self.workers or 1)
        if self.global_batch % per_step:
            raise ValueError(f"{self.name}: B {self.global_batch} is not a multiple of micro x D x K = {per_step}")
        return self.global_batch // per_step


GPU_CONFIGS: tuple[ShippedConfig, ...] = (
    ShippedConfig("gpu_150m_dp_adamw", "150m", "adamw", None, 256, 8, 1, 1, 8, unpublished_lr=0.003),
    ShippedConfig("gpu_150m_dp_muon", "150m", "muon", None, 256, 8, 1, 1, 8, unpublished_lr=0.0625),
    ShippedConfig("gpu_150m_muloco_k1", "150m", "muon", 1, 256, 8, 1, 1, 8, unpublished_lr=0.0625),
    ShippedConfig("gpu_1.76b_muloco_k1", "1.76b", "muon", 1, 256, 4, 2, 1, 4, unpublished_lr=0.03125),
    ShippedConfig("gpu_3.1b_muloco_k16", "3.1b", "muon", 16, 2048, 2, 2, 1, 4, collective="reduce_scatter"),
    ShippedConfig("gpu_3.1b_diloco_k16", "3.1b", "adamw", 16, 1024, 2, 2, 1, 4, collective="reduce_scatter"),
    ShippedConfig("gpu_15b_muloco_k16", "15b", "muon", 16, 4096, 1, 4, 2, 4, unpublished_lr=0.01,
                  collective="reduce_scatter"),
)


def optimizer_block(r: Recipe, lr: float, ns_dtype: str) -> dict:
    """The ds_config's optimizer block for recipe `r` at inner lr `lr`; what the recipe does not set is
    the trainer's default, written out."""
    defaults = MuonParams()
    params: dict[str, Any] = {"lr": lr, "weight_decay": r.weight_decay, "betas": list(defaults.betas),
                              "eps": defaults.eps}
    if r.optimizer == "muon":
        params.update(momentum=defaults.momentum, nesterov=defaults.nesterov, ns_schedule=defaults.ns_schedule,
                      ns_dtype=ns_dtype, lr_scaling=defaults.lr_scaling, adamw_lr_factor=r.adamw_lr_factor,
                      adamw_weight_decay_factor=r.adamw_weight_decay_factor)
    return {"type": r.optimizer, "params": params}


def muloco_block(r: Recipe, sync_interval: int, compression: dict[str, Any], collective: str) -> dict:
    """The ds_config's muloco block for recipe `r`: its outer optimizer, and the official codec forms
    where `compression` (a compression block's method, bits, ...) quantizes or feeds back errors."""
    compression = dict(compression)
    if compression.get("method") == "statistical":
        compression["statistical_rounding"] = r.statistical_rounding
    if compression.get("error_feedback"):
        compression.update(ef_form=r.ef_form, ef_beta=r.ef_beta)
    return {"workers": r.workers, "sync_interval": sync_interval, "outer_lr": r.outer_lr,
            "outer_momentum": r.outer_momentum, "nesterov": MuLoCoConfig().nesterov, "compression": compression,
            "collective": collective}


def gpu_ds_config(c: ShippedConfig) -> dict:
    """The config's JSON; values the recipe does not set are the trainer's defaults, written out."""
    r = paper_recipe(c.preset, c.workers or 1, c.global_batch, c.optimizer)
    if (r.inner_lr is None) == (c.unpublished_lr is None):
        raise ValueError(f"{c.name}: give an lr exactly where the paper publishes none")
    notes = {"model": c.preset, "inner_optimizer": c.optimizer, "global_batch": c.global_batch, "generated_by": COMMAND}
    if c.unpublished_lr is not None:
        notes["not_from_the_paper"] = {"optimizer.params.lr": f"{unpublished_lr(c.optimizer)}; {c.unpublished_lr} is this "
                                                              "trainer's choice, tune it"}
    config = {
        "recipe": {"name": "paper", **notes},
        "layout": {"tensor": c.tensor, "pipeline": c.pipeline, "data": c.data},
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.accumulation,
        "optimizer": optimizer_block(r, r.inner_lr or c.unpublished_lr, ns_dtype="bfloat16"),
        "scheduler": {"params": {"warmup_iters": r.warmup_iters, "min_lr_ratio": r.min_lr_ratio,
                                 "train_iters": r.train_iters}},
        "gradient_clipping": r.clip_grad,
        "bf16": {"enabled": True},
        "steps_per_print": 1000000,
    }
    if c.workers is not None:
        # The paper's runs exchange uncompressed pseudogradients; H is this trainer's default.
        config["muloco"] = muloco_block(r, MuLoCoConfig().sync_interval, {"method": "none"}, c.collective)
    return config


def main() -> int:
    for c in GPU_CONFIGS:
        (DS_CONFIGS / f"{c.name}.json").write_text(json.dumps(gpu_ds_config(c), indent=2) + "\n")
        print(f"wrote ds_configs/{c.name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
