"""The paper's training recipe (MuLoCo, arXiv 2505.23725, and its official code) as code.

From (model preset, K workers, global batch B in sequences of 2048, inner optimizer):
- inner lr: only where the paper publishes one (`PUBLISHED_INNER_LRS`); elsewhere None, with the
  reason, and the user or the ds_config must give it: this module never invents a learning rate;
- weight decay: base(preset) x (B / K) / 512, i.e. scaled with the per-worker batch;
- AdamW-routed parameters (embeddings, head, 1-D) use the Muon group's lr and weight decay
  (factors 1.0);
- schedule: 500 warmup steps, cosine to 10% of the peak, global-norm clip 1.0;
- outer Nesterov SGD: K=1 lr 0.7 momentum 0.6, K>1 lr 1.0 momentum 0.9;
- the official error feedback, `e = 0.9 e + outer_lr delta` (ef_form "paper", beta 0.9), when a
  config compresses with error feedback, and the official statistical rounding `round(c/s + n/2)`
  when it uses the statistical quantizer;
- steps for 20 tokens per parameter (Chinchilla), counting embedding and head as the paper's
  preset names do (Llama-3 vocabulary, 128,256).

`--recipe paper` (trainer/config.py) fills whatever the ds_config leaves out and prints the table;
`python -m trainer.recipe --write` regenerates the GPU ds_configs in `GPU_CONFIGS` from it, and
tests/test_recipe.py checks every shipped one against it.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.model.presets import PRESETS, parameter_count

PAPER_VOCAB = 128_256  # Llama-3 tokenizer
PAPER_SEQ_LENGTH = 2048
WEIGHT_DECAY_BASE_BATCH = 512  # per-worker sequences at which the base weight decay applies
TOKENS_PER_PARAMETER = 20
WARMUP_ITERS, MIN_LR_RATIO, CLIP_GRAD = 500, 0.1, 1.0
EF_BETA, EF_FORM, STATISTICAL_ROUNDING = 0.9, "paper", "paper"

_BASE_WEIGHT_DECAY = {"150m": 0.01, "416m": 0.01, "914m": 0.01, "1.76b": 1e-3, "3.1b": 1e-3, "15b": 1e-4}
_BASE_WEIGHT_DECAY_ADAMW = {"150m": 1e-3}  # where AdamW's base differs from Muon's

# (preset, inner optimizer, K, B) -> the inner lr the paper reports for that run.
PUBLISHED_INNER_LRS: dict[tuple[str, str, int, int], float] = {
    ("3.1b", "muon", 16, 2048): 0.015625,
    ("3.1b", "adamw", 16, 1024): 0.000691,
}
_NEAREST_PUBLISHED = {"muon": "its Muon inner lrs: 0.016-0.063 in the K=1 sweeps, smaller for larger models; "
                              "0.015625 for 3.1B K=16 at B=2048",
                      "adamw": "its AdamW inner lr: 0.000691 for 3.1B K=16 at B=1024"}


def unpublished_lr(optimizer: str) -> str:
    return f"the paper publishes no {optimizer} inner lr for this (model, K, B); {_NEAREST_PUBLISHED[optimizer]}"


@dataclass(frozen=True)
class Recipe:
    preset: str
    workers: int
    global_batch: int
    optimizer: str
    inner_lr: float | None  # None: not published
    weight_decay: float
    adamw_lr_factor: float
    adamw_weight_decay_factor: float
    warmup_iters: int
    min_lr_ratio: float
    clip_grad: float
    outer_lr: float
    outer_momentum: float
    ef_form: str
    ef_beta: float
    statistical_rounding: str
    train_iters: int

    def rows(self) -> list[tuple[str, Any, str]]:
        """(setting, value, where it comes from)."""
        b_per_worker = self.global_batch // self.workers
        return [
            ("optimizer.params.lr", self.inner_lr, "published" if self.inner_lr is not None else unpublished_lr(self.optimizer)),
            ("optimizer.params.weight_decay", self.weight_decay,
             f"{_base_weight_decay(self.preset, self.optimizer):g} x (B/K = {b_per_worker}) / {WEIGHT_DECAY_BASE_BATCH}"),
            ("optimizer.params.adamw_lr_factor", self.adamw_lr_factor, "AdamW group uses the Muon group's lr"),
            ("optimizer.params.adamw_weight_decay_factor", self.adamw_weight_decay_factor, "... and weight decay"),
            ("scheduler.params.warmup_iters", self.warmup_iters, "linear warmup"),
            ("scheduler.params.min_lr_ratio", self.min_lr_ratio, "cosine to 10% of the peak"),
            ("scheduler.params.train_iters", self.train_iters,
             f"{TOKENS_PER_PARAMETER} tokens/parameter at B x {PAPER_SEQ_LENGTH} tokens per step"),
            ("gradient_clipping", self.clip_grad, "global-norm clip"),
            ("muloco.outer_lr", self.outer_lr, "K=1: 0.7, K>1: 1.0"),
            ("muloco.outer_momentum", self.outer_momentum, "K=1: 0.6, K>1: 0.9 (Nesterov)"),
            ("muloco.compression.ef_form", self.ef_form, "official error feedback e = beta e + outer_lr delta"),
            ("muloco.compression.ef_beta", self.ef_beta, "official error-feedback decay"),
            ("muloco.compression.statistical_rounding", self.statistical_rounding,
             "official statistical quantizer round(c/s + n/2)"),
        ]


def _base_weight_decay(preset: str, optimizer: str) -> float:
    if preset not in _BASE_WEIGHT_DECAY:
        raise ConfigError(f"the paper has no recipe for model {preset!r}; it has {sorted(_BASE_WEIGHT_DECAY)}")
    if optimizer == "adamw":
        return _BASE_WEIGHT_DECAY_ADAMW.get(preset, _BASE_WEIGHT_DECAY[preset])
    return _BASE_WEIGHT_DECAY[preset]


def paper_recipe(preset: str, workers: int, global_batch: int, optimizer: str) -> Recipe:
    if optimizer not in ("muon", "adamw"):
        raise ConfigError(f'inner optimizer must be "muon" or "adamw", got {optimizer!r}')
    if workers < 1 or global_batch % workers:
        raise ConfigError(f"global batch {global_batch} is not divisible by K = {workers} workers")
    weight_decay = _base_weight_decay(preset, optimizer) * (global_batch / workers) / WEIGHT_DECAY_BASE_BATCH
    parameters = parameter_count(PRESETS[preset], PAPER_VOCAB)
    return Recipe(
        preset=preset, workers=workers, global_batch=global_batch, optimizer=optimizer,
        inner_lr=PUBLISHED_INNER_LRS.get((preset, optimizer, workers, global_batch)),
        weight_decay=float(f"{weight_decay:.6g}"),  # 5e-05, not 5.000000000000001e-05
        adamw_lr_factor=1.0, adamw_weight_decay_factor=1.0,
        warmup_iters=WARMUP_ITERS, min_lr_ratio=MIN_LR_RATIO, clip_grad=CLIP_GRAD,
        outer_lr=0.7 if workers == 1 else 1.0, outer_momentum=0.6 if workers == 1 else 0.9,
        ef_form=EF_FORM, ef_beta=EF_BETA, statistical_rounding=STATISTICAL_ROUNDING,
        train_iters=math.ceil(TOKENS_PER_PARAMETER * parameters / (global_batch * PAPER_SEQ_LENGTH)))


# -- --recipe paper: fill what the ds_config leaves out --------------------------------------------

def fill_ds_config(ds: dict, muloco: dict | None, preset: str, optimizer_flag: str | None, global_batch: int,
                   flags: dict[str, Any] | None = None) -> str:
    """Fill the recipe's settings the ds_config does not set (in place; `muloco` is the ds_config's
    muloco block or None for a data-parallel run) and return the table of what the run uses.
    `flags` maps settings to the command-line values that will override both (None = not given)."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    optimizer_block = ds.setdefault("optimizer", {})
    optimizer = (optimizer_flag or optimizer_block.get("type") or "adamw").lower()
    optimizer_block.setdefault("type", optimizer)
    workers = int((muloco or {}).get("workers", 1))
    recipe = paper_recipe(preset, workers, global_batch, optimizer)
    blocks = {"optimizer.params": optimizer_block.setdefault("params", {}),
              "scheduler.params": ds.setdefault("scheduler", {}).setdefault("params", {}), "": ds}
    compression = (muloco or {}).get("compression", {})
    if muloco is not None:
        blocks["muloco"] = muloco
        blocks["muloco.compression"] = compression
    applies = {"muloco.compression.ef_form": bool(compression.get("error_feedback")),
               "muloco.compression.ef_beta": bool(compression.get("error_feedback")),
               "muloco.compression.statistical_rounding": compression.get("method") == "statistical"}
    if "optimizer.params.lr" not in flags and "lr" not in blocks["optimizer.params"] and recipe.inner_lr is None:
        raise ConfigError(f"--recipe paper: {unpublished_lr(optimizer)} ({preset}, {optimizer}, K={workers}, "
                          f"B={global_batch}); give --lr or the ds_config's optimizer.params.lr")
    lines = [f"recipe paper for {preset}, {optimizer} inner, K={workers}, B={global_batch}:",
             f"  {'setting':44} {'value':>12}  source"]
    for setting, value, why in recipe.rows():
        block_name, _, key = setting.rpartition(".")
        if block_name not in blocks or not applies.get(setting, True) or (
                optimizer == "adamw" and key.startswith("adamw_")):
            continue  # no outer loop, no error feedback, no statistical quantizer, or no separate AdamW group
        block = blocks[block_name]
        if key not in block and value is not None:
            block[key] = value
            source = f"recipe: {why}"
        else:
            source = "ds_config"
        if setting in flags:
            shown, source = flags[setting], "flag"
        else:
            shown = block[key]
        if shown != value and not source.startswith("recipe"):
            source += f" (recipe: {why})" if value is None else f" (recipe: {value}; {why})"
        lines.append(f"  {setting:44} {shown!s:>12}  {source}")
    return "\n".join(lines)


# -- the shipped GPU configs ------------------------------------------------------------------------

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


def gpu_ds_config(c: ShippedConfig) -> dict:
    r = paper_recipe(c.preset, c.workers or 1, c.global_batch, c.optimizer)
    if (r.inner_lr is None) == (c.unpublished_lr is None):
        raise ValueError(f"{c.name}: give an lr exactly where the paper publishes none")
    params: dict[str, Any] = {"lr": r.inner_lr or c.unpublished_lr, "weight_decay": r.weight_decay,
                              "betas": [0.9, 0.99], "eps": 1e-8}
    if c.optimizer == "muon":
        params.update(momentum=0.9, nesterov=False, ns_schedule="paper", ns_dtype="bfloat16",
                      lr_scaling="spectral_norm", adamw_lr_factor=r.adamw_lr_factor,
                      adamw_weight_decay_factor=r.adamw_weight_decay_factor)
    notes = {"model": c.preset, "inner_optimizer": c.optimizer, "global_batch": c.global_batch,
             "generated_by": "python -m trainer.recipe --write"}
    if c.unpublished_lr is not None:
        notes["not_from_the_paper"] = {"optimizer.params.lr": f"{unpublished_lr(c.optimizer)}; {c.unpublished_lr} is this "
                                                              "trainer's choice, tune it"}
    config = {
        "recipe": {"name": "paper", **notes},
        "layout": {"tensor": c.tensor, "pipeline": c.pipeline, "data": c.data},
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.accumulation,
        "optimizer": {"type": c.optimizer, "params": params},
        "scheduler": {"params": {"warmup_iters": r.warmup_iters, "min_lr_ratio": r.min_lr_ratio,
                                 "train_iters": r.train_iters}},
        "gradient_clipping": r.clip_grad,
        "bf16": {"enabled": True},
        "steps_per_print": 1000000,
    }
    if c.workers is not None:
        # The paper's runs exchange uncompressed pseudogradients; H = 30 is this trainer's default.
        config["muloco"] = {"workers": c.workers, "sync_interval": 30, "outer_lr": r.outer_lr,
                            "outer_momentum": r.outer_momentum, "nesterov": True,
                            "compression": {"method": "none"}, "collective": c.collective}
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="print the paper's recipe, or regenerate the GPU ds_configs from it")
    p.add_argument("--write", action="store_true", help="rewrite ds_configs/gpu_*.json from GPU_CONFIGS")
    p.add_argument("--model", choices=sorted(_BASE_WEIGHT_DECAY))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    args = p.parse_args(argv)
    if args.write:
        root = Path(__file__).resolve().parents[1] / "ds_configs"
        for c in GPU_CONFIGS:
            (root / f"{c.name}.json").write_text(json.dumps(gpu_ds_config(c), indent=2) + "\n")
            print(f"wrote ds_configs/{c.name}.json")
        return 0
    if args.model is None or args.global_batch is None:
        p.error("give --model and --global-batch (or --write)")
    for setting, value, why in paper_recipe(args.model, args.workers, args.global_batch, args.optimizer).rows():
        print(f"{setting:44} {value!s:>12}  {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
