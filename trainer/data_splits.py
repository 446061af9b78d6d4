"""Every split Megatron builds must hold at least one whole sample of each prefix that feeds it.

GPTDataset repeats a split's documents until they give the samples asked for (_get_num_epochs): a split
without tokens loops there forever, and one shorter than a sample repeats its few tokens for as many
epochs as the run asks. Both are found here, from the .idx files alone, before any process group exists.
With --split, each prefix is cut into train, valid and test by whole documents exactly as Megatron cuts
it (the split matrix, rounded document indices); with --valid-data-path or --per-split-data-args-path
each prefix serves its split whole.
"""
from __future__ import annotations

import math

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

from trainer.config import DataConfig
from trainer.data import data_blends
from muloco.core.errors import ConfigError
from trainer.indexed_files import read_indexed_files

SPLIT_NAMES = ("train", "valid", "test")  # Megatron's Split order


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """--split as Megatron reads it: each split's (start, end) share of a prefix's documents, None when empty."""
    try:
        with np.errstate(invalid="ignore"):  # all zero: reported below
            shares = parse_and_normalize_split(split)
    except AssertionError:  # more than three shares
        shares = [math.nan]
    if not all(math.isfinite(share) for share in shares):  # no number, or all zero
        raise ConfigError(f"--split {split!r} is not three shares >= 0 with a positive sum (e.g. 98,2,0)")
    return convert_split_vector_to_split_matrix(shares)


def check_splits_hold_a_sample(data: DataConfig, seq_length: int) -> None:
    """A ConfigError naming the first prefix, split and fix where a split would hold less than a sample."""
    sample_tokens = seq_length + 1  # Megatron reads one token past each sample for its labels
    train, valid = data_blends(data)
    if valid is None:
        shares = [(name, bookends) for name, bookends in zip(SPLIT_NAMES, split_matrix(data.split)) if bookends]
        for prefix in train[0]:
            lengths = read_indexed_files(prefix).lengths
            for name, (start, end) in shares:
                first, stop = round(start * len(lengths)), round(end * len(lengths))
                tokens = int(lengths[first:stop].sum())
                if tokens < sample_tokens:
                    raise ConfigError(
                        f"{prefix}: its {name} split (--split {data.split}: documents {first}..{stop} of "
                        f"{len(lengths)}) holds {tokens} tokens, less than one sample of --seq-length {seq_length} "
                        f"({sample_tokens} tokens), on which Megatron's index build would loop: give the {name} split a "
                        "larger share with --split, name validation data with --valid-data-path or "
                        "--per-split-data-args-path, or preprocess bigger files (--max-tokens-per-file)")
        return
    for name, (prefixes, _) in zip(SPLIT_NAMES, (train, valid)):
        for prefix in prefixes:
            tokens = read_indexed_files(prefix).tokens
            if tokens < sample_tokens:
                raise ConfigError(f"{prefix}: it holds {tokens} tokens for the {name} split, less than one sample of "
                                  f"--seq-length {seq_length} ({sample_tokens} tokens), on which Megatron's index "
                                  "build would loop: leave it out of that blend, or preprocess bigger files "
                                  "(--max-tokens-per-file)")
