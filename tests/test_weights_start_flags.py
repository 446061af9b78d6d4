"""The trainer's flags for starting from weights: --finetune from one of its own checkpoints,
--no-load-optim/--no-load-rng, --use-checkpoint-args (from an import of tests/hf_models.py: the shape,
vocabulary and tokenizer it takes, the saves that carry that tokenizer on), and their refusals."""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _ckpt_runs import check, launch, reference_checkpoint
from hf_models import ROWS, T2P2
from test_tokenizer import hf_tokenizer_dir  # noqa: F401 - the session fixture hf_models needs

from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from tokenizer.interface import load_tokenizer
from trainer.checkpoint import CheckpointError, CheckpointReader
from trainer.checkpoint.checkpointer import check_weights_start
from trainer.checkpoint.format import sha256_of

pytestmark = pytest.mark.timeout(1800)


@pytest.mark.launch
def test_finetune_then_resume_without_optimizer_and_rng(base, tmp_path):
    """--finetune from the trainer's own T=2 P=2 checkpoint (step 6) at T=1: with a step too small to move
    an fp32 weight, step 1's weights are the checkpoint's exactly and the optimizer is fresh. Then a
    resume of that run at step 1 with --no-load-optim --no-load-rng: the same loss and lr at step 2 as the
    run itself (weights, data and schedule loaded), but a fresh AdamW (its step count restarts) and this
    run's seeds (the saved Python RNG state is replaced by another, which the resume must not take)."""
    ref = reference_checkpoint(base)
    ckpt = tmp_path / "ckpt"
    tiny_step = ("--lr", "1e-30", "--train-iters", "2", "--save", str(ckpt), "--save-interval", "1")
    result = check(launch(base, 1, tmp_path / "finetune", "--load", str(ref / "ckpt"), "--finetune", *tiny_step))
    assert "started from the weights of worker 0" in result.stdout and "--finetune), at step 0" in result.stdout
    source, step1 = CheckpointReader(ref / "ckpt"), to_plain(read_rank_file(ckpt / "iter_0000001" / "rank_00000.safetensors"))
    stage_of = source.stage_of(0, 0)
    for name, weight in step1["model"].items():
        expected = source.full_tensor(source.stage_ranks(0, 0, stage_of[name]), name, lambda s: s["model"][name])
        assert torch.equal(weight, expected), name
    assert step1["step"] == 1 and step1["optimizer"]["state"]["output_layer.weight"]["step"] == 1

    resumed = tmp_path / "resumed"
    shutil.copytree(ckpt / "iter_0000001", resumed / "iter_0000001")
    (resumed / "latest").write_text("1\n")
    _with_saved_python_rng(resumed / "iter_0000001", random.Random(99).getstate())  # not what the seed gives
    result = check(launch(base, 1, tmp_path / "run2", "--load", str(resumed), "--no-load-optim", "--no-load-rng",
                          *tiny_step[:4], "--save", str(resumed)))
    assert "same layout, fresh inner optimizer and RNG" in result.stdout
    original, again = (_metrics(tmp_path / d) for d in ("finetune", "run2"))
    assert again[2]["loss"] == original[2]["loss"] and again[2]["lr"] == original[2]["lr"]
    step2 = to_plain(read_rank_file(resumed / "iter_0000002" / "rank_00000.safetensors"))
    assert step2["optimizer"]["state"]["output_layer.weight"]["step"] == 1  # fresh: one step taken
    assert _as_tuples(step2["rng"]["python"]) == random.Random(1234).getstate()  # --seed's; no step draws from it


def _with_saved_python_rng(iteration: Path, python_state) -> None:
    """Rewrite rank 0's saved Python RNG state (and its SHA-256 in meta.json)."""
    path = iteration / "rank_00000.safetensors"
    state = to_plain(read_rank_file(path))
    state["rng"]["python"] = python_state
    rewritten = path.with_suffix(".new")  # not in place: the state read from `path` is memory-mapped
    with open(rewritten, "wb") as f:
        write_rank_file(f, state)
    rewritten.replace(path)
    meta = json.loads((iteration / "meta.json").read_text())
    meta["rank_files"][path.name] = sha256_of(path)
    (iteration / "meta.json").write_text(json.dumps(meta))


def _metrics(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


@pytest.mark.launch
def test_weights_start_refusals_name_what_differs(t2p2_imports):
    meta = CheckpointReader(t2p2_imports["llama"][0]).meta
    check_weights_start(meta, 0, replace(meta.model, seq_length=64, init_std=0.01), 1152)  # not in the weights
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 64, this run 128.*--use-checkpoint-args"):
        check_weights_start(meta, 0, replace(meta.model, hidden_size=128), 1152)
    with pytest.raises(CheckpointError, match="padded vocabulary 1152, this run 1024"):
        check_weights_start(meta, 0, meta.model, 1024)
    with pytest.raises(CheckpointError, match="--load-worker 1: the checkpoint has workers 0..0"):
        check_weights_start(meta, 1, meta.model, 1152)


def _resolved(argv, world_size: int):
    """The run's config as the entry point resolves it (which reads the checkpoint for --use-checkpoint-args)."""
    from trainer.checkpoint.format import checkpoint_args
    from trainer.config import build_parser, resolve

    args = build_parser().parse_args(argv)
    return resolve(args, world_size, checkpoint_args(args.load) if args.use_checkpoint_args else None)


@pytest.mark.launch
def test_flags_resolve_through_the_config(t2p2_imports, hf_models, tmp_path):
    from muloco.core.errors import ConfigError
    from trainer.data import check_model_vocabulary

    ckpt = t2p2_imports["paper"][0]
    args = ["--ds_config", "ds_configs/cpu_tiny_muon.json", "--data-path", "x", "--tokenizer-model",
            str(hf_models["paper"])]
    config = _resolved([*args, "--load", str(ckpt), "--use-checkpoint-args", "--seq-length",
                                                "64", "--finetune", "--no-load-optim", "--no-load-rng"], 1)
    assert config.model == replace(CheckpointReader(ckpt).meta.model, seq_length=64)  # a flag given wins
    assert (config.model_vocab_size, config.finetune, config.load_optim, config.load_rng) == (ROWS, True, False, False)
    check_model_vocabulary(config.data, config.model_vocab_size)
    # Without --tokenizer-model, the tokenizer saved with the weights (Megatron's flag takes the tokenizer too).
    bare = _resolved([*args[:4], "--load", str(ckpt), "--use-checkpoint-args"], 1)
    saved = CheckpointReader(ckpt).tokenizer_path
    assert bare.data.tokenizer_model == str(saved) and load_tokenizer(saved).vocab_size == 1024
    with pytest.raises(ConfigError, match="has 1024 ids, but the checkpoint's model .* only 1000 embedding rows"):
        check_model_vocabulary(config.data, 1000)
    for flag in ("--finetune", "--no-load-optim", "--no-load-rng", "--use-checkpoint-args"):
        with pytest.raises(ConfigError, match=f"{flag} needs --load DIR"):
            _resolved([*args, flag], 1)
    with pytest.raises(ConfigError, match="--use-checkpoint-args: no checkpoint in"):
        _resolved([*args, "--load", str(tmp_path), "--use-checkpoint-args"], 1)


@pytest.mark.launch
def test_saves_carry_the_saved_tokenizer_after_its_iteration_is_gone(t2p2_imports, tmp_path):
    """--load DIR --save DIR --keep-last 1 --use-checkpoint-args: the run's tokenizer is a file of the
    imported iteration, which the first prune removes; every later save still carries it."""
    from types import SimpleNamespace

    from muloco.core.topology import ParallelSizes
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.format import iteration_dir

    ckpt = tmp_path / "ckpt"
    shutil.copytree(t2p2_imports["llama"][0], ckpt)
    config = _resolved(["--ds_config", "ds_configs/cpu_tiny_muon.json", "--data-path", "x",
                                                "--load", str(ckpt), "--use-checkpoint-args", "--save", str(ckpt),
                                                "--keep-last", "1", *T2P2], 4)
    saved_tokenizer = Path(config.data.tokenizer_model)
    original = saved_tokenizer.read_bytes()
    trainer = SimpleNamespace(model=torch.nn.Linear(2, 2), extra_state={})
    checkpointer = Checkpointer(config, SimpleNamespace(rank=0, sizes=ParallelSizes(1, 1, 2, 2)), trainer,
                                {"weight": "w", "bias": "b"}, ROWS, 1152)
    shutil.rmtree(saved_tokenizer.parent)  # as --keep-last prunes the imported iteration
    directory = iteration_dir(ckpt, 5)
    directory.mkdir()
    checkpointer._publish(5, directory, ["0" * 64] * 4, one_model=True)
    assert (directory / CheckpointReader(ckpt).meta.tokenizer_model).read_bytes() == original


@pytest.mark.launch
def test_a_weights_start_refuses_another_tokenizer(t2p2_imports, hf_models, tmp_path):
    from trainer.checkpoint.checkpointer import _check_same_tokenizer

    reader = CheckpointReader(t2p2_imports["llama"][0])
    _check_same_tokenizer(reader, str(hf_models["llama"]))
    other = tmp_path / "tokenizer.json"  # the same vocabulary, but its first and last merges swapped
    spec = json.loads((hf_models["llama"] / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]
    other.write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match="is not --tokenizer-model's"):
        _check_same_tokenizer(reader, str(other))
