"""Writing Megatron indexed datasets (.bin/.idx) a batch of documents at a time, and cutting the
documents of a run of parts into output files of at most a given number of tokens.

Every document here is one sequence (what Megatron's preprocessing writes for a document that is
not split into sentences), so sequence and document counts agree.

The .idx is written and read by Megatron's own code, imported where an index is written or read (`write_index`,
`document_lengths`; dataprep.index_code reaches it for about the cost of `import torch`), which a process that only
fills a .bin (preprocessing's tokenizing processes) never pays.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from dataprep.index_code import load_index_code


class DocumentWriter:
    """A .bin in Megatron's format (the tokens end to end) fed whole batches of documents, each batch written straight
    from its array, not copied per document as Megatron's builder's `add_document` does; its .idx by Megatron's
    builder (`finalize`)."""

    def __init__(self, bin_path: str, dtype: type[np.number]):
        self.dtype = dtype
        self._bin = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.tokens = 0
        self.max_token_id = -1

    @property
    def documents(self) -> int:
        return len(self.sequence_lengths)

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int]) -> None:
        """Documents laid end to end in `tokens` (of this writer's dtype), `lengths[i]` tokens each."""
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, this dataset holds {np.dtype(self.dtype)}")
        self._bin.write(memoryview(np.ascontiguousarray(tokens)))
        self.sequence_lengths.extend(lengths)
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self.tokens += tokens.size

    def copy_documents(self, prefix: str, lengths: np.ndarray, start: int, stop: int) -> None:
        """Documents [start, stop) of the dataset at `prefix`, whose documents are `lengths` tokens long."""
        if start == stop:
            return
        offset, count = int(lengths[:start].sum()), int(lengths[start:stop].sum())
        tokens = (np.memmap(f"{prefix}.bin", dtype=self.dtype, mode="r", offset=offset * np.dtype(self.dtype).itemsize,
                            shape=(count,)) if count else np.empty(0, self.dtype))
        self.add_documents(tokens, lengths[start:stop].tolist())

    def close(self) -> list[int]:
        """Finish the .bin (its .idx is yet to be written: `write_index`); the documents' lengths."""
        self._bin.close()
        return self.sequence_lengths

    def finalize(self, idx_path: str) -> None:
        """Finish the .bin and write its .idx."""
        write_index(idx_path, self.dtype, self.close())


def write_index(idx_path: str, dtype: type[np.number], lengths: Sequence[int]) -> None:
    """The .idx of a .bin of documents `lengths` tokens long, written by Megatron's builder."""
    builder = load_index_code().IndexedDatasetBuilder(os.devnull, dtype=dtype)  # the .bin is written: its own is empty
    builder.sequence_lengths.extend(lengths)
    builder.document_indices.extend(range(1, len(lengths) + 1))
    builder.finalize(idx_path)


def document_lengths(prefix: str) -> np.ndarray:
    """Tokens per document of the dataset at `prefix` (read from its .idx by Megatron's reader)."""
    dataset = load_index_code().IndexedDataset(prefix)  # kept alive until the lengths are copied out: deleting it unmaps them
    lengths = np.array(dataset.index.sequence_lengths, dtype=np.int64)
    del dataset
    return lengths


def plan_files(lengths: Sequence[np.ndarray], max_tokens: int | None) -> list[list[tuple[int, int, int]]]:
    """The output files for documents that lie in parts `lengths` (tokens per document of each part), in
    order: each file a list of (part, first document, stop document). A file takes documents while they
    fit in `max_tokens`; a longer document gets a file of its own; None puts everything in one file. A
    last file of less than half `max_tokens` shares the documents of the one before evenly instead: a
    sliver of a file would give the trainer a prefix too small to split into train and validation."""
    if max_tokens is None:
        return [[(part, 0, len(part_lengths)) for part, part_lengths in enumerate(lengths)]]
    sizes = np.concatenate([np.asarray(part, dtype=np.int64) for part in lengths] or [np.zeros(0, np.int64)])
    ends = np.cumsum(sizes)  # tokens up to and including each document
    part_starts = np.cumsum([0] + [len(part) for part in lengths])
    starts, first = [], 0  # the first document of each file
    while first < len(sizes):
        starts.append(first)
        before = ends[first] - sizes[first]
        first = max(first + 1, int(np.searchsorted(ends, before + max_tokens, side="right")))
    if len(starts) > 1 and ends[-1] - ends[starts[-1] - 1] < max_tokens / 2:
        starts[-1] = _even_cut(np.concatenate([[0], ends]), starts[-2], starts[-1], max_tokens)
    return [_part_ranges(part_starts, start, stop) for start, stop in zip(starts, [*starts[1:], len(sizes)])]


def _even_cut(totals: np.ndarray, first: int, cut: int, max_tokens: int) -> int:
    """The document boundary between documents `first` and the last that leaves the two files around it
    closest in tokens while both fit in `max_tokens` (`cut` when none does better); `totals[i]` is the
    token count of documents [0, i)."""
    candidates = np.arange(first + 1, len(totals) - 1)
    left, right = totals[candidates] - totals[first], totals[-1] - totals[candidates]
    allowed = ((left <= max_tokens) & (right <= max_tokens)) | (candidates == cut)
    imbalance = np.where(allowed, np.abs(left - right), np.iinfo(np.int64).max)
    return int(candidates[np.argmin(imbalance)])


def _part_ranges(part_starts: np.ndarray, first: int, stop: int) -> list[tuple[int, int, int]]:
    """Documents [first, stop) of the concatenated parts as (part, start, stop) within each part."""
    ranges = []
    for part in range(len(part_starts) - 1):
        start, end = max(first, part_starts[part]), min(stop, part_starts[part + 1])
        if start < end:
            ranges.append((part, int(start - part_starts[part]), int(end - part_starts[part])))
    return ranges
