"""A split that would hold less than one sample (trainer/data_splits.py) is one `configuration error:`
line naming the prefix, the split and the fix, found before Megatron builds anything: with too few
documents, Megatron's GPTDataset._get_num_epochs loops forever. What passes the check, Megatron builds."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tools.synthetic_data import write_markov_dataset

from trainer.config import DataConfig, build_parser
from trainer.data import TokenizerInfo, build_datasets
from trainer.data_splits import check_splits_hold_a_sample
from muloco.core.errors import ConfigError
from trainer.pretrain import STARTUP_ERRORS, checked_config

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000
SEQ = 128  # the tiny preset's


@pytest.fixture(scope="module")
def twenty_documents(tmp_path_factory) -> str:
    """20 documents of 150..299 tokens: the default split 98,2,0 leaves validation none of them."""
    return write_markov_dataset(str(tmp_path_factory.mktemp("twenty") / "small"), VOCAB, num_docs=20)


def _checked(tmp_path: Path, *flags: str):
    args = build_parser().parse_args(["--ds_config", str(ROOT / "ds_configs" / "cpu_tiny_muon.json"), "--model", "tiny",
                                      "--vocab-size", str(VOCAB), "--run-dir", str(tmp_path / "run"), *flags])
    return checked_config(args, 1)


def test_an_empty_validation_split_stops_the_entry_point_with_one_line(tmp_path, twenty_documents):
    prefix = re.escape(twenty_documents)
    with pytest.raises(STARTUP_ERRORS, match=rf"^{prefix}: its valid split \(--split 98,2,0: documents 20\.\.20 of 20\) "
                                             r"holds 0 tokens, less than one sample of --seq-length 128 \(129 tokens\)"
                                             r".*: give the valid split a larger share with --split, name validation "
                                             r"data with --valid-data-path or --per-split-data-args-path"):
        _checked(tmp_path, "--data-path", twenty_documents)
    config = _checked(tmp_path, "--data-path", twenty_documents, "--split", "80,20,0")
    # What the check lets through, Megatron builds (the refused split above is what it loops on).
    datasets = build_datasets(config.data, TokenizerInfo(VOCAB, 0), SEQ, seed=1, train_samples=64, valid_samples=4,
                              cache_dir=str(tmp_path / "cache"))
    assert len(datasets.train) >= 64 and len(datasets.valid) >= 4


def test_a_test_share_is_checked_too_and_a_bad_split_is_one_line(twenty_documents):
    with pytest.raises(ConfigError, match=r"its test split \(--split 80,19,1: documents 20\.\.20 of 20\) holds 0"):
        check_splits_hold_a_sample(DataConfig(data_path=(twenty_documents,), split="80,19,1", vocab_size=VOCAB), SEQ)
    with pytest.raises(ConfigError, match=r"^--split 'x' is not three shares >= 0 with a positive sum"):
        check_splits_hold_a_sample(DataConfig(data_path=(twenty_documents,), split="x", vocab_size=VOCAB), SEQ)


def test_the_prefix_of_a_blend_whose_share_is_too_small_is_named(tmp_path, twenty_documents):
    big = write_markov_dataset(str(tmp_path / "big"), VOCAB, num_docs=100, seed=1)
    blend = DataConfig(data_path=("3", big, "1", twenty_documents), vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=rf"^{re.escape(twenty_documents)}: its valid split"):
        check_splits_hold_a_sample(blend, SEQ)
    check_splits_hold_a_sample(DataConfig(data_path=("3", big, "1", twenty_documents), split="90,10,0"), SEQ)


def test_a_file_shorter_than_a_sample_in_a_per_split_blend_is_named(tmp_path, twenty_documents):
    tiny = write_markov_dataset(str(tmp_path / "tiny"), VOCAB, num_docs=1, doc_len=100)
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": twenty_documents, "valid": ["1", twenty_documents, "1", tiny]}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(tiny)}: it holds \d+ tokens for the valid split, less than "
                                          r"one sample of --seq-length 128"):
        check_splits_hold_a_sample(DataConfig(per_split_data_args_path=str(path)), SEQ)
    path.write_text(json.dumps({"train": twenty_documents, "valid": twenty_documents}))
    check_splits_hold_a_sample(DataConfig(per_split_data_args_path=str(path)), SEQ)
