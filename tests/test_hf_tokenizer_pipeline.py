"""A Hugging Face tokenizer.json end to end: preprocess -> train (the real launcher) -> export ->
`transformers` generate, with the same tokenizer at every stage."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _ckpt_runs import REPO_ROOT, check, launch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_tokenizer import hf_tokenizer_dir  # noqa: F401 - shared session fixture

from dataprep.dataset_meta import read_dataset_meta
from dataprep.input_files import read_documents, resolve_inputs
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import load_tokenizer

pytestmark = [pytest.mark.launch, pytest.mark.timeout(900)]  # every test here starts processes


@pytest.mark.trains
def test_hf_tokenizer_preprocess_train_export_generate(hf_tokenizer_dir: Path, shakespeare: Path, tmp_path: Path,  # noqa: F811
                                                       monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(hf_tokenizer_dir)
    prefix = tmp_path / "data" / "shakespeare"
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(shakespeare / "train"), "--output-prefix", str(prefix),
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_tokenizer_dir), "--processes", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    data_prefix = f"{prefix}_text_document"
    dataset = IndexedDataset(data_prefix)
    first = next(doc.text for doc in read_documents(resolve_inputs([str(shakespeare / "train")])[0], "text", print))
    assert dataset[0].tolist() == tokenizer.encode(first) + [tokenizer.eod_id]
    meta = read_dataset_meta(data_prefix)
    assert (meta.vocab_size, meta.tokenizer_sha256) == (tokenizer.vocab_size, tokenizer_identity(tokenizer))
    assert meta.max_token_id < tokenizer.vocab_size

    ckpt = tmp_path / "ckpt"
    check(launch(tmp_path, 1, tmp_path / "run", "--save", str(ckpt), ds_config="ds_configs/cpu_tiny_adamw.json",
                 data_flags=("--data-path", data_prefix, "--tokenizer-model", str(hf_tokenizer_dir))))
    out = tmp_path / "hf"
    export = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "--load", str(ckpt), "--save", str(out),
                             "--verify"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert export.returncode == 0 and "verify passed" in export.stdout, export.stdout + export.stderr

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Shall I compare thee to a summer's day? <|end_of_text|>"
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eod_id
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.vocab_size >= tokenizer.vocab_size
    prompt = hf_tokenizer("Shall I", return_tensors="pt", add_special_tokens=False)["input_ids"]
    generated = model.generate(prompt, attention_mask=prompt.new_ones(prompt.shape), max_new_tokens=6,
                               do_sample=False, min_new_tokens=6)
    assert generated.shape == (1, prompt.shape[1] + 6)
    assert hf_tokenizer.decode(generated[0]).startswith("Shall I")
