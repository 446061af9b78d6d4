"""Import from Hugging Face: small random Llama, Qwen3 and Gemma3 (the paper's form) models that
transformers builds offline from a config, each with a tokenizer.json of fewer ids than embedding rows.

- `--from-hf ... --verify` at T=1 P=1 and T=2 P=2: the imported model's logits, recorded by its own
  T x P probe, against transformers'; the round trip back to Hugging Face tensors;
- every feature the trainer cannot represent is refused with one error naming it, before anything
  is written;
- import -> train at T=2 P=2 -> export -> transformers, for each architecture; Qwen3 as MuLoCo K=2 at
  T=2 P=1, whose workers (and the outer loop's global copy) all start from the imported weights;
- the trainer's flags: --finetune from one of its own checkpoints, --no-load-optim/--no-load-rng,
  --use-checkpoint-args, and their refusals."""
import contextlib
import io
import json
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _ckpt_runs import REPO_ROOT, check, dataset, launch, losses, reference_checkpoint
from test_tokenizer import hf_tokenizer_dir  # noqa: F401 - shared session fixture
from tools.trainer_runs import EXTENSIONS_ENV

from tokenizer.interface import load_tokenizer
from tools.convert_checkpoint.__main__ import main as convert_main
from tools.convert_checkpoint.hf_folder import HfFolderError
from tools.convert_checkpoint.hf_mapping import hf_config
from tools.convert_checkpoint.import_hf import import_hf
from trainer.checkpoint import CheckpointError, CheckpointReader
from trainer.checkpoint.checkpointer import check_weights_start
from trainer.checkpoint.format import sha256_of
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from trainer.model.sharding import sharding_of, shard
from trainer.model.presets import ModelShape

pytestmark = pytest.mark.timeout(1800)
ROWS = 1100  # more rows than the tokenizer's 1024 ids (as Qwen pads), and not a multiple of 128
ARCHS = ("llama", "qwen3", "paper")
T2P2 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")


def _config(arch: str, special: dict, **changes):
    """A config as each model family writes it (Llama without head_dim, Qwen3 with its own head_dim,
    Gemma3 as the exporter writes the paper's model)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **special)
    if arch == "llama":
        return LlamaConfig(**{**common, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **changes})
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, **changes})
    shape = ModelShape(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16,
                       num_query_groups=2, arch="paper", rotary_base=10000, seq_length=128)
    return hf_config(shape, ROWS, special)


def write_hf_model(folder: Path, arch: str, tokenizer_dir: Path, dtype=torch.float32, shard_size=None, **changes):
    """A random model with weights large enough for O(1) logits; Gemma's norms are stored as w - 1."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tokenizer_dir)
    config = _config(arch, {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id}, **changes)
    torch.manual_seed(ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p) + (0.0 if arch == "paper" else 1.0))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 0.15))
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    shutil.copyfile(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, hf_tokenizer_dir) -> dict[str, Path]:  # noqa: F811
    base = tmp_path_factory.mktemp("hf_models")
    llama = write_hf_model(base / "llama", "llama", hf_tokenizer_dir, dtype=torch.bfloat16)
    # As Llama configs on the Hub are written: rope_theta at the top, no head_dim.
    _edit_config(llama, drop=("rope_parameters", "head_dim"), rope_theta=10000.0)
    return {"llama": llama,
            "qwen3": write_hf_model(base / "qwen3", "qwen3", hf_tokenizer_dir, shard_size="100KB"),
            "paper": write_hf_model(base / "paper", "paper", hf_tokenizer_dir)}


def run_convert(capsys, *argv: str) -> tuple[int, str]:
    code = convert_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def t2p2_imports(hf_models, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each model imported at T=2 P=2 with --verify: (checkpoint, output)."""
    base, done = tmp_path_factory.mktemp("imports"), {}
    for arch, folder in hf_models.items():
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = convert_main(["--from-hf", str(folder), "--save", str(base / arch), *T2P2, "--verify"])
        done[arch] = (base / arch, output.getvalue(), code)
    return done


def _env() -> dict:
    import os

    return {**os.environ, **EXTENSIONS_ENV, "OMP_NUM_THREADS": "1"}


# -- import and verify --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.launch
def test_import_at_t2p2_verifies_against_transformers(t2p2_imports, arch):
    ckpt, output, code = t2p2_imports[arch]
    assert code == 0 and "verify passed" in output, output
    assert "ok   imported model (K=1 D=1 P=2 T=2) vs transformers" in output
    assert "round trip Hugging Face -> trainer -> Hugging Face" in output
    assert f"vocabulary: {ROWS} embedding rows; the trainer pads it to 1152 rows with copies of the last row" in output
    assert "rows 1024..1099 are the model's own padding" in output
    meta = CheckpointReader(ckpt).meta
    assert meta.weights_only and meta.step == 0 and meta.describe_layout() == "K=1 D=1 P=2 T=2"
    assert (meta.vocab_size, meta.padded_vocab_size, meta.tokenizer_model) == (ROWS, 1152, "tokenizer.json")
    # Per layer Q, K, V, O, gate, up, down and 2 (4 in Gemma) norms, QK-norms but in Llama; final norm, embedding,
    # head. Gemma's fp32 norms (1 + w) round; its embedding, scaled by sqrt(64) = 8, comes back exactly.
    exact = {"llama": "30 tensors bit-identical\n", "qwen3": "36 tensors bit-identical\n",
             "paper": "23 tensors bit-identical, 19 in Gemma's (1 + w) / sqrt(hidden) convention"}[arch]
    assert exact in output


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.launch
def test_import_at_t1p1_verifies_in_process(hf_models, tmp_path, capsys, arch):
    code, output = run_convert(capsys, "--from-hf", str(hf_models[arch]), "--save", str(tmp_path / "ckpt"), "--verify")
    assert code == 0 and "verify passed" in output, output
    assert "ok   imported model (K=1 D=1 P=1 T=1) vs transformers" in output
    reader = CheckpointReader(tmp_path / "ckpt")
    embedding = reader.rank_state(0)["model"]["embedding.word_embeddings.weight"]
    assert embedding.shape == (1152, 64)
    assert torch.equal(embedding[ROWS:], embedding[ROWS - 1].expand(1152 - ROWS, -1))  # Megatron's padding


@pytest.mark.launch
def test_verify_fails_when_the_source_differs_from_the_import(hf_models, t2p2_imports, tmp_path):
    """Both checks can fail: the T=2 P=2 import against its source with one layer's gate and up swapped."""
    from safetensors.torch import load_file, save_file

    from tools.convert_checkpoint.verify import verify_import

    folder = tmp_path / "model"
    shutil.copytree(hf_models["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    tensors[gate], tensors[up] = tensors[up], tensors[gate]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    report = verify_import(CheckpointReader(t2p2_imports["llama"][0]), folder, untied=False)
    assert not report.ok
    assert "FAIL imported model (K=1 D=1 P=2 T=2) vs transformers" in str(report)
    assert f"differ: {gate}, {up}" in str(report)


def test_verify_never_passes_a_nan_or_infinite_difference():
    """A NaN compares false both ways, so each comparison must fail on it rather than pass by omission."""
    from tools.convert_checkpoint.verify import Comparison, _compare

    torch.manual_seed(0)
    logits = torch.randn(1, 4, 8)
    nan, inf = logits.clone().index_fill(2, torch.tensor([3]), float("nan")), logits.clone().fill_(float("inf"))
    assert _compare("same", logits, logits).ok
    for got, reference in ((nan, logits), (logits, nan), (nan, nan), (inf, inf), (logits, inf)):
        assert not _compare("bad", got, reference).ok
    assert not Comparison("a finite difference of infinite logits", 0.5, float("inf")).ok
    assert "FAIL" in str(_compare("bad", nan, nan)) and "max |diff| nan" in str(_compare("bad", nan, nan))


def test_a_tokenizer_with_more_ids_than_rows_is_refused(hf_tokenizer_dir, tmp_path):  # noqa: F811
    folder = write_hf_model(tmp_path / "small", "llama", hf_tokenizer_dir, vocab_size=1000)
    with pytest.raises(HfFolderError, match="tokenizer.json has 1024 ids but the embedding only 1000 rows"):
        import_hf(folder, tmp_path / "ckpt", 1, 1)


@pytest.mark.launch
def test_tied_embeddings_are_refused_unless_untied(hf_tokenizer_dir, tmp_path, capsys):  # noqa: F811
    folder = write_hf_model(tmp_path / "tied", "qwen3", hf_tokenizer_dir, tie_word_embeddings=True)
    with pytest.raises(HfFolderError, match="tie_word_embeddings is true.*--untie-embeddings"):
        import_hf(folder, tmp_path / "refused", 1, 1)
    assert not (tmp_path / "refused").exists()
    code, output = run_convert(capsys, "--from-hf", str(folder), "--save", str(tmp_path / "ckpt"), "--untie-embeddings",
                               "--verify")
    assert code == 0 and "verify passed" in output, output
    state = CheckpointReader(tmp_path / "ckpt").rank_state(0)["model"]
    assert torch.equal(state["output_layer.weight"], state["embedding.word_embeddings.weight"])


def _edit_config(folder: Path, drop: tuple[str, ...] = (), **changes) -> None:
    path = folder / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **changes}))


REFUSALS = {  # arch, what is done to the folder, the error
    "sliding window": ("qwen3", lambda f: _edit_config(f, drop=("layer_types",), use_sliding_window=True,
                                                       sliding_window=32, max_window_layers=1),
                       r"sliding-window attention \(layers \[1, 2\]\)"),
    "gemma sliding layers": ("paper", lambda f: _edit_config(f, layer_types=["sliding_attention", "full_attention",
                                                                              "full_attention"]),
                             r"sliding-window attention \(layers \[0\]\)"),
    "attention bias": ("llama", lambda f: _edit_config(f, attention_bias=True), "attention_bias is true"),
    "rope scaling": ("llama", lambda f: _edit_config(f, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), "rope scaling type 'llama3'"),
    "activation": ("llama", lambda f: _edit_config(f, hidden_act="gelu"), "hidden_act 'gelu'.*SwiGLU"),
    "gemma activation": ("paper", lambda f: _edit_config(f, hidden_activation="gelu_pytorch_tanh"),
                         "hidden_activation 'gelu_pytorch_tanh'"),
    "gemma softcap": ("paper", lambda f: _edit_config(f, final_logit_softcapping=30.0),
                      "final_logit_softcapping 30.0"),
    "gemma attention scale": ("paper", lambda f: _edit_config(f, query_pre_attn_scalar=256),
                              "query_pre_attn_scalar 256 is not head_dim 16"),
    "several at once": ("llama", lambda f: _edit_config(f, attention_bias=True, mlp_bias=True, hidden_act="relu"),
                        "hidden_act 'relu'.*attention_bias is true.*mlp_bias is true"),
    "unsupported family": ("llama", lambda f: _edit_config(f, model_type="mistral"),
                           "model_type 'mistral' is not one the trainer imports"),
    "multimodal gemma": ("paper", lambda f: _edit_config(f, model_type="gemma3"), "only the text model"),
    "quantized": ("llama", lambda f: _edit_config(f, quantization_config={"quant_method": "bitsandbytes"}),
                  "quantized weights"),
    "heads over T": ("llama", lambda f: _edit_config(f, num_attention_heads=2, num_key_value_heads=1, head_dim=32),
                     "num-query-groups 1 is not divisible by tensor-model-parallel-size 2"),
    "eos beyond rows": ("llama", lambda f: _edit_config(f, eos_token_id=[5, ROWS]),
                        f"eos_token_id {ROWS} is not a row of the {ROWS}-row embedding"),
    "wrong shape": ("llama", lambda f: _edit_config(f, intermediate_size=128),
                    r"mlp.gate_proj.weight has shape \[96, 64\], config.json implies \[128, 64\]"),
    "pickle only": ("llama", lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
                    "pytorch_model.bin is a pickle, which is never loaded"),
    "index outside the folder": ("qwen3", lambda f: (f / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../model.safetensors"}})), "is not a file in"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_the_trainer_cannot_represent_is_refused_by_name(hf_models, tmp_path, case):
    arch, damage, message = REFUSALS[case]
    folder = tmp_path / "model"
    shutil.copytree(hf_models[arch], folder)
    damage(folder)
    with pytest.raises(HfFolderError, match=message):
        import_hf(folder, tmp_path / "ckpt", 2, 1)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


@pytest.mark.launch
def test_an_extra_tensor_and_an_occupied_save_folder_are_refused(hf_models, tmp_path, t2p2_imports):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(hf_models["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HfFolderError, match=r"no place for \['model.layers.0.self_attn.q_proj.bias'\]"):
        import_hf(folder, tmp_path / "ckpt", 1, 1)
    with pytest.raises(HfFolderError, match="already holds checkpoints"):
        import_hf(hf_models["llama"], t2p2_imports["llama"][0], 1, 1)


# -- import -> train -> export ------------------------------------------------------------------------


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


# -- the trainer's flags ------------------------------------------------------------------------------


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
    from trainer.data import check_model_vocabulary
    from muloco.core.errors import ConfigError

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

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.format import iteration_dir
    from muloco.core.topology import ParallelSizes

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
