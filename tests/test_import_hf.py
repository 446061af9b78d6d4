"""Import from Hugging Face (tools/convert_checkpoint/import_hf.py): small random Llama, Qwen3 and Gemma3
(the paper's form) models (tests/hf_models.py).

- `--from-hf ... --verify` at T=1 P=1 and T=2 P=2: the imported model's logits, recorded by its own
  T x P probe, against transformers'; the round trip back to Hugging Face tensors; a verify that must fail;
- every feature the trainer cannot represent is refused with one error naming it, before anything
  is written."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_models import ARCHS, ROWS, edit_config, write_hf_model
from test_tokenizer import hf_tokenizer_dir  # noqa: F401 - the session fixture hf_models needs

from tools.convert_checkpoint.__main__ import main as convert_main
from tools.convert_checkpoint.hf_folder import HfFolderError
from tools.convert_checkpoint.import_hf import import_hf
from trainer.checkpoint import CheckpointReader

pytestmark = pytest.mark.timeout(1800)


def run_convert(capsys, *argv: str) -> tuple[int, str]:
    code = convert_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


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


REFUSALS = {  # arch, what is done to the folder, the error
    "sliding window": ("qwen3", lambda f: edit_config(f, drop=("layer_types",), use_sliding_window=True,
                                                       sliding_window=32, max_window_layers=1),
                       r"sliding-window attention \(layers \[1, 2\]\)"),
    "gemma sliding layers": ("paper", lambda f: edit_config(f, layer_types=["sliding_attention", "full_attention",
                                                                              "full_attention"]),
                             r"sliding-window attention \(layers \[0\]\)"),
    "attention bias": ("llama", lambda f: edit_config(f, attention_bias=True), "attention_bias is true"),
    "rope scaling": ("llama", lambda f: edit_config(f, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), "rope scaling type 'llama3'"),
    "activation": ("llama", lambda f: edit_config(f, hidden_act="gelu"), "hidden_act 'gelu'.*SwiGLU"),
    "gemma activation": ("paper", lambda f: edit_config(f, hidden_activation="gelu_pytorch_tanh"),
                         "hidden_activation 'gelu_pytorch_tanh'"),
    "gemma softcap": ("paper", lambda f: edit_config(f, final_logit_softcapping=30.0),
                      "final_logit_softcapping 30.0"),
    "gemma attention scale": ("paper", lambda f: edit_config(f, query_pre_attn_scalar=256),
                              "query_pre_attn_scalar 256 is not head_dim 16"),
    "several at once": ("llama", lambda f: edit_config(f, attention_bias=True, mlp_bias=True, hidden_act="relu"),
                        "hidden_act 'relu'.*attention_bias is true.*mlp_bias is true"),
    "unsupported family": ("llama", lambda f: edit_config(f, model_type="mistral"),
                           "model_type 'mistral' is not one the trainer imports"),
    "multimodal gemma": ("paper", lambda f: edit_config(f, model_type="gemma3"), "only the text model"),
    "quantized": ("llama", lambda f: edit_config(f, quantization_config={"quant_method": "bitsandbytes"}),
                  "quantized weights"),
    "heads over T": ("llama", lambda f: edit_config(f, num_attention_heads=2, num_key_value_heads=1, head_dim=32),
                     "num-query-groups 1 is not divisible by tensor-model-parallel-size 2"),
    "eos beyond rows": ("llama", lambda f: edit_config(f, eos_token_id=[5, ROWS]),
                        f"eos_token_id {ROWS} is not a row of the {ROWS}-row embedding"),
    "wrong shape": ("llama", lambda f: edit_config(f, intermediate_size=128),
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
