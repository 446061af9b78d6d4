"""The trainer's blends from files (trainer/data.py, dataprep/blend.py): --data-args-path and
--per-split-data-args-path read as Megatron reads them, what --data-path would give for the same text;
every bad file or weight stopped with one error that names it, however large or deep the file (/dev/zero, a
prefix of megabytes, JSON nested 100,000 levels); the tokenizer check over a blend's .meta.json files, and the
warning for data without one; the blend the run prints."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_tokenizer import sentencepiece_model  # noqa: F401 - shared session fixture

import trainer.data
from dataprep.blend import BlendEntry, BlendFileError, write_data_args
from dataprep.dataset_meta import DatasetMeta, write_dataset_meta
from dataprep.indexed_writer import DocumentWriter
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import load_tokenizer
from trainer.config import DataConfig, build_parser, resolve
from trainer.data import check_data, data_blends, describe_blend
from muloco.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def prefixes(tmp_path: Path) -> list[str]:
    """Three tiny indexed datasets."""
    made = []
    for index in range(3):
        prefix = str(tmp_path / f"d{index}_text_document")
        writer = DocumentWriter(f"{prefix}.bin", np.uint16)
        writer.add_documents(np.arange(10, dtype=np.uint16), [4, 6])
        writer.finalize(f"{prefix}.idx")
        made.append(prefix)
    return made


def test_data_args_file_is_read_as_data_path(prefixes: list[str], tmp_path: Path):
    path = tmp_path / "blend.data_args"
    write_data_args(path, [BlendEntry(30.0, prefixes[0]), BlendEntry(0.5, prefixes[1]), BlendEntry(7, prefixes[2])])
    from_file = data_blends(DataConfig(data_args_path=str(path), valid_data_path=(prefixes[2],)))
    from_flags = data_blends(DataConfig(data_path=("30", prefixes[0], "0.5", prefixes[1], "7", prefixes[2]),
                                        valid_data_path=(prefixes[2],)))
    assert from_file == from_flags == ((prefixes, [30.0, 0.5, 7.0]), ([prefixes[2]], None))
    path.write_text(f"{prefixes[1]}\n")  # one prefix, no weight: Megatron's other form
    assert data_blends(DataConfig(data_args_path=str(path))) == (([prefixes[1]], None), None)


def test_per_split_file_gives_train_and_valid_blends(prefixes: list[str], tmp_path: Path):
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": ["1", prefixes[0], "3", prefixes[1]], "valid": prefixes[2], "test": None}))
    assert data_blends(DataConfig(per_split_data_args_path=str(path))) == (
        (prefixes[:2], [1.0, 3.0]), ([prefixes[2]], None))


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("1 {p0} 2", "takes one prefix or weight/prefix pairs, got 3 items"),
    ("abc {p0} 1 {p1}", "blend weight 'abc' is not a number > 0"),
    ("0 {p0} 1 {p1}", "blend weight '0' is not a number > 0"),
    ("inf {p0} 1 {p1}", "blend weight 'inf'"),
    ("1 {p0} 1 {p0}_nope", "_nope.bin not found (from {file})"),
])
def test_bad_data_args_files_are_refused_by_name(prefixes: list[str], tmp_path: Path, content: str, message: str):
    path = tmp_path / "blend.data_args"
    path.write_text(content.format(p0=prefixes[0], p1=prefixes[1]))
    with pytest.raises((ConfigError, BlendFileError, FileNotFoundError)) as error:
        data_blends(DataConfig(data_args_path=str(path)))
    assert message.format(file=path) in str(error.value)


@pytest.mark.parametrize("splits, message", [
    ({"train": ["p"]}, "'valid' must be a non-empty list"),
    ({"train": [], "valid": ["p"]}, "'train' must be a non-empty list"),
    ({"train": ["p"], "valid": [1]}, "'valid' must be a non-empty list"),
    ({"train": ["p"], "valid": ["p"], "validation": ["p"]}, "with keys train, valid, test"),
    (["p"], "with keys train, valid, test"),
])
def test_bad_per_split_files_are_refused_by_name(tmp_path: Path, splits, message: str):
    path = tmp_path / "splits.json"
    path.write_text(json.dumps(splits))
    with pytest.raises(BlendFileError, match=message):
        data_blends(DataConfig(per_split_data_args_path=str(path)))


def test_an_endless_or_huge_args_file_and_a_huge_prefix_are_one_line(prefixes: list[str], tmp_path: Path):
    with pytest.raises(BlendFileError, match=r"^cannot read --data-args-path /dev/zero: more than 268435456 bytes, the "
                                             r"most such a file may hold$"):
        data_blends(DataConfig(data_args_path="/dev/zero"))
    path = tmp_path / "blend.data_args"
    path.write_text(f"1 {prefixes[0]}\n1 {'a' * (16 << 20)}\n")  # a prefix far past PATH_MAX
    with pytest.raises(ConfigError, match=rf"^dataset file a{{300}}\.\.\. \(16777220 characters\) cannot be opened "
                                          rf"\(File name too long\) \(from {path}\)$"):
        data_blends(DataConfig(data_args_path=str(path)))
    deep = tmp_path / "splits.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BlendFileError, match=rf"^cannot read --per-split-data-args-path {deep}: JSON nested deeper "
                                             r"than 64 levels$"):
        data_blends(DataConfig(per_split_data_args_path=str(deep)))


@pytest.mark.parametrize("make", ["fifo", "folder", "link to /dev/zero"])
@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_data_file_that_is_not_a_regular_file_says_so(prefixes: list[str], make: str, suffix: str):
    path = Path(prefixes[0] + suffix)
    path.unlink()
    {"fifo": os.mkfifo, "folder": os.mkdir, "link to /dev/zero": lambda p: os.symlink("/dev/zero", p)}[make](path)
    with pytest.raises(ConfigError, match=rf"^dataset file {path} is not a regular file \(a folder, device, fifo or "
                                          r"socket\) \(from --data-path\)$"):
        check_data(DataConfig(data_path=(prefixes[0],), vocab_size=100))


def test_data_given_twice_or_not_at_all_is_refused(prefixes: list[str], tmp_path: Path):
    for data, message in ((DataConfig(data_path=(prefixes[0],), data_args_path="x"), "cannot be combined"),
                          (DataConfig(valid_data_path=(prefixes[0],), per_split_data_args_path="x"), "cannot be combined"),
                          (DataConfig(), "no training data"),
                          (DataConfig(data_args_path=str(tmp_path / "absent")), "cannot read --data-args-path")):
        with pytest.raises(ValueError, match=message):
            data_blends(data)


def test_flags_reach_the_data_config(tmp_path: Path):
    ds = tmp_path / "ds.json"
    ds.write_text((ROOT / "ds_configs" / "cpu_tiny_adamw.json").read_text())
    config = resolve(build_parser().parse_args(["--ds_config", str(ds), "--vocab-size", "64", "--data-args-path", "a",
                                                "--per-split-data-args-path", "b"]), 1)
    assert (config.data.data_args_path, config.data.per_split_data_args_path) == ("a", "b")


def test_every_prefix_is_checked_against_the_tokenizer_hashing_it_once(
        prefixes: list[str], sentencepiece_model: Path, tmp_path: Path, monkeypatch):  # noqa: F811
    tokenizer = load_tokenizer(sentencepiece_model)
    for prefix in prefixes:
        write_dataset_meta(prefix, DatasetMeta(9, tokenizer.vocab_size, tokenizer_identity(tokenizer), 2, 10))
    path = tmp_path / "blend.data_args"
    write_data_args(path, [BlendEntry(1, prefix) for prefix in prefixes])
    hashed = []
    monkeypatch.setattr(trainer.data, "tokenizer_identity", lambda tok: hashed.append(tok) or tokenizer_identity(tok))
    data = DataConfig(data_args_path=str(path), tokenizer_model=str(sentencepiece_model))
    check_data(data)
    assert len(hashed) == 1  # not once per prefix: a blend may hold thousands

    write_dataset_meta(prefixes[2], DatasetMeta(9, tokenizer.vocab_size, "0" * 64, 2, 10))
    with pytest.raises(ConfigError, match=f"{prefixes[2]}.meta.json: the data was tokenized with a tokenizer"):
        check_data(data)


def test_data_without_a_meta_json_is_a_warning_that_the_tokenizer_was_not_checked(
        prefixes: list[str], sentencepiece_model: Path, capsys):  # noqa: F811
    tokenizer = load_tokenizer(sentencepiece_model)
    write_dataset_meta(prefixes[0], DatasetMeta(9, tokenizer.vocab_size, tokenizer_identity(tokenizer), 2, 10))
    check_data(DataConfig(data_path=("1", prefixes[0], "1", prefixes[1], "1", prefixes[2]),
                          tokenizer_model=str(sentencepiece_model)))
    assert capsys.readouterr().out == (
        f"warning: 2 of 3 dataset(s) have no .meta.json (e.g. {prefixes[1]}.meta.json): that --tokenizer-model "
        f"{sentencepiece_model} made them is not checked, only that their token ids fit its {tokenizer.vocab_size} "
        "ids\n")
    check_data(DataConfig(data_path=(prefixes[0],), tokenizer_model=str(sentencepiece_model)))
    assert capsys.readouterr().out == ""


def test_the_printed_blend_has_megatrons_normalised_shares(prefixes: list[str]):
    text = describe_blend((prefixes, [1.0, 1.0, 2.0]), "training")
    assert text.splitlines() == ["data: training: blend of 3 prefixes (share of samples, prefix):",
                                 f"  0.250000 {prefixes[0]}", f"  0.250000 {prefixes[1]}", f"  0.500000 {prefixes[2]}"]
    many = describe_blend(([f"p{i}" for i in range(20)], [1.0] * 20), "training")
    assert many.splitlines()[-1] == "  ... and 12 more" and len(many.splitlines()) == 10
    assert describe_blend((["p"], None), "validation") == "data: validation: p"
