"""Import -> train -> export -> transformers, from the T=2 P=2 imports of tests/hf_models.py: Llama and
the paper's form trained at T=2 P=2 and exported (the paper's as Gemma3ForCausalLM); Qwen3 as MuLoCo K=2
at T=2 P=1, whose workers (and the outer loop's global copy) all start from the imported weights."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ckpt_runs import REPO_ROOT, check, dataset, launch, losses
from hf_models import ROWS, T2P2
from test_tokenizer import hf_tokenizer_dir  # noqa: F401 - the session fixture hf_models needs

from tokenizer.interface import load_tokenizer
from tools.trainer_runs import EXTENSIONS_ENV
from trainer.checkpoint import CheckpointReader
from trainer.model.sharding import shard, sharding_of

pytestmark = pytest.mark.timeout(1800)


def _env() -> dict:
    import os

    return {**os.environ, **EXTENSIONS_ENV, "OMP_NUM_THREADS": "1"}


def _train_flags(ckpt: Path, save: Path) -> tuple[str, ...]:
    """A run from an imported model: no shape flags, the model's own tokenizer, a shorter sequence."""
    return ("--load", str(ckpt), "--use-checkpoint-args", "--seq-length", "64", "--save", str(save))


def _data(base: Path, hf_folder: Path | None) -> tuple[str, ...]:
    """Markov ids < 1000, valid ids of every model; without a folder the run takes the checkpoint's tokenizer."""
    return ("--data-path", dataset(base), *(("--tokenizer-model", str(hf_folder)) if hf_folder else ()))


def _export_and_load(ckpt: Path, out: Path, hf_folder: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "--load", str(ckpt), "--save", str(out),
                             "--verify"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**_env(), "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0 and "verify passed" in result.stdout, result.stdout + result.stderr
    source = json.loads((hf_folder / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == source["architectures"] and exported["vocab_size"] == ROWS
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text = "Shall I compare thee to a summer's day?"
    ids = AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"]
    assert ids == load_tokenizer(hf_folder).encode(text)  # the tokenizer came along
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([ids])).logits).all()
    return result.stdout


@pytest.mark.launch
def test_muloco_k2_at_t2_from_a_t2p2_import_starts_every_worker_from_its_weights(
        base, hf_models, t2p2_imports, tmp_path):
    """K=2 x T=2 x P=1 from the T=2 P=2 import: each worker takes the weights, resharded to one stage."""
    ckpt, _, code = t2p2_imports["qwen3"]
    assert code == 0
    save = tmp_path / "ckpt"
    result = check(launch(base, 4, tmp_path / "run", *_train_flags(ckpt, save), "--tensor-model-parallel-size", "2",
                          "--train-iters", "10", "--save-interval", "5", ds_config="ds_configs/cpu_tiny_muloco.json",
                          data_flags=_data(base, None)))
    assert "started from the weights of worker 0" in result.stdout and "weights-only checkpoint" in result.stdout
    run_config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert run_config["data"]["tokenizer_model"] == str(CheckpointReader(ckpt).tokenizer_path)  # no flag: the import's
    trained = losses(tmp_path / "run")
    assert sorted(trained) == list(range(1, 11)) and trained[10] < trained[1]
    # Before the first outer sync (H=10), the outer loop's global copy is the weights every worker started from.
    imported, run = CheckpointReader(ckpt), CheckpointReader(save, 5)
    assert (run.meta.sizes.workers, run.meta.sizes.pipeline, run.meta.vocab_size) == (2, 1, ROWS)
    stage_of = imported.stage_of(0, 0)
    assert set(stage_of.values()) == {0, 1}
    for rank, coords in enumerate(run.meta.ranks):
        state = run.rank_state(rank)
        global_weights = state["extra"]["muloco"]["global_weights"]
        assert set(global_weights) == set(state["model"]) == set(stage_of)
        for name, weight in global_weights.items():
            ranks = imported.stage_ranks(0, 0, stage_of[name])
            start = shard(imported.full_tensor(ranks, name, lambda s: s["model"][name]), sharding_of(name),
                          coords.tensor, 2)
            assert torch.equal(weight, start), f"worker {coords.worker}: {name} did not start from the import"
            assert not torch.equal(state["model"][name], start)  # and it trained
    _export_and_load(save, tmp_path / "hf", hf_models["qwen3"])


@pytest.mark.parametrize("arch", ["llama", "paper"])
@pytest.mark.launch
def test_import_train_export_round_trip_at_t2p2(base, hf_models, t2p2_imports, tmp_path, arch):
    """Also the export of a T=2 P=2 paper-architecture checkpoint (pre+post norms, document masking) as
    Gemma3ForCausalLM: --verify checks transformers' logits against the trainer's, and the trainer's
    against the probe the sharded training model recorded."""
    ckpt, _, code = t2p2_imports[arch]
    assert code == 0
    save = tmp_path / "ckpt"
    check(launch(base, 4, tmp_path / "run", *_train_flags(ckpt, save), *T2P2,
                 "--train-iters", "2", data_flags=_data(base, hf_models[arch])))
    output = _export_and_load(save, tmp_path / "hf", hf_models[arch])
    assert "vs training model as saved (K=1 D=1 P=2 T=2, worker 0)" in output
