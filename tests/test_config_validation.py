"""Every configuration value is checked for type and range before any collective (the ds_config by
the one loader, muloco/core/typed_json.py; the flags by RunConfig), and a bad one gives one
`configuration error:` line naming it: a ds_config value by its dotted path, a flag by its name."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import build_parser, resolve
from trainer.ds_config import DsConfig
from muloco.diloco.elastic_config import LIGHTHOUSE_ENV
from muloco.core.errors import ConfigError
from trainer.optim.config import AdamWParams
from trainer.optim.muon import MuonConfig
from trainer.pretrain import STARTUP_ERRORS, checked_config
from tools.trainer_runs import free_port

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
    (GOOD, ["--micro-batch-size", "0"], r"--micro-batch-size must be >= 1, got 0"),
    (_with("train_micro_batch_size_per_gpu", 0), [], r"train_micro_batch_size_per_gpu must be >= 1, got 0"),
    (GOOD, ["--train-iters", "0"], r"--train-iters must be >= 1, got 0"),
    (GOOD, ["--log-interval", "0"], r"--log-interval must be >= 1, got 0"),
    (GOOD, ["--startup-timeout-s", "0"], r"--startup-timeout-s must be > 0, got 0\.0"),
    (GOOD, ["--startup-timeout-s", "nan"], r"--startup-timeout-s must be a finite number, got nan"),
    (_with("muloco.workers", "2"), [], r"muloco\.workers must be an integer, got '2'"),
    (_with("muloco.workers", True), [], r"muloco\.workers must be an integer, got True"),
    (_with("muloco.sync_interval", 2.5), [], r"muloco\.sync_interval must be an integer, got 2\.5"),
    (_with("muloco.outer_lr", float("nan")), [], r"muloco\.outer_lr must be a finite number, got nan"),
    (_with("muloco.compression.error_feedback", "yes"), [],
     r"muloco\.compression\.error_feedback must be a boolean, got 'yes'"),
    (_with("muloco.compression.bits", 3), [], r"muloco\.compression\.bits must be one of 2, 4, 8, got 3"),
    (_with("gradient_accumulation_steps", "4"), [], r"gradient_accumulation_steps must be an integer, got '4'"),
    (_with("gradient_accumulation_steps", 0), [], r"gradient_accumulation_steps must be >= 1, got 0"),
    (_with("scheduler.params.warmup", 10), [], r"scheduler\.params\.warmup is not a known key: did you mean warmup_iters\?"),
    (_with("scheduler.params.min_lr_ratio", 2.0), [], r"scheduler\.params\.min_lr_ratio must be in \[0, 1\], got 2\.0"),
    (_with("scheduler.type", "OneCycle"), [], r"scheduler\.type must be one of 'WarmupCosine' or null, got 'OneCycle'"),
    (_with("optimizer.type", "sgd"), [], r"optimizer\.type must be one of 'adamw', 'muon', got 'sgd'"),
    (_with("optimizer.params.lr", "0.02"), [], r"optimizer\.params\.lr must be a number, got '0\.02'"),
    (_with("optimizer.params.betas", [0.9]), [], r"optimizer\.params\.betas must be a list of 2, got \[0\.9\]"),
    (_with("optimizer.params.betas", [0.9, 1.5]), [], r"optimizer\.params\.betas must be in \[0, 1\), got \[0\.9, 1\.5\]"),
    (_with("optimizer.params.ns_steps", 0), [], r"optimizer\.params\.ns_steps must be >= 1, got 0"),
    (_with("optimizer.params.momentum", 1.5), [], r"optimizer\.params\.momentum must be in \[0, 1\), got 1\.5"),
    (_with("optimizer.params.ns_dtype", "float16"), [],
     r"optimizer\.params\.ns_dtype must be one of 'float32', 'bfloat16', got 'float16'"),
    (_with("optimizer.params.lr_scaling", "big"), [],
     r"optimizer\.params\.lr_scaling must be one of 'spectral_norm', 'match_rms_adamw', 'torch_original', 'none', "
     r"got 'big'"),
    (_with("optimizer.params.ns_schedule", []), [], r"optimizer\.params\.ns_schedule must hold at least one"),
    (_with("bf16.enabled", "true"), [], r"bf16\.enabled must be a boolean, got 'true'"),
    (_with("gradient_clipping", -1.0), [], r"gradient_clipping must be >= 0, got -1\.0"),
    (_with("fp16", {"enabled": True}), [],
     r'fp16 is not supported: the trainer keeps fp32 master weights.* use \{"bf16": \{"enabled": true\}\} on a GPU, '
     r"or neither \(fp32\)"),
    (_with("muloco.streaming.fragments", 11), [],
     r"muloco\.streaming\.fragments \(11\) cannot exceed sync_interval \(10\)"),
    (GOOD, ["--eval-iters", "0"], r"--eval-iters must be >= 1, got 0"),
    (GOOD, ["--save-interval", "0"], r"--save-interval must be >= 1, got 0"),
    (GOOD, ["--lr", "0"], r"--lr must be > 0, got 0\.0"),
    (GOOD, ["--seq-length", "0"], r"--seq-length must be >= 1, got 0"),
    (GOOD, ["--global-batch-size", "12"], r"--global-batch-size 12 is not a positive multiple of micro-batch-size x D x K "
                                          r"= 4 x 1 x 2"),
    # Non-finite numbers (JSON's NaN and Infinity, which Python's json reads).
    (_with("optimizer.params.eps", math.inf), [], r"optimizer\.params\.eps must be a finite number, got inf"),
    (_with("optimizer.params.lr", math.inf), [], r"optimizer\.params\.lr must be a finite number, got inf"),
    (_with("muloco.sync_timeout_s", math.nan), [], r"muloco\.sync_timeout_s must be a finite number, got nan"),
    (_with("gradient_clipping", math.nan), [], r"gradient_clipping must be a finite number, got nan"),
    (_with("optimizer.params.ns_schedule", [[3.4, -4.7, math.inf]]), [],
     r"optimizer\.params\.ns_schedule\[0\]\[2\] must be a finite number, got inf"),
    # Ranges.
    (_with("muloco.max_norm_ratio", -1), [], r"muloco\.max_norm_ratio must be > 1, got -1"),
    (_with("muloco.max_norm_ratio", 1.0), [], r"muloco\.max_norm_ratio must be > 1, got 1\.0"),
    (_with("muloco.outer_momentum", 1.0), [], r"muloco\.outer_momentum must be in \[0, 1\), got 1\.0"),
    (_with("muloco.streaming.mix_alpha", 1.0), [], r"muloco\.streaming\.mix_alpha must be in \[0, 1\), got 1\.0"),
    (_with("muloco.streaming.overlap_steps", -1), [], r"muloco\.streaming\.overlap_steps must be >= 0, got -1"),
    (_with("muloco.compression.topk_fraction", 0), [], r"muloco\.compression\.topk_fraction must be in \(0, 1\], got 0"),
    (_with("muloco.compression.ef_beta", 2), [], r"muloco\.compression\.ef_beta must be in \[0, 1\], got 2"),
    (_with("muloco.compression.zstd_level", 23), [], r"muloco\.compression\.zstd_level must be in \[1, 22\], got 23"),
    (_with("muloco.link", {"bandwidth_gbit_s": 0}), [], r"muloco\.link\.bandwidth_gbit_s must be > 0, got 0"),
    (_with("muloco.link", {"latency_ms": 5}), [], r"muloco\.link\.bandwidth_gbit_s is required"),
    (_with("muloco.elastic", {"lighthouse": "http://h:1", "quorum_timeout_s": 0}), ["--worker-id", "0"],
     r"muloco\.elastic\.quorum_timeout_s must be > 0, got 0"),
    (_with("muloco.elastic", {"lighthouse": "http://h:1", "max_attempts": 0}), ["--worker-id", "0"],
     r"muloco\.elastic\.max_attempts must be >= 1, got 0"),
    (_with("optimizer.params.weight_decay", -0.1), [], r"optimizer\.params\.weight_decay must be >= 0, got -0\.1"),
    (_with("optimizer.params.adamw_lr_factor", 0), [], r"optimizer\.params\.adamw_lr_factor must be > 0, got 0"),
    (_with("scheduler.params.warmup_iters", -1), [], r"scheduler\.params\.warmup_iters must be >= 0, got -1"),
    (_with("train_batch_size", 0), [], r"train_batch_size must be >= 1, got 0"),
    # Types and choices.
    ({**GOOD, "recipe": "x"}, [], r"recipe must be an object or null, got 'x'"),
    ({**GOOD, "layout": 5}, [], r"layout must be an object or null, got 5"),
    ({**GOOD, "optimizer": []}, [], r"optimizer must be an object, got \[\]"),
    ({**GOOD, "muloco": True}, [], r"muloco must be an object or null, got True"),
    ({**GOOD, "steps_per_print": "x"}, [], r"steps_per_print must be an integer, got 'x'"),
    ({**GOOD, "flops_profiler": "on"}, [], r"flops_profiler must be an object or null, got 'on'"),
    (_with("muloco.auth", "off"), [], r"muloco\.auth must be an object or one of 'none', got 'off'"),
    (_with("muloco.auth", {"key_file": 5}), [], r"muloco\.auth\.key_file must be a string, got 5"),
    (_with("muloco.compression.method", "zip"), [],
     r"muloco\.compression\.method must be one of 'none', 'statistical', 'linear', 'topk', got 'zip'"),
    (_with("optimizer.params.ns_schedule", "fast"), [],
     r"optimizer\.params\.ns_schedule must be one of 'paper', 'keller' or a list, got 'fast'"),
    (_with("optimizer.params.ns_schedule", [[1, 2]]), [], r"optimizer\.params\.ns_schedule\[0\] must be a list of 3, got \[1, 2\]"),
    ({**GOOD, "foo": 1}, [], r"foo is not a known key \(known: train_micro_batch_size_per_gpu, "),
    ("[]", [], r"ds_config .*ds\.json must hold a JSON object$"),
    ('{"optimizer": ', [], r"ds_config .*ds\.json is not valid JSON: Expecting value: line 1 column 15"),
    ('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}', [],
     r"ds_config .*ds\.json: key 'train_micro_batch_size_per_gpu' is given twice in one object"),
    # Unsupported combinations, refused by name with what to use instead.
    (_with("bf16.enabled", True), [], r"bf16\.enabled needs an accelerator: on CPU remove the bf16 block"),
    (_with("muloco.outer_backend", "nccl"), [], r"muloco\.outer_backend 'nccl' needs an accelerator: use 'gloo'"),
    ({**GOOD, "zero_optimization": {"stage": 3}}, [],
     r"zero_optimization is not supported: .*which ZeRO \(any stage\) would partition: remove the block \(to fit "
     r"a larger model use tensor or pipeline parallelism"),
    ({**GOOD, "amp": {"enabled": True}}, [], r"amp is not supported: use the bf16 block"),
    (_with("muloco.elastic", {}), ["--worker-id", "0"],
     r"elastic workers need the lighthouse's address: muloco\.elastic\.lighthouse or \$TORCHFT_LIGHTHOUSE$"),
    (_with("muloco.workers", 3), [], r"world size 2 is not divisible by workers x pipeline x tensor = 3 x 1 x 1 = 3"),
    ({**GOOD, "layout": {"tensor": 2}}, [], r"the ds_config was planned for another layout: tensor 2 planned, 1 in "
                                            r"this run"),
    ({**GOOD, "recipe": {"model": "15b"}}, [], r"the ds_config's batch, weight decay and steps were made for --model "
                                               r"15b \(its recipe block\), not tiny"),
], ids=lambda v: None)
def test_bad_value_is_named(tmp_path, monkeypatch, ds, flags, message):
    """Through the entry point's start-up checks: one `configuration error:` line naming the problem."""
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    args = build_parser().parse_args(["--ds_config", str(path), "--vocab-size", "64", *flags])
    with pytest.raises(STARTUP_ERRORS) as raised:
        checked_config(args, world_size=2)
    line = f"configuration error: {raised.value}"
    assert "\n" not in line and re.match(f"configuration error: {message}", line), line


@pytest.mark.parametrize("ds, message", [
    ({**GOOD, "muloko": {}}, "muloko is not a known key: did you mean muloco?"),
    ({**GOOD, "optimiser": {}}, "optimiser is not a known key: did you mean optimizer?"),
    ({"muloco": {"sync_intreval": 30}}, "muloco.sync_intreval is not a known key: did you mean sync_interval?"),
])
def test_a_misspelt_key_names_the_closest_known_one(tmp_path, ds, message):
    """A misspelt block must not silently train another method (here: the data-parallel baseline)."""
    with pytest.raises(ConfigError) as raised:
        _resolve(tmp_path, ds)
    assert str(raised.value) == message


def test_every_problem_is_named_in_one_message_in_file_order(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "4", "muloco": {"workers": 0, "colective": "all_gather",
                                                            "compression": {"bits": 3}},
          "optimizer": {"type": "muon", "params": {"lr": -1, "ns_dtype": "fp8"}}, "zero_optimization": {}}
    with pytest.raises(ConfigError) as raised:
        _resolve(tmp_path, ds)
    assert str(raised.value).split("; ") == [
        "train_micro_batch_size_per_gpu must be an integer, got '4'",
        "muloco.workers must be >= 1, got 0",
        "muloco.colective is not a known key: did you mean collective?",
        "muloco.compression.bits must be one of 2, 4, 8, got 3",
        "optimizer.params.lr must be > 0, got -1",
        "optimizer.params.ns_dtype must be one of 'float32', 'bfloat16', got 'fp8'",
        "zero_optimization is not supported: the inner optimizer needs each parameter's whole fp32 tensor (Muon "
        "orthogonalizes whole matrices), which ZeRO (any stage) would partition: remove the block (to fit a larger "
        "model use tensor or pipeline parallelism: tools/plan.py --list-layouts)"]


def test_flag_problems_are_named_by_the_flag_all_at_once(tmp_path):
    with pytest.raises(ConfigError) as raised:
        _resolve(tmp_path, GOOD, "--log-interval", "0", "--seed", "-1", "--exit-interval", "3")
    assert str(raised.value) == ("--seed must be >= 0, got -1; --log-interval must be >= 1, got 0; "
                                 "--exit-interval save a checkpoint before exiting: give --save DIR")


def test_adamw_rejects_muon_params(tmp_path):
    ds = _with("optimizer.type", "adamw")
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.momentum is only for type muon; "
                                          r"optimizer\.params\.nesterov is only for type muon"):
        _resolve(tmp_path, ds)
    # The --optimizer flag switches the type and drops the params only the other type takes.
    assert _resolve(tmp_path, GOOD, "--optimizer", "adamw").optimizer.params == AdamWParams(
        lr=0.02, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)


def test_optimizer_type_is_read_in_any_case(tmp_path):
    assert _resolve(tmp_path, _with("optimizer.type", "Muon")).optimizer.type == "muon"


def test_deepspeed_keys_pass_through_and_nothing_else(tmp_path):
    config = _resolve(tmp_path, {**GOOD, "wall_clock_breakdown": True})
    assert config.ds_config == {"steps_per_print": 1000000, "wall_clock_breakdown": True}
    assert set(DsConfig.DEEPSPEED_KEYS) <= {f.name for f in dataclasses.fields(DsConfig)}


def test_one_muon_config_from_the_ds_config_to_newton_schulz(tmp_path):
    ds = _with("optimizer.params.ns_steps", 7)
    ds["optimizer"]["params"].update(ns_dtype="bfloat16", nesterov=True, momentum=0.95)
    config = _resolve(tmp_path, ds, "--lr", "0.05")
    muon = config.optimizer.params  # the MuonConfig every Muon step reads
    assert isinstance(muon, MuonConfig)
    assert (muon.ns_steps, muon.ns_dtype, muon.nesterov, muon.momentum) == (7, "bfloat16", True, 0.95)
    assert (muon.lr, muon.weight_decay) == (0.05, 0.1)
    # --optimizer adamw drops the Muon params; the configs are frozen.
    assert not isinstance(_resolve(tmp_path, ds, "--optimizer", "adamw").optimizer.params, MuonConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.optimizer.params.lr = 1.0
    assert config.muloco.sync_interval == GOOD["muloco"]["sync_interval"]


def test_explicit_flags_win_over_the_ds_config(tmp_path):
    config = _resolve(tmp_path, GOOD, "--micro-batch-size", "2", "--train-iters", "7", "--clip-grad", "0.5")
    assert (config.batch.micro_batch_size, config.schedule.train_iters, config.clip_grad) == (2, 7, 0.5)


def test_no_final_sync_sets_the_muloco_block_and_needs_one(tmp_path):
    assert _resolve(tmp_path, GOOD).muloco.final_sync is True
    assert _resolve(tmp_path, GOOD, "--no-final-sync").muloco.final_sync is False
    data_parallel = {k: v for k, v in GOOD.items() if k != "muloco"}
    with pytest.raises(ConfigError, match="--no-final-sync: the ds_config has no muloco block"):
        _resolve(tmp_path, data_parallel, "--no-final-sync")


@pytest.mark.parametrize("ds, flags, line", [
    (_with("muloco.workers", "2"), [], "configuration error: muloco.workers must be an integer, got '2'"),
    (GOOD, ["--distributed-backend", "nccl"],  # refused before the process group is made
     "configuration error: --distributed-backend nccl needs an accelerator: use gloo on CPU"),
], ids=["bad value", "nccl on CPU"])
@pytest.mark.launch
def test_entry_point_prints_one_configuration_error_line(tmp_path, ds, flags, line):
    """A world of one through the real entry point: exit 2, one line, nothing written."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(ROOT / "trainer" / "pretrain.py"), "--ds_config", str(path),
                             "--vocab-size", "64", "--data-path", str(tmp_path / "none"),
                             "--run-dir", str(tmp_path / "run"), *flags],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in result.stderr.splitlines() if "configuration error" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert lines == [line], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_megatron_deepspeed_spellings_are_taken_and_abbreviations_are_not():
    """`--deepspeed --deepspeed_config X` (DeepSpeed's and Megatron-DeepSpeed's habit) parses; argparse's
    prefix matching took `--deepspeed` for `--deepspeed_config`, and would take `--seq-len` for `--seq-length`."""
    args = build_parser().parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.ds_config) == (True, "ds.json")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ds_config", "ds.json", "--seq-len", "64"])
