"""Every shipped ds_config parses into a consistent run configuration."""
import json
from pathlib import Path

import pytest

from trainer.config import build_parser, resolve
from trainer.engine import deepspeed_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json"))


def _resolve(path: Path, world: int, extra=()):
    args = build_parser().parse_args(["--ds_config", str(path), "--data-path", "x", *extra])
    return resolve(args, world)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_resolves(path):
    raw = json.loads(path.read_text())
    workers = raw.get("muloco", {}).get("workers", 1)
    # GPU configs state the layout they were planned for (and their model); CPU ones run at any D.
    layout = raw.get("layout", {"tensor": 1, "pipeline": 1, "data": 2})
    model = raw.get("recipe", {}).get("model", "tiny")
    elastic = "elastic" in raw.get("muloco", {})  # one job per worker: its world is one worker's ranks
    world = (1 if elastic else workers) * layout["data"] * layout["pipeline"] * layout["tensor"]
    config = _resolve(path, world=world,
                      extra=["--model", model, "--tensor-model-parallel-size", str(layout["tensor"]),
                             "--pipeline-model-parallel-size", str(layout["pipeline"]),
                             *(["--worker-id", "0"] if elastic else [])])
    assert config.batch.workers == workers
    assert config.batch.data_parallel == layout["data"]
    # DeepSpeed's own batch check holds for one worker's ranks.
    ds = deepspeed_config(config.ds_config, config.batch)
    assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
                                      * layout["data"])
    assert config.batch.global_batch == workers * ds["train_batch_size"]
    # Blocks the trainer owns never reach DeepSpeed.
    assert not {"muloco", "optimizer", "scheduler", "bf16", "layout", "recipe"} & set(ds)
    assert config.optimizer.type == raw["optimizer"]["type"]
    assert config.bf16 == path.stem.startswith("gpu_")
    if config.muloco is not None:
        assert config.muloco.sync_interval >= 1 and config.muloco.outer_lr > 0


def test_diloco_and_muloco_demo_configs_differ_only_in_the_inner_optimizer():
    root = CONFIGS[0].parent
    muloco = json.loads((root / "cpu_tiny_muloco.json").read_text())
    diloco = json.loads((root / "cpu_tiny_diloco.json").read_text())
    assert muloco.pop("optimizer")["type"] == "muon" and diloco.pop("optimizer")["type"] == "adamw"
    assert muloco == diloco


def test_bad_muloco_block_is_named(tmp_path):
    bad = json.loads((CONFIGS[0].parent / "cpu_tiny_muloco.json").read_text())
    bad["muloco"]["colective"] = "all_gather"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="colective"):
        _resolve(path, world=2)
    bad["muloco"].pop("colective")
    bad["muloco"]["compression"]["bits"] = 3
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="bits"):
        _resolve(path, world=2)


def test_global_batch_flag_sets_accumulation(tmp_path):
    config = _resolve(CONFIGS[0].parent / "cpu_tiny_muloco.json", world=4, extra=["--global-batch-size", "32"])
    # B = 32 over K=2 workers x D=2 ranks x micro 4 -> 2 accumulation steps per rank.
    assert config.batch.gradient_accumulation_steps == 2
    assert config.batch.global_batch == 32
