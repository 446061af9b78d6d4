"""A Megatron indexed dataset's files (PREFIX.idx, PREFIX.bin) checked against each other at start-up.

Megatron trusts them: a truncated .bin fails deep inside a worker ("offset must be non-negative"), a
truncated .idx as a numpy error. Byte format of the .idx (Megatron's _IndexReader): a 9-byte magic, version <Q (1),
dtype code <B, sequence count S <Q, boundary count N <Q, then int32 lengths[S], int64 byte pointers[S],
int64 document boundaries[N] (sequence indices, 0 first).

The index is memory-mapped, never read whole: a legitimate index of billions of documents is held by the page
cache, once per machine, not in every rank's memory. Its size must be the one its header describes before any
of it is mapped (a sparse file of a few KB that claims 24 GB is one line), and the checks walk it in blocks.
Both files must be regular files: a FIFO would block the reader, a link to /dev/zero never end.
"""
from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

from muloco.core.errors import ConfigError

IDX_FIELDS = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence and document counts
_SCAN = 1 << 24  # tokens (or sequences) per block of a scan: bounded memory on any file size


@dataclass(frozen=True)
class IndexedFiles:
    """A dataset's index, mapped (`map_indexed_files`), and its .bin's size checked against it."""

    prefix: str
    dtype: type[np.number]  # the token type, as Megatron's DType names it (np.uint16, np.int32, ...)
    lengths: np.ndarray  # int32 tokens per sequence (each one document, as preprocessing writes them)
    pointers: np.ndarray  # int64 byte offset of each sequence in the .bin
    boundaries: np.ndarray  # int64 sequence index at which each document starts, then the sequence count
    tokens: int  # the .bin holds exactly this many

    def tokens_between(self, first: int, stop: int) -> int:
        """Tokens of sequences [first, stop)."""
        return int(self.lengths[first:stop].sum(dtype=np.int64))

    def max_token_id(self) -> int:
        """The largest token id in the .bin (one streaming pass; -1 for an empty file)."""
        data = np.memmap(f"{self.prefix}.bin", dtype=self.dtype, mode="r") if self.tokens else ()
        return max((int(data[i:i + _SCAN].max()) for i in range(0, len(data), _SCAN)), default=-1)


def regular_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a data file, to follow its name ("not found", "is not a regular file ..."),
    or None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "not found"
    except OSError as error:  # a name too long, a link loop, no permission
        return f"cannot be opened ({error.strerror or error})"
    return None if stat.S_ISREG(mode) else "is not a regular file (a folder, device, fifo or socket)"


def map_indexed_files(prefix: str) -> IndexedFiles:
    """PREFIX.idx mapped, after checking what costs no pass over it: both are regular files, the header is
    Megatron's, the .idx is exactly as long as its header says and the .bin as its last sequence ends."""
    idx, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_path):
        if problem := regular_file_problem(path):
            raise ConfigError(f"dataset file {path} {problem}")
    try:
        with open(idx, "rb") as handle:
            header = handle.read(IDX_FIELDS.size)
            size = os.fstat(handle.fileno()).st_size
    except OSError as error:  # no permission
        raise ConfigError(f"dataset file {idx} cannot be read ({error.strerror or error})") from None
    if len(header) < IDX_FIELDS.size:
        raise ConfigError(f"{idx}: {size} bytes, shorter than a Megatron index's header: the file is truncated")
    magic, version, code, sequences, documents = IDX_FIELDS.unpack(header)
    if magic != _INDEX_HEADER or version != 1:
        raise ConfigError(f"{idx} is not a Megatron index (version 1): its header is {header[:17]!r}")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise ConfigError(f"{idx}: unknown token dtype code {code}") from None
    expected = IDX_FIELDS.size + 12 * sequences + 8 * documents
    if size != expected:
        raise ConfigError(f"{idx}: {size} bytes, but its header describes {sequences} sequences and {documents} "
                          f"document boundaries ({expected} bytes): the file is truncated or damaged")
    mapped = np.memmap(idx, dtype=np.uint8, mode="r")
    lengths = mapped[IDX_FIELDS.size:IDX_FIELDS.size + 4 * sequences].view(np.int32)
    pointers = mapped[IDX_FIELDS.size + 4 * sequences:IDX_FIELDS.size + 12 * sequences].view(np.int64)
    boundaries = mapped[IDX_FIELDS.size + 12 * sequences:].view(np.int64)
    itemsize = np.dtype(dtype).itemsize
    tokens = int(pointers[-1]) // itemsize + int(lengths[-1]) if sequences else 0
    bin_size = bin_path.stat().st_size
    if bin_size != tokens * itemsize:
        raise ConfigError(f"{bin_path}: {bin_size} bytes, but {idx} describes {tokens} tokens of "
                          f"{np.dtype(dtype)} ({tokens * itemsize} bytes): the file is truncated or not this index's")
    return IndexedFiles(prefix, dtype, lengths, pointers, boundaries, tokens)


def read_indexed_files(prefix: str) -> IndexedFiles:
    """PREFIX.idx mapped and checked whole (lengths, offsets, boundaries), block by block, and PREFIX.bin's
    size against it; a ConfigError naming the file otherwise."""
    files = map_indexed_files(prefix)
    idx = f"{prefix}.idx"
    sequences, boundaries = len(files.lengths), files.boundaries
    # The cheap ends first: a sparse or zeroed file fails here without a pass over it.
    if len(boundaries) == 0 or boundaries[0] != 0 or boundaries[-1] != sequences:
        raise ConfigError(f"{idx}: its document boundaries are not an increasing run from 0 to its {sequences} "
                          "sequences: the index is damaged")
    # Offsets that follow from the lengths, the last of them (checked when mapped) ending at the .bin's end.
    itemsize, offset = np.dtype(files.dtype).itemsize, 0
    for start in range(0, sequences, _SCAN):
        lengths = files.lengths[start:start + _SCAN].astype(np.int64)
        ends = offset + np.cumsum(lengths)
        if (lengths < 0).any() or not np.array_equal(files.pointers[start:start + _SCAN], (ends - lengths) * itemsize):
            raise ConfigError(f"{idx}: its sequence lengths and byte offsets disagree: the index is damaged")
        offset = int(ends[-1])
    for start in range(0, len(boundaries) - 1, _SCAN):  # blocks overlap by one boundary
        if (np.diff(boundaries[start:start + _SCAN + 1]) < 0).any():
            raise ConfigError(f"{idx}: its document boundaries are not an increasing run from 0 to its {sequences} "
                              "sequences: the index is damaged")
    return files
