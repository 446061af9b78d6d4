"""Every configuration value is checked for type and range in trainer/config.py, before any
collective, and a bad one gives one `configuration error:` line naming it."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import OptimizerConfig, build_parser, resolve
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GOOD = json.loads((ROOT / "ds_configs" / "cpu_tiny_muloco.json").read_text())


def _resolve(tmp_path, ds: dict, *flags: str, world: int = 2):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return resolve(build_parser().parse_args(["--ds_config", str(path), "--vocab-size", "64", *flags]), world)


def _with(path: str, value) -> dict:
    """GOOD with the value at dotted `path` replaced (a key that was not there is added)."""
    ds = json.loads(json.dumps(GOOD))
    *parents, last = path.split(".")
    node = ds
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return ds


@pytest.mark.parametrize("ds, flags, message", [
    (GOOD, ["--micro-batch-size", "0"], r"micro batch size .* must be >= 1, got 0"),
    (_with("train_micro_batch_size_per_gpu", 0), [], r"micro batch size .* must be >= 1, got 0"),
    (GOOD, ["--train-iters", "0"], r"train-iters must be >= 1, got 0"),
    (GOOD, ["--log-interval", "0"], r"log-interval must be >= 1, got 0"),
    (_with("muloco.workers", "2"), [], r"muloco\.workers must be an integer, got '2'"),
    (_with("muloco.sync_interval", 2.5), [], r"muloco\.sync_interval must be an integer, got 2\.5"),
    (_with("muloco.compression.error_feedback", "yes"), [], r"muloco\.compression\.error_feedback must be a boolean"),
    (_with("gradient_accumulation_steps", "4"), [], r"gradient_accumulation_steps must be an integer, got '4'"),
    (_with("gradient_accumulation_steps", 0), [], r"gradient_accumulation_steps must be >= 1, got 0"),
    (_with("scheduler.params.warmup", 10), [], r"unknown keys in scheduler\.params: \['warmup'\]"),
    (_with("scheduler.params.min_lr_ratio", 2.0), [], r"min-lr-ratio must be in \[0, 1\], got 2\.0"),
    (_with("optimizer.type", "sgd"), [], r'optimizer type must be "adamw" or "muon"'),
    (_with("optimizer.params.lr", "0.02"), [], r"optimizer\.params\.lr must be a number, got '0\.02'"),
    (_with("optimizer.params.betas", [0.9]), [], r"optimizer\.params\.betas must be a list of 2"),
    (_with("optimizer.params.ns_steps", 0), [], r"ns_steps|steps"),
    (_with("optimizer.params.momentum", 1.5), [], r"momentum must be in \[0, 1\)"),
    (_with("optimizer.params.ns_dtype", "float16"), [], r"ns_dtype"),
    (_with("optimizer.params.lr_scaling", "big"), [], r"lr_scaling"),
    (_with("bf16.enabled", "true"), [], r"bf16 must be"),
    (_with("gradient_clipping", -1.0), [], r"gradient clipping .* must be >= 0"),
    (GOOD, ["--eval-iters", "0"], r"eval-iters must be >= 1, got 0"),
    (GOOD, ["--save-interval", "0"], r"save-interval must be >= 1, got 0"),
    (GOOD, ["--lr", "0"], r"optimizer lr must be > 0, got 0"),
    (GOOD, ["--seq-length", "0"], r"--seq-length must be >= 1, got 0"),
], ids=lambda v: None)
def test_bad_value_is_named(tmp_path, ds, flags, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(tmp_path, ds, *flags)


def test_adamw_rejects_muon_params(tmp_path):
    ds = _with("optimizer.type", "adamw")
    with pytest.raises(ConfigError, match=r"\['momentum', 'lr_scaling', 'nesterov', 'ns_schedule'\]|are Muon's"):
        _resolve(tmp_path, ds)


def test_one_muon_config_from_the_ds_config_to_newton_schulz(tmp_path):
    ds = _with("optimizer.params.ns_steps", 7)
    ds["optimizer"]["params"].update(ns_dtype="bfloat16", nesterov=True, momentum=0.95)
    config = _resolve(tmp_path, ds, "--lr", "0.05")
    muon = config.optimizer.muon
    assert (muon.ns_steps, muon.ns_dtype, muon.nesterov, muon.momentum) == (7, "bfloat16", True, 0.95)
    assert (muon.lr, muon.weight_decay) == (config.optimizer.lr, config.optimizer.weight_decay) == (0.05, 0.1)
    # --optimizer adamw drops the Muon block; the configs are frozen (changed only by replace).
    assert _resolve(tmp_path, ds, "--optimizer", "adamw").optimizer.muon is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optimizer.lr = 1.0
    assert config.muloco.sync_interval == GOOD["muloco"]["sync_interval"]


def test_explicit_flags_win_over_the_ds_config(tmp_path):
    config = _resolve(tmp_path, GOOD, "--micro-batch-size", "2", "--train-iters", "7", "--clip-grad", "0.5")
    assert (config.batch.micro_batch_size, config.schedule.train_iters, config.schedule.clip_grad) == (2, 7, 0.5)
    assert OptimizerConfig.from_params("muon", {"lr": 0.1}).muon.lr == 0.1


def test_entry_point_prints_one_configuration_error_line(tmp_path):
    """A world of one through the real entry point: exit 2, one line, nothing written."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_with("muloco.workers", "2")))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533",
               PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(ROOT / "trainer" / "pretrain.py"), "--ds_config", str(path),
                             "--vocab-size", "64", "--data-path", str(tmp_path / "none"),
                             "--run-dir", str(tmp_path / "run")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in result.stderr.splitlines() if "configuration error" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert lines == ["configuration error: muloco.workers must be an integer, got '2'"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
