"""trainer/recipe.py against the paper's published numbers, the shipped GPU ds_configs against the
recipe, `--recipe paper` filling a ds_config, the ds_config layout check, and every GPU config's
layout fitting an 80 GB GPU in the planner."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from tools import plan as planner
from tools.planning.plan import make_plan
from trainer.config import CheckpointArgs, build_parser, resolve
from muloco.core.errors import ConfigError
from trainer.model.presets import PRESETS, parameter_count
from tools.write_gpu_configs import GPU_CONFIGS, gpu_ds_config
from trainer.recipe import PAPER_VOCAB, paper_recipe

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


@pytest.mark.parametrize("preset, workers, batch, optimizer, weight_decay, lr", [
    ("15b", 16, 4096, "muon", 5e-5, None),  # the paper's 15B K=16 run; no published inner lr
    ("3.1b", 16, 2048, "muon", 2.5e-4, 0.015625),  # MuLoCo K=16
    ("3.1b", 16, 1024, "adamw", 1.25e-4, 0.000691),  # DiLoCo K=16
    ("150m", 1, 512, "muon", 0.01, None),  # the base weight decays at B/K = 512
    ("150m", 1, 512, "adamw", 0.001, None),
    ("914m", 4, 1024, "adamw", 0.005, None),
])
def test_published_points(preset, workers, batch, optimizer, weight_decay, lr):
    r = paper_recipe(preset, workers, batch, optimizer)
    assert r.weight_decay == pytest.approx(weight_decay, rel=1e-9)
    assert r.inner_lr == lr
    k1_momentum = 0.8 if optimizer == "adamw" else 0.6  # the authors' DiLoCo / MuLoCo K=1 points
    assert (r.outer_lr, r.outer_momentum) == ((0.7, k1_momentum) if workers == 1 else (1.0, 0.9))
    assert (r.adamw_lr_factor, r.adamw_weight_decay_factor) == (1.0, 1.0)
    assert (r.warmup_iters, r.min_lr_ratio, r.clip_grad, r.ef_beta) == (500, 0.1, 1.0, 0.9)
    assert (r.ef_form, r.statistical_rounding) == ("paper", "paper")  # the official code's forms
    tokens = r.train_iters * batch * 2048
    assert 20 <= tokens / parameter_count(PRESETS[preset], PAPER_VOCAB) < 20 + batch * 2048 / 1e8


def test_no_recipe_for_the_tiny_model():
    with pytest.raises(ConfigError, match="no recipe for model 'tiny'"):
        paper_recipe("tiny", 1, 8, "muon")


def test_every_gpu_config_is_the_recipes_output():
    shipped = {p.stem for p in DS_CONFIGS.glob("gpu_*.json")}
    assert shipped == {c.name for c in GPU_CONFIGS}
    for c in GPU_CONFIGS:
        assert json.loads((DS_CONFIGS / f"{c.name}.json").read_text()) == gpu_ds_config(c), \
            f"{c.name}.json differs from the recipe: run python tools/write_gpu_configs.py"


def test_the_15b_config_is_the_papers_run():
    ds = json.loads((DS_CONFIGS / "gpu_15b_muloco_k16.json").read_text())
    layout, muloco = ds["layout"], ds["muloco"]
    batch = muloco["workers"] * ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * layout["data"]
    assert (batch, muloco["workers"], muloco["compression"]["method"]) == (4096, 16, "none")
    assert ds["optimizer"]["params"]["weight_decay"] == 5e-5
    assert "optimizer.params.lr" in ds["recipe"]["not_from_the_paper"]  # says so, instead of claiming it


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=[c.name for c in GPU_CONFIGS])
def test_gpu_config_layout_fits_80gb_and_resolves(config):
    path = DS_CONFIGS / f"{config.name}.json"
    plan = make_plan(planner.inputs_from_args(planner.build_parser().parse_args(
        ["--model", config.preset, "--ds_config", str(path)])))
    assert (plan.inputs.sizes.tensor, plan.inputs.sizes.pipeline, plan.inputs.sizes.data) == \
        (config.tensor, config.pipeline, config.data)
    assert plan.inputs.global_batch == config.global_batch and plan.fits
    world = (config.workers or 1) * config.data * config.pipeline * config.tensor
    run = resolve(build_parser().parse_args([
        "--ds_config", str(path), "--model", config.preset, "--data-path", "x",
        "--tensor-model-parallel-size", str(config.tensor), "--pipeline-model-parallel-size", str(config.pipeline)]),
        world)
    assert run.batch.global_batch == config.global_batch
    assert run.model.arch == "paper"


def _resolve(ds: dict, tmp_path, world: int, *flags: str):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return resolve(build_parser().parse_args(["--ds_config", str(path), "--data-path", "x", *flags]), world)


def test_with_use_checkpoint_args_the_config_is_checked_against_the_checkpoints_model(tmp_path):
    """The model is the checkpoint's then, whatever --model says (default tiny): a 150m checkpoint runs
    with the config made for 150m, and --recipe takes the 150m rules."""
    path = tmp_path / "ds.json"
    path.write_text((DS_CONFIGS / "gpu_150m_muloco_k1.json").read_text())

    def resolved(model, *flags):
        args = build_parser().parse_args(["--ds_config", str(path), "--data-path", "x", "--load", "ckpt",
                                          "--use-checkpoint-args", *flags])
        return resolve(args, 8, CheckpointArgs(model, 1000, None))

    checkpoint_150m = replace(PRESETS["150m"], seq_length=1024, num_query_groups=2)  # a variant of the preset
    assert resolved(checkpoint_150m).model == checkpoint_150m
    assert "150m" in resolved(checkpoint_150m, "--recipe", "paper").recipe_table
    with pytest.raises(ConfigError, match=r"made for --model 150m \(its recipe block\), not the --load checkpoint's "
                                          r"model \(--use-checkpoint-args\), which is preset 416m \(num_layers 12, "):
        resolved(PRESETS["416m"])
    other = replace(PRESETS["150m"], hidden_size=384)
    with pytest.raises(ConfigError, match=r"not the --load checkpoint's model .*, which is no preset \(num_layers 6, "
                                          r"hidden_size 384, num_attention_heads 4, ffn_hidden_size 1408, kv_channels "
                                          r"128\)"):
        resolved(other)
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "recipe"}))
    with pytest.raises(ConfigError, match=r"--recipe paper has rules for the presets only, and the model is the --load "
                                          r"checkpoint's model .*, which is no preset"):
        resolved(other, "--recipe", "paper")


def test_layout_mismatch_is_a_configuration_error(tmp_path):
    ds = json.loads((DS_CONFIGS / "gpu_3.1b_muloco_k16.json").read_text())
    with pytest.raises(ConfigError, match="tensor 2 planned, 1 in this run"):
        _resolve(ds, tmp_path, 16 * 8, "--model", "3.1b")
    with pytest.raises(ConfigError, match="data 4 planned, 2 in this run"):
        _resolve(ds, tmp_path, 16 * 4, "--model", "3.1b", "--tensor-model-parallel-size", "2")


def test_config_made_for_another_model_is_a_configuration_error(tmp_path):
    ds = json.loads((DS_CONFIGS / "gpu_15b_muloco_k16.json").read_text())
    with pytest.raises(ConfigError, match="made for --model 15b .* not 3.1b"):
        _resolve(ds, tmp_path, 512, "--model", "3.1b", "--tensor-model-parallel-size", "4",
                 "--pipeline-model-parallel-size", "2")


def test_recipe_flag_fills_what_the_config_leaves_out(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
          "optimizer": {"type": "muon", "params": {"weight_decay": 0.1}},
          "muloco": {"workers": 16, "compression": {"method": "statistical", "bits": 4, "error_feedback": True}}}
    run = _resolve(ds, tmp_path, 16 * 8, "--model", "3.1b", "--recipe", "paper")  # B = 16 x 2 x 8 x D 8 = 2048
    assert run.batch.global_batch == 2048
    assert run.optimizer.params.lr == 0.015625 and run.optimizer.params.weight_decay == 0.1  # the config's own value wins
    assert (run.optimizer.params.adamw_lr_factor, run.optimizer.params.adamw_weight_decay_factor) == (1.0, 1.0)
    assert (run.schedule.warmup_iters, run.schedule.min_lr_ratio, run.clip_grad) == (500, 0.1, 1.0)
    assert run.schedule.train_iters == paper_recipe("3.1b", 16, 2048, "muon").train_iters
    assert (run.muloco.outer_lr, run.muloco.outer_momentum, run.muloco.compression.ef_beta) == (1.0, 0.9, 0.9)
    assert (run.muloco.compression.ef_form, run.muloco.compression.statistical_rounding) == ("paper", "paper")
    assert "weight_decay" in run.recipe_table and "recipe: 0.00025" in run.recipe_table
    # Where the paper publishes no lr, the run needs one from the config or the command line.
    ds["muloco"]["workers"] = 1
    with pytest.raises(ConfigError, match="publishes no muon inner lr"):
        _resolve(ds, tmp_path, 8, "--model", "3.1b", "--recipe", "paper")
    run = _resolve(ds, tmp_path, 8, "--model", "3.1b", "--recipe", "paper", "--lr", "0.02", "--train-iters", "5")
    assert (run.optimizer.params.lr, run.schedule.train_iters) == (0.02, 5)
    assert any(line.split()[:3] == ["scheduler.params.train_iters", "5", "flag"] for line in run.recipe_table.splitlines())
    assert math.isclose(_resolve(ds, tmp_path, 8, "--model", "3.1b", "--recipe", "paper", "--lr", "0.02")
                        .muloco.outer_lr, 0.7)


def test_recipe_sets_the_official_forms_only_where_they_apply(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
          "optimizer": {"type": "muon", "params": {"lr": 0.01}},
          "muloco": {"workers": 16, "compression": {"method": "linear", "bits": 4}}}
    run = _resolve(ds, tmp_path, 16 * 8, "--model", "3.1b", "--recipe", "paper")
    compression = run.muloco.compression  # no error feedback, no statistical quantizer: defaults, not in the table
    assert (compression.ef_form, compression.ef_beta, compression.statistical_rounding) == ("plain", 1.0, "centred")
    assert "ef_form" not in run.recipe_table and "statistical_rounding" not in run.recipe_table
    # The ds_config's own choice wins, and the table says what the recipe would have used.
    ds["muloco"]["compression"] = {"method": "statistical", "bits": 2, "error_feedback": True, "ef_form": "plain",
                                   "statistical_rounding": "centred"}
    run = _resolve(ds, tmp_path, 16 * 8, "--model", "3.1b", "--recipe", "paper")
    compression = run.muloco.compression
    assert (compression.ef_form, compression.ef_beta, compression.statistical_rounding) == ("plain", 0.9, "centred")
    assert any(line.split()[:3] == ["muloco.compression.ef_form", "plain", "ds_config"] and "recipe: paper" in line
               for line in run.recipe_table.splitlines())


def test_the_recipe_command_takes_the_trainers_batch_flag(capsys):
    from trainer.recipe import main

    for spelling in ("--global-batch-size", "--global-batch"):
        assert main(["--model", "15b", "--workers", "16", spelling, "4096"]) == 0
        printed = capsys.readouterr().out
        rows = paper_recipe("15b", 16, 4096, "muon").rows()
        assert len(printed.splitlines()) == len(rows) and all(row[0] in printed for row in rows)
