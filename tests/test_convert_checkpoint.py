"""Hugging Face export: from a T=2 P=2 checkpoint the transformers model reproduces the training
model's logits; --verify passes on a good export and fails on a corrupted checkpoint shard or export
tensor; the Llama mapping (no QK-norm) with an exported tokenizer, and sampling with tools/generate."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _ckpt_runs import REPO_ROOT, check, dataset, launch, reference_checkpoint
from tools.convert_checkpoint.merge import recorded_probe
from trainer.checkpoint import CheckpointReader
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file

# Every test here starts processes. Several launches per test, each bounded by its own timeout; on a
# shared 2-core machine the default 600 s per test is too tight for three 4-rank launches.
pytestmark = [pytest.mark.launch, pytest.mark.timeout(1800)]
CONVERT_TIMEOUT_S = 300


def convert(ckpt: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "--load", str(ckpt), "--save", str(out),
                           *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="module")
def good_export(base) -> Path:
    out = base / "hf_t2p2"
    result = convert(reference_checkpoint(base) / "ckpt", out, "--verify", "--max-shard-bytes", "1000000")
    assert result.returncode == 0 and "verify passed" in result.stdout, result.stdout + result.stderr
    return out


def test_export_from_t2p2_gives_the_training_models_logits(base, good_export):
    from transformers import AutoModelForCausalLM

    assert json.loads((good_export / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    index = json.loads((good_export / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # streamed into several shards
    tokens, recorded = recorded_probe(CheckpointReader(reference_checkpoint(base) / "ckpt"))
    model = AutoModelForCausalLM.from_pretrained(good_export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    assert logits.shape == recorded.shape
    assert (logits - recorded).abs().max() < 1e-4 * recorded.abs().max()


def test_exported_files_are_readable_by_others(good_export):
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in good_export.iterdir()}
    assert modes == {name: oct(0o666 & ~umask) for name in modes}  # as a plain open() makes them (0644)


def test_verify_fails_on_a_corrupted_checkpoint_shard(base, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint(base) / "ckpt" / "iter_0000006", ckpt / "iter_0000006")
    (ckpt / "latest").write_text("6\n")
    shard = ckpt / "iter_0000006" / "rank_00001.safetensors"  # T rank 1 of the first stage
    state = to_plain(read_rank_file(shard))
    state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"][:4] += 0.05
    rewritten = shard.with_suffix(".new")  # not in place: the state read from `shard` is memory-mapped
    with open(rewritten, "wb") as f:
        write_rank_file(f, state)
    rewritten.replace(shard)
    # A well-formed shard with wrong weights: past the checksum (skipped here), the logits catch it.
    result = convert(ckpt, tmp_path / "hf", "--verify", "--no-verify-checksums")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "VERIFY FAILED" in result.stderr and "FAIL trainer model (T=1 P=1) vs training model" in result.stdout


def test_verify_fails_on_a_corrupted_export_tensor(base, good_export, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(good_export, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    file = out / index["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    result = convert(reference_checkpoint(base) / "ckpt", out, "--verify-only")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL transformers export vs trainer model" in result.stdout


@pytest.mark.trains
def test_llama_export_with_tokenizer_loads_and_generates(base, shakespeare, tmp_path):
    from transformers import AutoTokenizer

    from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
    from tokenizer.train import TokenizerTrainingConfig, train_tokenizer
    from tools.generate import generate

    spm = train_tokenizer(TokenizerTrainingConfig(inputs=(str(shakespeare / "train"),), output_prefix=tmp_path / "spm",
                                                  vocab_size=1024, max_chars=300_000, num_threads=1)).model_path
    ckpt = tmp_path / "ckpt"  # the Markov data's ids (< 1000) are valid ids of this tokenizer
    check(launch(base, 1, tmp_path / "run", "--no-qk-layernorm", "--save", str(ckpt),
                 data_flags=("--data-path", dataset(base), "--tokenizer-model", str(spm))))
    out = tmp_path / "hf"
    result = convert(ckpt, out, "--verify")
    assert result.returncode == 0 and "verify passed" in result.stdout, result.stdout + result.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "model.safetensors").is_file()
    text = "Shall I compare thee to a summer's day?"
    assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"] == \
        SentencePieceTokenizer(spm).encode(text)
    sample = generate(str(out), "Shall I", max_new_tokens=8)
    assert sample.startswith("Shall I") and len(sample) > len("Shall I")
