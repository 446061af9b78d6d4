"""Which prefixes feed each split (trainer/data_splits.py): a prefix whose share of a split holds less than one
sample is left out of that split's blend with one note line, the others' weights renormalized, and only a
split no prefix can feed is one `configuration error:` line naming the prefix, the split and the fix, found
before Megatron builds anything (with too few documents, Megatron's GPTDataset._get_num_epochs loops forever).
The per-split blends cut by --split build exactly Megatron's single blend when nothing is left out."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from tools.synthetic_data import write_markov_dataset

from trainer.config import DataConfig, build_parser
from trainer.data import TokenizerInfo, build_datasets, run_blends
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


def test_the_test_share_is_never_built_so_not_checked_and_a_bad_split_is_one_line(twenty_documents):
    blends = run_blends(DataConfig(data_path=(twenty_documents,), split="80,19,1", vocab_size=VOCAB), SEQ)
    assert (blends.train, blends.valid, blends.notes) == (([twenty_documents], None), ([twenty_documents], None), [])
    for split, message in (("x", r"^--split 'x' is not three shares >= 0 with a positive sum"),
                           ("0,100,0", r"^--split 0,100,0 gives the train split no share of the data")):
        with pytest.raises(ConfigError, match=message):
            run_blends(DataConfig(data_path=(twenty_documents,), split=split, vocab_size=VOCAB), SEQ)


def test_a_prefix_too_small_for_a_split_is_left_out_of_that_split_only(tmp_path, twenty_documents, capsys,
                                                                        process_group):
    big = write_markov_dataset(str(tmp_path / "big"), VOCAB, num_docs=100, seed=1)
    data = DataConfig(data_path=("3", big, "1", twenty_documents), vocab_size=VOCAB)  # the default 98,2,0
    blends = run_blends(data, SEQ)
    assert blends.train == ([big, twenty_documents], [3.0, 1.0]) and blends.valid == ([big], [3.0])
    assert blends.notes == [f"data: 1 of 2 prefixes hold less than one sample (129 tokens) of the valid split (--split "
                            f"98,2,0) and are left out of its blend, the weights renormalized over the other 1: "
                            f"{twenty_documents}"]
    datasets = build_datasets(data, TokenizerInfo(VOCAB, 0), SEQ, seed=1, train_samples=64, valid_samples=8,
                              cache_dir=str(tmp_path / "cache"))
    assert blends.notes[0] in capsys.readouterr().out
    assert sorted(set(datasets.train.dataset_index.tolist())) == [0, 1]  # both feed training
    # Only `big` validates (one prefix: Megatron builds its dataset, not a blend), on its 98,2,0 share.
    assert datasets.valid.dataset_path == big and datasets.valid.indices.tolist() == [98, 99]


def test_a_split_no_prefix_of_a_blend_can_feed_is_one_line(tmp_path, twenty_documents):
    other = write_markov_dataset(str(tmp_path / "other"), VOCAB, num_docs=20, seed=1)
    with pytest.raises(ConfigError, match=rf"^none of the 2 prefixes holds a sample of the valid split; the first, "
                                          rf"{re.escape(twenty_documents)}: its valid split \(--split 98,2,0: "
                                          r"documents 20\.\.20 of 20\) holds 0 tokens, less than one sample"):
        run_blends(DataConfig(data_path=("1", twenty_documents, "1", other), vocab_size=VOCAB), SEQ)


def test_the_split_blends_build_megatrons_single_blend(tmp_path, twenty_documents, process_group):
    """With every prefix feeding every split, the per-split blends cut by --split give the samples Megatron's
    own blend (one distribution, --split) gives, in the same order."""
    big = write_markov_dataset(str(tmp_path / "big"), VOCAB, num_docs=100, seed=1)
    data = DataConfig(data_path=("3", big, "1", twenty_documents), split="80,20,0", vocab_size=VOCAB)
    ours = build_datasets(data, TokenizerInfo(VOCAB, 0), SEQ, seed=1, train_samples=96, valid_samples=16,
                          cache_dir=str(tmp_path / "ours"))
    config = GPTDatasetConfig(blend=([big, twenty_documents], [3.0, 1.0]), split="80,20,0", random_seed=1,
                              sequence_length=SEQ, tokenizer=TokenizerInfo(VOCAB, 0),
                              path_to_cache=str(tmp_path / "megatron"), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [96, 16, 0], lambda: True, config).build()
    for mine, megatron in ((ours.train, train), (ours.valid, valid)):
        assert len(mine) == len(megatron)
        for index in range(len(mine)):
            assert torch.equal(mine[index]["tokens"], megatron[index]["tokens"]), index


def test_a_file_shorter_than_a_sample_in_a_per_split_blend_is_left_out(tmp_path, twenty_documents):
    tiny = write_markov_dataset(str(tmp_path / "tiny"), VOCAB, num_docs=1, doc_len=100)
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": twenty_documents, "valid": ["1", twenty_documents, "1", tiny]}))
    blends = run_blends(DataConfig(per_split_data_args_path=str(path)), SEQ)
    assert blends.valid == ([twenty_documents], [1.0]) and blends.prefix_split is None
    assert blends.notes == [f"data: 1 of 2 prefixes hold less than one sample (129 tokens) of the valid split and are "
                            f"left out of its blend, the weights renormalized over the other 1: {tiny}"]
    path.write_text(json.dumps({"train": twenty_documents, "valid": tiny}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(tiny)}: it holds \d+ tokens for the valid split, less than "
                                          r"one sample of --seq-length 128"):
        run_blends(DataConfig(per_split_data_args_path=str(path)), SEQ)
