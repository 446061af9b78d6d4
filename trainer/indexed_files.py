"""A Megatron indexed dataset's files (PREFIX.idx, PREFIX.bin) checked against each other at start-up.

Megatron trusts them: a truncated .bin fails deep inside a worker ("offset must be non-negative"), a
truncated .idx as a numpy error. The index is small, so reading it whole is cheap; from it the .bin's
exact size is known. Layout of the .idx (Megatron's _IndexReader): a 9-byte magic, version <Q (1),
dtype code <B, sequence count S <Q, boundary count N <Q, then int32 lengths[S], int64 byte pointers[S],
int64 document boundaries[N] (sequence indices, 0 first)."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

from muloco.core.errors import ConfigError

_FIXED = struct.Struct("<9sQBQQ")
_SCAN_TOKENS = 1 << 24  # tokens per chunk of the max scan: bounded memory on any file size


@dataclass(frozen=True)
class IndexedFiles:
    prefix: str
    dtype: np.dtype
    lengths: np.ndarray  # int64 tokens per sequence (each one document, as preprocessing writes them)

    @property
    def tokens(self) -> int:
        """The sum of the sequence lengths: the .bin holds exactly this many."""
        return int(self.lengths.sum())

    def max_token_id(self) -> int:
        """The largest token id in the .bin (one streaming pass; -1 for an empty file)."""
        data = np.memmap(f"{self.prefix}.bin", dtype=self.dtype, mode="r") if self.tokens else ()
        return max((int(data[i:i + _SCAN_TOKENS].max()) for i in range(0, len(data), _SCAN_TOKENS)), default=-1)


def read_indexed_files(prefix: str) -> IndexedFiles:
    """PREFIX.idx read and PREFIX.bin's size checked against it; a ConfigError naming the file otherwise."""
    idx, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = idx.read_bytes()
    if len(raw) < _FIXED.size:
        raise ConfigError(f"{idx}: {len(raw)} bytes, shorter than a Megatron index's header: the file is truncated")
    magic, version, code, sequences, documents = _FIXED.unpack_from(raw)
    if magic != _INDEX_HEADER or version != 1:
        raise ConfigError(f"{idx} is not a Megatron index (version 1): its header is {raw[:17]!r}")
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except ValueError:
        raise ConfigError(f"{idx}: unknown token dtype code {code}") from None
    expected = _FIXED.size + 12 * sequences + 8 * documents
    if len(raw) != expected:
        raise ConfigError(f"{idx}: {len(raw)} bytes, but its header describes {sequences} sequences and {documents} "
                          f"document boundaries ({expected} bytes): the file is truncated or damaged")
    lengths = np.frombuffer(raw, np.int32, sequences, _FIXED.size).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, sequences, _FIXED.size + 4 * sequences)
    starts = np.cumsum(lengths) - lengths
    if (lengths < 0).any() or not np.array_equal(pointers, starts * dtype.itemsize):
        raise ConfigError(f"{idx}: its sequence lengths and byte offsets disagree: the index is damaged")
    boundaries = np.frombuffer(raw, np.int64, documents, _FIXED.size + 12 * sequences)
    if documents == 0 or boundaries[0] != 0 or boundaries[-1] != sequences or (np.diff(boundaries) < 0).any():
        raise ConfigError(f"{idx}: its document boundaries are not an increasing run from 0 to its {sequences} "
                          "sequences: the index is damaged")
    tokens = int(lengths.sum())
    if bin_path.stat().st_size != tokens * dtype.itemsize:
        raise ConfigError(f"{bin_path}: {bin_path.stat().st_size} bytes, but {idx} describes {tokens} tokens of "
                          f"{dtype} ({tokens * dtype.itemsize} bytes): the file is truncated or not this index's")
    return IndexedFiles(prefix, dtype, lengths)
