"""A dataset's files are checked at start-up, each problem one `configuration error:` line before any
collective: a truncated .bin or .idx (against each other and PREFIX.meta.json), token ids beyond the
vocabulary in data made without a .meta.json (a scan of the .bin), a planted pickle in the index cache.
Megatron's own reader (MMapIndexedDataset) is the reference for what a good pair holds."""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from trainer.config import DataConfig, build_parser
from trainer.data import check_data
from muloco.core.errors import ConfigError
from trainer.indexed_files import read_indexed_files
from trainer.pretrain import STARTUP_ERRORS, checked_config

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (7, 300, 1, 45)


def _write(prefix: Path, dtype=np.uint16, top: int = 999) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i, n in enumerate(LENGTHS):
        builder.add_document(torch.arange(n) % 100 + (top if i == 2 else 0), [n])  # the one-token document: `top`
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _meta(prefix: str, **changes) -> None:
    Path(f"{prefix}.meta.json").write_text(json.dumps({"max_token_id": 999, "vocab_size": 1000, "documents": 4,
                                                      "tokens": sum(LENGTHS), "tokenizer_sha256": "0" * 64, **changes}))


def _check(prefix: str, vocab_size: int = 1000) -> None:
    check_data(DataConfig(data_path=[prefix], vocab_size=vocab_size))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_a_good_pair_reads_as_megatron_reads_it(tmp_path, dtype):
    prefix = _write(tmp_path / "d", dtype)
    files = read_indexed_files(prefix)
    megatron = IndexedDataset(prefix)
    assert (files.dtype, files.tokens) == (np.dtype(dtype), int(megatron.sequence_lengths.sum()))
    assert files.max_token_id() == max(int(megatron[i].max()) for i in range(len(megatron))) == 999
    _check(prefix)


def _cut(path: str, keep: int) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:keep])


DAMAGES = {  # what is done to the pair, and the line it must give
    "bin truncated": (lambda p: _cut(f"{p}.bin", 2 * sum(LENGTHS) - 2),
                      r"{p}\.bin: 704 bytes, but {p}\.idx describes 353 tokens of uint16 \(706 bytes\): the file is "
                      r"truncated or not this index's"),
    "bin empty": (lambda p: _cut(f"{p}.bin", 0), r"{p}\.bin: 0 bytes, but {p}\.idx describes 353 tokens"),
    "idx truncated": (lambda p: _cut(f"{p}.idx", 60),
                      r"{p}\.idx: 60 bytes, but its header describes 4 sequences and 5 document boundaries \(122 "
                      r"bytes\): the file is truncated or damaged"),
    "idx header cut": (lambda p: _cut(f"{p}.idx", 20), r"{p}\.idx: 20 bytes, shorter than a Megatron index's header"),
    "idx not an index": (lambda p: Path(f"{p}.idx").write_bytes(b"{}" * 40), r"{p}\.idx is not a Megatron index"),
    "idx dtype code": (lambda p: _poke(f"{p}.idx", 17, b"\x63"), r"{p}\.idx: unknown token dtype code 99"),
    "idx offsets": (lambda p: _poke(f"{p}.idx", 34 + 16 + 8, (5).to_bytes(8, "little")),
                    r"{p}\.idx: its sequence lengths and byte offsets disagree: the index is damaged"),
    "idx boundaries decreasing": (lambda p: _poke(f"{p}.idx", 34 + 12 * 4 + 8 * 2, (0).to_bytes(8, "little")),
                                  r"{p}\.idx: its document boundaries are not an increasing run from 0 to its 4 "
                                  r"sequences: the index is damaged"),
    "idx boundary out of range": (lambda p: _poke(f"{p}.idx", 34 + 12 * 4 + 8 * 4, (99).to_bytes(8, "little")),
                                  r"{p}\.idx: its document boundaries are not an increasing run"),
    "meta counts other tokens": (lambda p: _meta(p, tokens=354),
                                 r"{p}\.meta\.json counts 354 tokens, but {p}\.idx describes 353: the files are not "
                                 r"from one preprocessing run"),
    "meta id a string": (lambda p: _meta(p, max_token_id="5"),
                         r"{p}\.meta\.json is not a valid data description: max_token_id must be an integer, got '5'$"),
    "meta id null": (lambda p: _meta(p, max_token_id=None),
                     r"{p}\.meta\.json is not a valid data description: max_token_id must be an integer, got None$"),
    "meta not an object": (lambda p: Path(f"{p}.meta.json").write_text("[1, 2]"),
                           r"{p}\.meta\.json is not a valid data description: must be an object"),
    "bin damaged under its meta": (lambda p: _poke(f"{p}.bin", 2 * 10, (60000).to_bytes(2, "little")),
                                   r"{p}\.bin: its largest token id is 60000, but {p}\.meta\.json records 999: the "
                                   r"\.bin was damaged or replaced after preprocessing$"),
    # A sparse file of the size a 24 GB index would have: one line from its size, never read (nor mapped).
    "idx sparse, 24 GB": (lambda p: os.truncate(f"{p}.idx", 24 << 30),
                          r"{p}\.idx: 25769803776 bytes, but its header describes 4 sequences and 5 document "
                          r"boundaries \(122 bytes\)"),
    # ... and one whose header agrees with its 24 GB: its zeros fail the checks that cost no pass over it.
    "idx sparse, 24 GB, its header agreeing": (lambda p: _sparse_index(f"{p}.idx", 24 << 30),
                                               r"{p}\.bin: 706 bytes, but {p}\.idx describes 0 tokens"),
    "meta a fifo": (lambda p: _replace(f"{p}.meta.json", os.mkfifo),
                    r"{p}\.meta\.json is not a valid data description: not a regular file \(a folder, device, fifo "
                    r"or socket\)$"),
    "meta a link to /dev/zero": (lambda p: _replace(f"{p}.meta.json", lambda path: os.symlink("/dev/zero", path)),
                                 r"{p}\.meta\.json is not a valid data description: not a regular file"),
    "meta a dangling link": (lambda p: _replace(f"{p}.meta.json", lambda path: os.symlink(f"{p}.nowhere", path)),
                             r"{p}\.meta\.json is not a valid data description: cannot be read \(No such file"),
    "meta huge": (lambda p: Path(f"{p}.meta.json").write_text(" " * (2 << 20)),
                  r"{p}\.meta\.json is not a valid data description: more than 1048576 bytes"),
    "meta nested 100000 deep": (lambda p: Path(f"{p}.meta.json").write_text("[" * 100_000 + "]" * 100_000),
                                r"{p}\.meta\.json is not a valid data description: JSON nested deeper than 64 levels$"),
}


def _replace(path: str, make) -> None:
    os.unlink(path)
    make(path)


def _sparse_index(path: str, size: int) -> None:
    """An .idx header whose sequence and boundary counts fill `size` bytes, the rest a hole of zeros."""
    sequences = (size - 34) // 20
    documents = (size - 34 - 12 * sequences) // 8
    with open(path, "wb") as handle:
        handle.write(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]) + sequences.to_bytes(8, "little")
                     + documents.to_bytes(8, "little"))
    os.truncate(path, 34 + 12 * sequences + 8 * documents)


def _poke(path: str, offset: int, data: bytes) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[offset:offset + len(data)] = data
    Path(path).write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_pair_is_one_line(tmp_path, damage):
    prefix = _write(tmp_path / "d")
    _meta(prefix)
    act, line = DAMAGES[damage]
    act(prefix)
    with pytest.raises(ConfigError, match="^" + line.format(p=re.escape(prefix))):
        _check(prefix)


def test_token_ids_beyond_the_vocabulary_are_found_without_a_meta_json(tmp_path):
    prefix = _write(tmp_path / "d", top=1000)
    with pytest.raises(ConfigError, match=rf"^{re.escape(prefix)}\.bin: the data holds token id 1000, but the "
                                          r"vocabulary of --vocab-size has only 1000 ids \(0\.\.999\)"):
        _check(prefix)
    _check(prefix, vocab_size=1001)


def test_an_unreadable_tokenizer_model_is_one_line_naming_it(tmp_path):
    prefix = _write(tmp_path / "d")
    for name, content in (("garbage.model", b"\x00\x01 not a protobuf" * 50), ("tokenizer.json", b"{ not json")):
        model = tmp_path / name
        model.write_bytes(content)
        with pytest.raises(STARTUP_ERRORS, match=rf"^tokenizer model {re.escape(str(model))} cannot be read as a "
                                                 r"(SentencePiece|HuggingFace)Tokenizer: \S"):
            check_data(DataConfig(data_path=[prefix], tokenizer_model=str(model)))


def test_a_planted_pickle_in_the_index_cache_stops_the_entry_point_with_one_line(tmp_path):
    prefix = _write(tmp_path / "d")
    run_dir = tmp_path / "run"
    (run_dir / "data_cache").mkdir(parents=True)
    planted = run_dir / "data_cache" / "x-GPTDataset-train-sample_index.npy"
    planted.write_bytes(pickle.dumps({"a": 1}))
    args = build_parser().parse_args(["--ds_config", str(ROOT / "ds_configs" / "cpu_tiny_muon.json"), "--model",
                                      "tiny", "--data-path", prefix, "--vocab-size", "1000", "--run-dir", str(run_dir)])
    with pytest.raises(STARTUP_ERRORS, match=f"^data index cache file {re.escape(str(planted))} is not a plain .npy"):
        checked_config(args, 1)
