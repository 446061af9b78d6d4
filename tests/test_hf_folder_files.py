"""Crafted Hugging Face folders (tools/convert_checkpoint/folder_files.py, hf_folder.py): every file the
importer opens is a regular file inside the folder (or, for a hub-cache snapshot, its blobs/), small files
are read with a cap, sizes are checked before transformers builds a config, numbers against upper bounds
too, weights for their dtype and finite values, and a file that does not parse is one `import error:` line
naming it. The folders here hold a one-layer Llama of zeros, written without
building a transformers model."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.convert_checkpoint.__main__ import main as convert_main
from tools.convert_checkpoint.hf_folder import (INDEX, SINGLE, HfFolderError, checked_weights, expected_hf_shapes,
                                                read_hf_model)

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu"}


@pytest.fixture(scope="module")
def tensors(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("shapes")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return {name: torch.zeros(shape) for name, shape in expected_hf_shapes(read_hf_model(folder)).items()}


def _folder(path: Path, tensors: dict[str, torch.Tensor], sharded: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    if not sharded:
        save_file(tensors, path / SINGLE)
        return path
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, path / file)
    (path / INDEX).write_text(json.dumps({"weight_map": {name: file for file, part in halves.items() for name in part}}))
    return path


def _as_hub_cache(folder: Path, repo: Path) -> Path:
    """The folder laid out as the hub cache lays out a download: blobs/ by hash, a snapshot of relative links."""
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{index:040x}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def test_a_hub_cache_snapshot_reads_through_its_links(tmp_path, tensors):
    snapshot = _as_hub_cache(_folder(tmp_path / "plain", tensors, sharded=True), tmp_path / "models--org--tiny")
    weights = checked_weights(read_hf_model(snapshot))
    assert all(torch.equal(weights.get(name), tensor) for name, tensor in tensors.items())


def _link_out(folder: Path, name: str, target: Path) -> None:
    (folder / name).unlink()
    (folder / name).symlink_to(target)


def _outside_copy(folder: Path, name: str) -> Path:
    copy = folder.parent / f"outside-{name}"
    shutil.copyfile(folder / name, copy)
    return copy


def _edit_weights(folder: Path, **edits) -> None:
    """Rewrite the single weights file with tensors changed by `edits` (name with dots as __ -> function)."""
    tensors = load_file(folder / SINGLE)
    for key, edit in edits.items():
        name = key.replace("__", ".")
        tensors[name] = edit(tensors[name])
    save_file(tensors, folder / SINGLE)


def _edit_config(folder: Path, **changes) -> None:
    (folder / "config.json").write_text(json.dumps({**CONFIG, **changes}))


CRAFTED = {  # what is done to the folder, and the line it must give
    "weights linked outside": (lambda f: _link_out(f, SINGLE, _outside_copy(f, SINGLE)),
                               r"{f}/model\.safetensors leads to .*outside-model\.safetensors, outside {f}: links are "
                               r"followed only inside the folder"),
    "config linked to a device": (lambda f: _link_out(f, "config.json", Path("/dev/zero")),
                                  r"{f}/config\.json leads to /dev/zero, outside {f}"),
    "tokenizer linked to /etc/passwd": (lambda f: (f / "tokenizer.json").symlink_to("/etc/passwd"),
                                        r"{f}/tokenizer\.json leads to /etc/passwd, outside {f}"),
    "config a fifo": (lambda f: ((f / "config.json").unlink(), os.mkfifo(f / "config.json")),
                      r"{f}/config\.json is not a regular file"),
    "config huge": (lambda f: (f / "config.json").write_text(" " * (2 << 20) + json.dumps(CONFIG)),
                    r"{f}/config\.json: 2097\d+ bytes, more than the 1048576 any such file needs"),
    "a link loop": (lambda f: _link_out(f, "config.json", f / "config.json"), r"{f}/config\.json: cannot be opened"),
    "layers beyond any model": (lambda f: (f / "config.json").write_text(json.dumps(
        {**CONFIG, "num_hidden_layers": 100_000_000})),
        r"{f}/config\.json: num_hidden_layers 100000000 is not a whole number in 1\.\.1024$"),
    "sizes of the wrong type": (lambda f: (f / "config.json").write_text(json.dumps(
        {**CONFIG, "hidden_size": "16", "vocab_size": True})),
        r"{f}/config\.json: hidden_size '16' is not a whole number in 1\.\.131072; vocab_size True is not"),
    "tokenizer not JSON": (lambda f: (f / "tokenizer.json").write_bytes(b"{ not json"),
                           r"{f}/tokenizer\.json: tokenizer model {f}/tokenizer\.json cannot be read as a "
                           r"HuggingFaceTokenizer: \S"),
    "tokenizer not a tokenizer": (lambda f: (f / "tokenizer.json").write_text('{"model": {"type": 5}}'),
                                  r"{f}/tokenizer\.json: tokenizer model .* cannot be read as a HuggingFaceTokenizer"),
    "NaN and infinite weights": (lambda f: _edit_weights(f, model__layers__0__mlp__up_proj__weight=lambda t: t.index_fill(
        0, torch.tensor([5]), float("nan")), model__norm__weight=lambda t: t.fill_(float("-inf"))),
        r"{f}: model\.layers\.0\.mlp\.up_proj\.weight, model\.norm\.weight hold NaN or infinite values$"),
    "a float64 weight": (lambda f: _edit_weights(f, model__norm__weight=lambda t: t.double()),
                         r"{f}: model\.norm\.weight is F64 \(float64\), expected F32/BF16/F16$"),
    "an integer weight": (lambda f: _edit_weights(f, lm_head__weight=lambda t: t.to(torch.int8)),
                          r"{f}: lm_head\.weight is I8 \(int8\), expected F32/BF16/F16$"),
    "rope_theta 1e300": (lambda f: _edit_config(f, rope_theta=None, rope_parameters={"rope_theta": 1e300,
                                                                                     "rope_type": "default"}),
                         r"{f}/config\.json: cannot import this llama model: rope_theta 1e\+300 is not a whole number "
                         r"in 1\.\.1e\+12"),
    "rope_theta infinite": (lambda f: _edit_config(f, rope_theta=float("inf")),
                            r"{f}/config\.json: cannot import this llama model: rope_theta inf is not a whole number"),
    "rope_theta NaN": (lambda f: _edit_config(f, rope_theta=float("nan")), r".*rope_theta nan is not a whole number"),
    "rms_norm_eps 1e300": (lambda f: _edit_config(f, rms_norm_eps=1e300),
                           r"{f}/config\.json: rms_norm_eps must be in \(0, 1\], got 1e\+300$"),
    "initializer_range 1e300": (lambda f: _edit_config(f, initializer_range=1e300),  # transformers' own check
                                r"{f}/config\.json: not a valid llama config \(.*initializer_range.*1e\+300"),
    "vocab beyond any model": (lambda f: _edit_config(f, vocab_size=10 ** 300),
                               r"{f}/config\.json: vocab_size 1000000000\d* is not a whole number in 1\.\.16777216$"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_folder_is_one_import_error_line(tmp_path, tensors, capsys, case):
    folder = _folder(tmp_path / "model", tensors)
    damage, line = CRAFTED[case]
    damage(folder)
    code = convert_main(["--from-hf", str(folder), "--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.match("import error: " + line.format(f=re.escape(str(folder))), err), err
    assert not (tmp_path / "ckpt").exists()


def test_the_plain_folder_passes_the_same_checks(tmp_path, tensors):
    folder = _folder(tmp_path / "model", tensors)
    assert read_hf_model(folder).shape.num_layers == 1
    _edit_config(folder, rope_theta=1e12, rms_norm_eps=1.0)  # the bounds themselves are in range
    assert read_hf_model(folder).shape.rotary_base == 10 ** 12
    with pytest.raises(HfFolderError, match="is not a file in"):  # an index may still name only its own files
        (folder / INDEX).write_text(json.dumps({"weight_map": {"model.norm.weight": "../x.safetensors"}}))
        checked_weights(read_hf_model(folder))
