"""The method comparison's ds_configs (configs/compare/): each method of tools/compare/methods.py at
the paper's recipe (trainer/recipe.py) for the tiny shape, written by the same block builders as the
GPU catalogue (tools/write_gpu_configs.py).

    python tools/write_compare_configs.py      # rewrites configs/compare/*.json

The paper has no recipe for a model this small, so its smallest model's (150m) rules stand in: weight
decay base(150m) x (B/K) / 512, AdamW-routed factors 1.0, cosine to 10% and clip 1.0, the official
codec forms where a method compresses, and the outer (lr, momentum) the authors tuned. What the CPU
scale forces to differ is written into each config's `recipe.not_from_the_paper` (and tabled in
results/compare/README.md). tests/test_compare_configs.py checks every config against the recipe.
"""
from __future__ import annotations

import json


from tools.compare.methods import METHODS, MethodSpec
from tools.compare.protocol import CONFIG_DIR, LR_GRIDS, MODEL, Settings
from tools.write_gpu_configs import muloco_block, optimizer_block
from trainer.recipe import TOKENS_PER_PARAMETER, WARMUP_ITERS, WEIGHT_DECAY_BASE_BATCH, paper_recipe

COMMAND = "python tools/write_compare_configs.py"
RECIPE_PRESET = "150m"  # the paper's smallest model: its rules stand in for the tiny shape's


def not_from_the_paper(settings: Settings) -> dict[str, str]:
    return {
        "optimizer.params.lr": "tuned per method by the comparison on its selection seed (this is the grid's "
                               "centre); the paper publishes no lr for this model",
        "optimizer.params.weight_decay": f"the rule of the paper's smallest model ({RECIPE_PRESET}): its base x "
                                         f"(B/K)/{WEIGHT_DECAY_BASE_BATCH}, B in sequences of 128 tokens, not 2048",
        "scheduler.params.train_iters": f"{settings.steps} steps, the CPU budget (the recipe's "
                                        f"{TOKENS_PER_PARAMETER} tokens per parameter would be ~18,000)",
        "scheduler.params.warmup_iters": f"{settings.warmup} steps (the paper's {WARMUP_ITERS} exceed the whole run)",
    }


def compare_ds_config(m: MethodSpec, settings: Settings = Settings()) -> dict:
    B, workers = settings.global_batch, m.workers or 1
    r = paper_recipe(RECIPE_PRESET, workers, B, m.optimizer)
    config = {
        "recipe": {"name": "paper", "model": MODEL, "inner_optimizer": m.optimizer, "global_batch": B,
                   "generated_by": COMMAND, "not_from_the_paper": not_from_the_paper(settings)},
        "train_micro_batch_size_per_gpu": B // workers,  # B/K per worker in one micro-batch (D = 1)
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer_block(r, LR_GRIDS[m.optimizer].points[1], ns_dtype="float32"),
        "scheduler": {"params": {"warmup_iters": settings.warmup, "min_lr_ratio": r.min_lr_ratio,
                                 "train_iters": settings.steps}},
        "gradient_clipping": r.clip_grad,
        "steps_per_print": 1000000,
    }
    if m.workers is not None:
        config["muloco"] = muloco_block(r, settings.sync_interval, m.compression or {"method": "none"}, m.collective)
    return config


def main() -> int:
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    for stale in set(CONFIG_DIR.glob("*.json")) - {CONFIG_DIR / f"{m.name}.json" for m in METHODS}:
        stale.unlink()
        print(f"removed {stale.relative_to(CONFIG_DIR.parents[1])} (no such method)")
    for m in METHODS:
        (CONFIG_DIR / f"{m.name}.json").write_text(json.dumps(compare_ds_config(m), indent=2) + "\n")
        print(f"wrote configs/compare/{m.name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
