"""The paper's training recipe (MuLoCo, arXiv 2505.23725, and its official code) as code.

From (model preset, K workers, global batch B in sequences of 2048, inner optimizer):
- inner lr: only where the paper publishes one (`PUBLISHED_INNER_LRS`); elsewhere None, with the
  reason, and the user or the ds_config must give it: this module never invents a learning rate;
- weight decay: base(preset) x (B / K) / 512, i.e. scaled with the per-worker batch;
- AdamW-routed parameters (embeddings, head, 1-D) use the Muon group's lr and weight decay
  (factors 1.0);
- schedule: 500 warmup steps, cosine to 10% of the peak, global-norm clip 1.0;
- outer Nesterov SGD: K=1 lr 0.7 momentum 0.6 (DiLoCo, AdamW inner: 0.8), K>1 lr 1.0 momentum 0.9;
- the official error feedback, `e = 0.9 e + outer_lr delta` (ef_form "paper", beta 0.9), when a
  config compresses with error feedback, and the official statistical rounding `round(c/s + n/2)`
  when it uses the statistical quantizer;
- steps for 20 tokens per parameter (Chinchilla), counting embedding and head as the paper's
  preset names do (Llama-3 vocabulary, 128,256).

`--recipe paper` (trainer/config.py) fills whatever the ds_config leaves out and prints the table;
`python -m trainer.recipe --model 15b --workers 16 --global-batch-size 4096` prints the rules for one run.
The shipped GPU ds_configs are written from it by tools/write_gpu_configs.py (tests/test_recipe.py
checks every one against it).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from trainer.ds_config import DsConfig
from muloco.core.errors import ConfigError
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
            ("muloco.outer_momentum", self.outer_momentum, "K=1: 0.6 (AdamW inner: 0.8), K>1: 0.9 (Nesterov)"),
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


def _outer_momentum(workers: int, optimizer: str) -> float:
    """The authors' tuned outer momentum: 0.9 for K > 1; at K=1 0.6 for MuLoCo, 0.8 for DiLoCo."""
    if workers > 1:
        return 0.9
    return 0.8 if optimizer == "adamw" else 0.6


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
        outer_lr=0.7 if workers == 1 else 1.0, outer_momentum=_outer_momentum(workers, optimizer),
        ef_form=EF_FORM, ef_beta=EF_BETA, statistical_rounding=STATISTICAL_ROUNDING,
        train_iters=math.ceil(TOKENS_PER_PARAMETER * parameters / (global_batch * PAPER_SEQ_LENGTH)))


# -- --recipe paper: fill what the ds_config leaves out --------------------------------------------

def fill_ds_config(raw: dict, ds: DsConfig, preset: str, global_batch: int, flagged: set[str]) -> str:
    """Fill the recipe's settings the JSON `raw` (the ds_config with the flags written in, loaded as
    `ds`) does not set, in place, and return the table of what the run uses; `flagged` are the
    dotted paths the command line set."""
    optimizer, workers = ds.optimizer.type, ds.muloco.workers if ds.muloco is not None else 1
    recipe = paper_recipe(preset, workers, global_batch, optimizer)
    optimizer_block = raw.setdefault("optimizer", {})
    optimizer_block.setdefault("type", optimizer)
    blocks = {"optimizer.params": optimizer_block.setdefault("params", {}),
              "scheduler.params": raw.setdefault("scheduler", {}).setdefault("params", {}), "": raw}
    compression = ds.muloco.compression if ds.muloco is not None else None
    if ds.muloco is not None:
        blocks["muloco"] = raw["muloco"]
        blocks["muloco.compression"] = raw["muloco"].setdefault("compression", {})
    error_feedback = compression is not None and compression.error_feedback
    applies = {"muloco.compression.ef_form": error_feedback, "muloco.compression.ef_beta": error_feedback,
               "muloco.compression.statistical_rounding": compression is not None
               and compression.method == "statistical"}
    if "lr" not in blocks["optimizer.params"] and recipe.inner_lr is None:
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
            source = "flag" if setting in flagged else "ds_config"
        if block[key] != value and not source.startswith("recipe"):
            source += f" (recipe: {why})" if value is None else f" (recipe: {value}; {why})"
        lines.append(f"  {setting:44} {block[key]!s:>12}  {source}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="print the paper's recipe for one run")
    p.add_argument("--model", required=True, choices=sorted(_BASE_WEIGHT_DECAY))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=int, required=True,
                   help="B, sequences per inner step over all workers (the trainer's --global-batch-size)")
    p.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    args = p.parse_args(argv)
    for setting, value, why in paper_recipe(args.model, args.workers, args.global_batch, args.optimizer).rows():
        print(f"{setting:44} {value!s:>12}  {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
