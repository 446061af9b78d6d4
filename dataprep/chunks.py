"""Cutting input files into chunks that processes tokenize independently and that merge back, in order, into
exactly the result of one pass over the file.

An uncompressed JSONL file is cut into byte ranges at line ends, which each process reads itself; a
compressed one is decompressed once, by the planner, and its blocks of whole lines are handed to the
processes; a parquet file is cut at row-group boundaries. The cut points depend only on the file and
the chunk size, so a rerun plans the same chunks and can reuse those that were finished.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dataprep.input_files import (
    DEFAULT_MAX_INFLATE_RATIO,
    BadRecord,
    Document,
    OnBadRecord,
    count_lines,
    documents_in_lines,
    is_compressed,
    is_parquet,
    line_limit,
    open_parquet,
    open_parquet_metadata,
    parquet_row_group_documents,
    read_line_blocks,
)

MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 256 << 20
CHUNKS_PER_LARGE_FILE = 64  # enough to keep the processes busy on one file, few enough to merge quickly
_SCAN_BYTES = 1 << 16


@dataclass(frozen=True)
class Chunk:
    file_index: int  # the input file's position in the run's sorted input list
    index: int  # the chunk's position within its file
    path: Path
    start: int  # JSONL: byte offset in the (decompressed) stream; parquet: first row group
    stop: int  # exclusive
    # Records (lines, parquet rows) of the file before this chunk; None for uncompressed JSONL, where
    # knowing it would mean reading everything before (see `records_before`).
    records_before: int | None

    @property
    def reads_itself(self) -> bool:
        """Whether a process reads the chunk from the file (else the planner hands it the bytes)."""
        return not is_compressed(self.path)

    @property
    def name(self) -> str:
        return f"input-{self.file_index:05d}-chunk-{self.index:05d}"


def chunk_bytes_for(path: Path, override: int | None = None) -> int:
    """The target chunk size: a fixed share of the (on-disk) input file, within [1 MiB, 256 MiB]."""
    if override is not None:
        return override
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, path.stat().st_size // CHUNKS_PER_LARGE_FILE))


def plan_chunks(
    file_index: int, path: Path, chunk_bytes: int, column: str, max_record_bytes: int, on_bad: OnBadRecord,
    max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO,
) -> Iterator[tuple[Chunk, bytes | None]]:
    """The input file's chunks in order, each with its bytes when a process cannot read it itself.

    Problems of the whole file (unreadable, truncated, no such parquet column) go to `on_bad`.
    """
    if is_parquet(path):
        yield from ((chunk, None) for chunk in _parquet_chunks(file_index, path, chunk_bytes, column, on_bad))
    elif is_compressed(path):
        start = lines = 0
        for index, block in enumerate(read_line_blocks(path, chunk_bytes, max_record_bytes, on_bad, max_inflate_ratio)):
            yield Chunk(file_index, index, path, start, start + len(block), lines), block
            start += len(block)
            lines += block.count(b"\n")
    else:
        try:
            ranges = list(_line_ranges(path, chunk_bytes))
        except OSError as error:
            on_bad(BadRecord(str(path), 0, "unreadable_file", f"cannot read the file ({error})"))
            return
        for index, (start, stop) in enumerate(ranges):
            yield Chunk(file_index, index, path, start, stop, None), None


def load_chunk(chunk: Chunk, payload: bytes | None, max_record_bytes: int, on_bad: OnBadRecord) -> bytes | None:
    """A JSONL chunk's bytes (read from the file when the planner did not hand them over, lines longer than
    `max_record_bytes` reported, with their line in the chunk, and left empty); None for parquet."""
    if payload is not None or is_parquet(chunk.path):
        return payload
    limit = line_limit(chunk.path, max_record_bytes, on_bad)
    data = bytearray()
    with open(chunk.path, "rb") as file:
        file.seek(chunk.start)
        remaining = chunk.stop - chunk.start
        while remaining and (piece := file.read(min(remaining, MIN_CHUNK_BYTES))):
            data += limit.feed(piece)
            remaining -= len(piece)
    return bytes(data + limit.finish())


def count_records(chunk: Chunk, data: bytes | None) -> int:
    """Lines (parquet rows) in the chunk, good or bad."""
    if data is not None:
        return count_lines(data)
    metadata = open_parquet_metadata(chunk.path)
    return sum(metadata.row_group(group).num_rows for group in range(chunk.start, chunk.stop))


def chunk_documents(chunk: Chunk, data: bytes | None, column: str, max_record_bytes: int, on_bad: OnBadRecord,
                    max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO) -> Iterator[Document]:
    """The chunk's documents (`data` from `load_chunk`); line (row) numbers count from 1 at the chunk's start."""
    if data is not None:
        yield from documents_in_lines(chunk.path, data, 1, column, on_bad)
        return
    parquet = open_parquet(chunk.path, column, on_bad)
    if parquet is not None:
        yield from parquet_row_group_documents(chunk.path, parquet, range(chunk.start, chunk.stop), 1, column,
                                               max_record_bytes, on_bad, max_inflate_ratio)


def records_before(chunk: Chunk) -> int:
    """Lines (rows) of the input file before the chunk, counting them in the file when not planned."""
    if chunk.records_before is not None:
        return chunk.records_before
    count = 0
    with open(chunk.path, "rb") as file:
        remaining = chunk.start
        while remaining and (piece := file.read(min(remaining, MIN_CHUNK_BYTES))):
            count += piece.count(b"\n")
            remaining -= len(piece)
    return count


def _line_ranges(path: Path, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of whole lines: each ends at the first newline at or after `chunk_bytes` from its start
    (the rule `read_line_blocks` applies to streams), the last at the end of the file."""
    size = path.stat().st_size
    start = 0
    with open(path, "rb") as file:
        while start < size:
            stop = size
            position = start + chunk_bytes - 1
            file.seek(position)
            while position < size:
                piece = file.read(_SCAN_BYTES)
                newline = piece.find(b"\n")
                if newline >= 0:
                    stop = position + newline + 1
                    break
                position += len(piece)
            yield start, stop
            start = stop


def _parquet_chunks(file_index: int, path: Path, chunk_bytes: int, column: str, on_bad: OnBadRecord) -> Iterator[Chunk]:
    parquet = open_parquet(path, column, on_bad)
    if parquet is None:
        return
    metadata = parquet.metadata
    chunks = first_group = rows_before = 0
    for group in range(metadata.num_row_groups):
        groups = range(first_group, group + 1)
        size = sum(metadata.row_group(g).total_byte_size for g in groups)
        if size >= chunk_bytes or group == metadata.num_row_groups - 1:
            yield Chunk(file_index, chunks, path, first_group, group + 1, rows_before)
            chunks, first_group = chunks + 1, group + 1
            rows_before += sum(metadata.row_group(g).num_rows for g in groups)
