"""Which prefixes feed each split, and which of their documents.

GPTDataset repeats a split's documents until they give the samples asked for (_get_num_epochs): a split
without tokens loops there forever, and one shorter than a sample repeats its few tokens for as many
epochs as the run asks. So a prefix whose share of a split holds less than one sample is left out of that
split's blend (one note line per split; Megatron renormalizes the weights of the others), and only a split
that no prefix can feed is an error: a merged blend of small pieces (one of a single document is the
remainder of every partition) trains at the default split. All of it is found from the .idx files alone,
before any process group exists.

With --split, each prefix is cut into train, valid and test by whole documents exactly as Megatron cuts
it (the split matrix, rounded document indices), and the splits are built as per-split blends whose
prefixes serve their --split share (`SplitBlendsBuilder`): the same datasets as Megatron's single blend
when no prefix is left out. With --valid-data-path or --per-split-data-args-path each prefix serves its
split whole. The trainer builds no test split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

from muloco.core.errors import ConfigError
from trainer.indexed_files import map_indexed_files

SPLIT_NAMES = ("train", "valid", "test")  # Megatron's Split order
Blend = tuple[list[str], list[float] | None]  # Megatron's: prefixes, and their weights (None: one prefix)
_NAMED = 3  # prefixes a note names before "... and N more"


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


@dataclass(frozen=True)
class SplitBlends:
    """The blends Megatron builds: training, and validation (None: no validation split)."""

    train: Blend
    valid: Blend | None
    prefix_split: str | None  # --split, when each prefix serves its share of documents to each split
    notes: list[str]  # one line for each split that left prefixes out


def split_blends(train: Blend, valid: Blend | None, split: str, seq_length: int) -> SplitBlends:
    """The training and validation blends of a run (`valid` None: both cut from `train` by `split`), each
    without the prefixes whose share of it holds less than one sample; a ConfigError where none is left."""
    sample_tokens = seq_length + 1  # Megatron reads one token past each sample for its labels
    if valid is not None:
        blends = [_fed(blend, name, [_Share(prefix, map_indexed_files(prefix).tokens) for prefix in blend[0]],
                       sample_tokens, seq_length, None) for name, blend in zip(SPLIT_NAMES, (train, valid))]
        return SplitBlends(*(blend for blend, _ in blends), None, [note for _, note in blends if note])
    matrix = split_matrix(split)
    if matrix[0] is None:
        raise ConfigError(f"--split {split} gives the train split no share of the data")
    built = {name: bookends for name, bookends in zip(SPLIT_NAMES[:2], matrix) if bookends}  # no test split
    shares: dict[str, list[_Share]] = {name: [] for name in built}
    for prefix in train[0]:
        files = map_indexed_files(prefix)
        documents = len(files.lengths)
        for name, (start, end) in built.items():
            first, stop = round(start * documents), round(end * documents)
            shares[name].append(_Share(prefix, files.tokens_between(first, stop), (first, stop, documents)))
    fed = {name: _fed(train, name, shares[name], sample_tokens, seq_length, split) for name in shares}
    blend_of = {name: blend for name, (blend, _) in fed.items()}
    return SplitBlends(blend_of["train"], blend_of.get("valid"), split, [note for _, note in fed.values() if note])


@dataclass(frozen=True)
class _Share:
    prefix: str
    tokens: int
    documents: tuple[int, int, int] | None = None  # with --split: first, stop and count of the prefix's documents


def _fed(blend: Blend, name: str, shares: list[_Share], sample_tokens: int, seq_length: int,
         split: str | None) -> tuple[Blend, str | None]:
    """`blend` without the prefixes whose share of split `name` is short of a sample, and the note saying so."""
    prefixes, weights = blend
    kept = [index for index, share in enumerate(shares) if share.tokens >= sample_tokens]
    if len(kept) == len(prefixes):
        return blend, None
    short = [share for share in shares if share.tokens < sample_tokens]
    how = f" (--split {split})" if split else ""
    if not kept:
        raise ConfigError(_no_sample(short[0], name, len(prefixes), sample_tokens, seq_length, split))
    named = ", ".join(share.prefix for share in short[:_NAMED]) + (
        f" ... and {len(short) - _NAMED} more" if len(short) > _NAMED else "")
    note = (f"data: {len(short)} of {len(prefixes)} prefixes hold less than one sample ({sample_tokens} tokens) of "
            f"the {name} split{how} and are left out of its blend, the weights renormalized over the other "
            f"{len(kept)}: {named}")
    return ([prefixes[index] for index in kept], [weights[index] for index in kept] if weights else None), note


def _no_sample(share: _Share, name: str, prefixes: int, sample_tokens: int, seq_length: int,
               split: str | None) -> str:
    """The error of a split no prefix can feed, with the first prefix's numbers and the fixes."""
    if split:
        first, stop, documents = share.documents
        where = (f"its {name} split (--split {split}: documents {first}..{stop} of {documents}) holds "
                 f"{share.tokens} tokens")
        fixes = (f"give the {name} split a larger share with --split, name validation data with --valid-data-path "
                 "or --per-split-data-args-path, or preprocess bigger files (--max-tokens-per-file)")
    else:
        where = f"it holds {share.tokens} tokens for the {name} split"
        fixes = "leave it out of that blend, or preprocess bigger files (--max-tokens-per-file)"
    what = (f"{share.prefix}: {where}" if prefixes == 1 else
            f"none of the {prefixes} prefixes holds a sample of the {name} split; the first, {share.prefix}: {where}")
    return (f"{what}, less than one sample of --seq-length {seq_length} ({sample_tokens} tokens), on which Megatron's "
            f"index build would loop: {fixes}")


@dataclass
class SplitBlendsConfig(GPTDatasetConfig):
    """Megatron's config for per-split blends, whose prefixes serve their `prefix_split` share of documents.

    Megatron refuses `split` beside `blend_per_split`; it is set after that check, so it reaches the
    datasets' cache keys as it does for a single blend, and `SplitBlendsBuilder` cuts each prefix by it."""

    prefix_split: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefix_split is not None:
            self.split, self.split_matrix = self.prefix_split, split_matrix(self.prefix_split)


class SplitBlendsBuilder(BlendedMegatronDatasetBuilder):
    """Megatron's builder of per-split blends, each prefix giving its split its `split_matrix` share of
    documents (Megatron's gives each its whole prefix)."""

    def _build_megatron_dataset_splits(self, dataset_path, split, sizes, synchronize_ranks=True):
        if self.config.split_matrix is not None:
            split = [self.config.split_matrix[index] if bookends else None for index, bookends in enumerate(split)]
        return super()._build_megatron_dataset_splits(dataset_path, split, sizes, synchronize_ranks)
