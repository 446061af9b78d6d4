"""Small random Hugging Face models for the import tests, built offline by transformers from a config:
Llama, Qwen3 and Gemma3 (the paper's form), each with a tokenizer.json of fewer ids than embedding rows.
A plugin (tests/conftest.py) so that the session builds the three models, and imports each at T=2 P=2
with --verify, once for every module that uses them; its imports wait for the first use."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

ROWS = 1100  # more rows than the tokenizer's 1024 ids (as Qwen pads), and not a multiple of 128
ARCHS = ("llama", "qwen3", "paper")
T2P2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")


def hf_model_config(arch: str, special: dict, **changes):
    """A config as each model family writes it (Llama without head_dim, Qwen3 with its own head_dim,
    Gemma3 as the exporter writes the paper's model)."""
    from transformers import LlamaConfig, Qwen3Config

    from tools.convert_checkpoint.hf_mapping import hf_config
    from trainer.model.presets import ModelShape

    common = dict(vocab_size=ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **special)
    if arch == "llama":
        return LlamaConfig(**{**common, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **changes})
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, **changes})
    shape = ModelShape(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16,
                       num_query_groups=2, arch="paper", rotary_base=10000, seq_length=128)
    return hf_config(shape, ROWS, special)


def write_hf_model(folder: Path, arch: str, tokenizer_dir: Path, dtype=None, shard_size=None, **changes):
    """A random model with weights large enough for O(1) logits; Gemma's norms are stored as w - 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenizer.interface import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    config = hf_model_config(arch, {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id}, **changes)
    torch.manual_seed(ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p) + (0.0 if arch == "paper" else 1.0))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 0.15))
    model.to(dtype or torch.float32).save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    shutil.copyfile(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def edit_config(folder: Path, drop: tuple[str, ...] = (), **changes) -> None:
    """Rewrite the folder's config.json without the keys in `drop` and with `changes`."""
    path = folder / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **changes}))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory, hf_tokenizer_dir) -> dict[str, Path]:
    """The three models in folders as the Hub has them (hf_tokenizer_dir: tests/test_tokenizer.py, which every
    module using these fixtures imports)."""
    import torch

    base = tmp_path_factory.mktemp("hf_models")
    llama = write_hf_model(base / "llama", "llama", hf_tokenizer_dir, dtype=torch.bfloat16)
    # As Llama configs on the Hub are written: rope_theta at the top, no head_dim.
    edit_config(llama, drop=("rope_parameters", "head_dim"), rope_theta=10000.0)
    return {"llama": llama,
            "qwen3": write_hf_model(base / "qwen3", "qwen3", hf_tokenizer_dir, shard_size="100KB"),
            "paper": write_hf_model(base / "paper", "paper", hf_tokenizer_dir)}


@pytest.fixture(scope="session")
def t2p2_imports(hf_models, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each model imported at T=2 P=2 with --verify: (checkpoint, output)."""
    from tools.convert_checkpoint.__main__ import main as convert_main

    base, done = tmp_path_factory.mktemp("imports"), {}
    for arch, folder in hf_models.items():
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = convert_main(["--from-hf", str(folder), "--save", str(base / arch), *T2P2, "--verify"])
        done[arch] = (base / arch, output.getvalue(), code)
    return done
