"""Streaming reader for a pretraining corpus's input files (Nemotron-CC's and similar).

Finds input files from globs/dirs and turns their records (JSON lines, parquet rows) into documents, never
holding a whole file, or more than --max-document-bytes of one record, in memory. Bad records are handed to a
callback with file and line so that one broken line never costs its good neighbours; an input file that cannot be
read at all is one bad record.
"""
from __future__ import annotations

import codecs
import functools
import glob
import gzip
import io
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from dataprep.long_lines import LineLimit

# Nemotron-CC v1 ships zstd JSONL, v2 parquet; the others are common in the wild.
INPUT_SUFFIXES = (".jsonl.zstd", ".jsonl.zst", ".jsonl.gz", ".jsonl", ".parquet")

_READ_CHUNK_BYTES = 1 << 20
# A zstd block inflates to at most 128 KiB from 4 bytes, so this much input gives at most 32 MiB of output
# (and reads at ~90% of the speed of whole 1 MiB reads, which could inflate to 32 GiB).
_ZSTD_FEED_BYTES = 1024
DEFAULT_MAX_DOCUMENT_BYTES = 16 << 20  # a record (JSON line, parquet text) longer than this is dropped
# Text compresses 3-10x, repetitive text 100x: an input file (or parquet column chunk) that inflates past this
# many times its stored bytes is a bomb, and the rest of it is dropped as one bad record. Any file may inflate
# to INFLATE_FLOOR_BYTES, so that a tiny file of repeated text is not taken for one.
DEFAULT_MAX_INFLATE_RATIO = 1000.0
INFLATE_FLOOR_BYTES = 16 << 20
_PARQUET_BATCH_ROWS = 1024
_PARQUET_BATCH_BYTES = 1 << 30  # rows per batch are cut so that even rows of --max-document-bytes fit in this


class NoInputMatchedError(ValueError):
    """An input path, dir or glob matched no file with a supported suffix."""


class TruncatedStreamError(EOFError):
    """A compressed input file ends in the middle of a frame."""


@dataclass(frozen=True)
class BadRecord:
    path: str
    line: int  # 1-based line (row for parquet); 0 for problems of the whole file
    kind: str  # short machine-readable category, e.g. "malformed_json"
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.detail}"


@dataclass(frozen=True)
class Document:
    line: int
    text: str
    nbytes: int  # uncompressed input bytes this record occupied, for throughput reporting


OnBadRecord = Callable[[BadRecord], None]


def has_suffix(path: Path | str, suffixes: Sequence[str]) -> bool:
    return str(path).endswith(tuple(suffixes))


def resolve_inputs(patterns: Iterable[str], suffixes: Sequence[str] = INPUT_SUFFIXES) -> list[Path]:
    """Expand files, dirs (searched recursively) and globs into a sorted, de-duplicated list.

    Raises NoInputMatchedError naming the first pattern that yields no usable file, so a typo
    never silently shrinks a corpus.
    """
    found: set[Path] = set()
    for pattern in patterns:
        matches: list[Path] = []
        for hit in sorted(glob.glob(pattern, recursive=True)) or []:
            path = Path(hit)
            if path.is_dir():
                matches += [p for p in path.rglob("*") if p.is_file() and has_suffix(p, suffixes)]
            elif path.is_file() and has_suffix(path, suffixes):
                matches.append(path)
        if not matches:
            raise NoInputMatchedError(
                f"input {pattern!r} matched no file ending in one of {', '.join(suffixes)}"
            )
        found.update(p.resolve() for p in matches)
    return sorted(found)


def is_parquet(path: Path | str) -> bool:
    return str(path).endswith(".parquet")


def is_compressed(path: Path | str) -> bool:
    return str(path).endswith((".zstd", ".zst", ".gz"))


def read_documents(path: Path, json_key: str, on_bad: OnBadRecord, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
                   max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO) -> Iterator[Document]:
    """Yield every well-formed document of one input file; report everything else to `on_bad`."""
    records = functools.partial(_parquet_documents if is_parquet(path) else _jsonl_documents, max_bytes=max_bytes,
                                max_inflate_ratio=max_inflate_ratio)
    unreadable = False

    def note(record: BadRecord) -> None:
        nonlocal unreadable
        unreadable |= record.line == 0
        on_bad(record)

    count = 0
    for document in records(path, json_key, note):
        count += 1
        yield document
    if count == 0 and not unreadable:
        on_bad(BadRecord(str(path), 0, "empty_file", "the file holds no document"))


def _jsonl_documents(path: Path, json_key: str, on_bad: OnBadRecord, max_bytes: int,
                     max_inflate_ratio: float) -> Iterator[Document]:
    lines = 0
    for block in read_line_blocks(path, _READ_CHUNK_BYTES, max_bytes, on_bad, max_inflate_ratio):
        yield from documents_in_lines(path, block, lines + 1, json_key, on_bad)
        lines += count_lines(block)


def count_lines(block: bytes) -> int:
    """Lines in a block of whole lines (the last may lack its newline)."""
    return block.count(b"\n") + (1 if block and not block.endswith(b"\n") else 0)


def line_limit(path: Path, max_bytes: int, on_bad: OnBadRecord) -> LineLimit:
    """A LineLimit that reports each line over `max_bytes` as a bad record of `path` (line numbers from 1)."""
    def report(line: int) -> None:
        on_bad(BadRecord(str(path), line, "oversize_record",
                         f"line longer than {max_bytes} bytes (--max-document-bytes): dropped unread"))

    return LineLimit(max_bytes, report)


def inflate_allowance(stored_bytes: int, max_inflate_ratio: float) -> float:
    """The most bytes `stored_bytes` of compressed input may inflate to (inf: a ratio of inf, no bound)."""
    return max(INFLATE_FLOOR_BYTES, stored_bytes * max_inflate_ratio)


def read_line_blocks(path: Path, min_bytes: int, max_line_bytes: int, on_bad: OnBadRecord,
                     max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO) -> Iterator[bytes]:
    """The (decompressed) bytes of a JSONL input file in blocks of whole lines, each ending at the first
    newline at or after `min_bytes` (the last block: at the end of the stream). The cut points depend
    only on the content and `min_bytes`, so a rerun cuts the same blocks. A line longer than
    `max_line_bytes` is reported and left empty (streamed past, never held).

    A damaged or truncated compressed stream ends the blocks at the last whole line before the damage
    and is reported, and so does a compressed file at the point where it inflates past `max_inflate_ratio`
    times its size on disk (`inflate_allowance`); a file that is not what its name says is reported as
    unreadable.
    """
    buffer = bytearray()
    lines = produced = 0
    limit = line_limit(path, max_line_bytes, on_bad)
    allowed = None
    try:
        if is_compressed(path):
            allowed = inflate_allowance(path.stat().st_size, max_inflate_ratio)
        with _open_binary(path) as stream:
            # read1: one raw read at a time, so the bytes before a truncation are not lost with it
            while chunk := stream.read1(_READ_CHUNK_BYTES):
                produced += len(chunk)
                if allowed is not None and produced > allowed:  # the lines within the bound are kept
                    buffer += limit.feed(chunk[:len(chunk) - (produced - int(allowed))])
                    break
                buffer += limit.feed(chunk)
                while len(buffer) >= min_bytes and (end := buffer.find(b"\n", min_bytes - 1)) >= 0:
                    block = bytes(buffer[: end + 1])
                    del buffer[: end + 1]
                    lines += block.count(b"\n")
                    yield block
    except (EOFError, zstandard.ZstdError, gzip.BadGzipFile, OSError) as error:
        # gzip raises EOFError, our zstd reader TruncatedStreamError (an EOFError), corrupt data
        # ZstdError or BadGzipFile. The partial last line is dropped with the damage.
        if produced == 0:
            on_bad(BadRecord(str(path), 0, "unreadable_file", f"cannot read the file ({error})"))
            return
        if buffer:  # whole lines only: the partial last one stays in the limit, dropped
            lines += count_lines(bytes(buffer))
            yield bytes(buffer)
        on_bad(BadRecord(str(path), lines + 1, "truncated", f"stream ends early ({error})"))
        return
    if allowed is not None and produced > allowed:  # the line it stopped in is dropped with the rest
        if buffer:
            yield bytes(buffer)
        on_bad(BadRecord(str(path), limit.line, "inflate_ratio",
                         f"the file inflates past {allowed:.0f} bytes, {max_inflate_ratio:g} times its "
                         f"{path.stat().st_size} bytes on disk (--max-inflate-ratio): the rest of it is dropped"))
        return
    buffer += limit.finish()
    if buffer:
        yield bytes(buffer)


def documents_in_lines(
    path: Path, block: bytes, first_line: int, json_key: str, on_bad: OnBadRecord
) -> Iterator[Document]:
    """The documents of a block of whole JSON lines whose first line is line `first_line` of the file."""
    # Lines stay bytes until each is decoded on its own: one invalid byte sequence must not poison the
    # rest of the file, as a TextIOWrapper would.
    for line_number, raw in enumerate(io.BytesIO(block), start=first_line):
        if not raw.strip():
            continue
        document = _parse_json_line(path, line_number, raw, json_key, on_bad)
        if document is not None:
            yield document


def _parse_json_line(
    path: Path, line_number: int, raw: bytes, json_key: str, on_bad: OnBadRecord
) -> Document | None:
    def bad(kind: str, detail: str) -> None:
        on_bad(BadRecord(str(path), line_number, kind, detail))

    # A UTF-8 byte-order mark: Windows tools start files with one (and concatenated files carry it inside).
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad("invalid_utf8", f"invalid UTF-8 at byte {error.start} of the line")
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        bad("malformed_json", error.msg + f" (column {error.colno})")
        return None
    except RecursionError:  # Python's parser recurses once per level: 100,000 nested `[` end here
        bad("malformed_json", "nested deeper than Python's recursion limit")
        return None
    if not isinstance(record, dict) or json_key not in record:
        bad("missing_key", f"no {json_key!r} key")
        return None
    text = record[json_key]
    if not isinstance(text, str):
        bad("non_string_text", f"{json_key!r} is {type(text).__name__}, not a string")
        return None
    # A "\ud800" escape decodes to a lone surrogate, which no tokenizer can encode; only an escape
    # can produce one (raw UTF-8 cannot), so the full check runs only on lines that have one.
    if (b"\\ud" in raw or b"\\uD" in raw) and _has_lone_surrogate(text):
        bad("lone_surrogate", f"{json_key!r} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape)")
        return None
    return Document(line_number, text, len(raw))


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def open_parquet(path: Path, column: str, on_bad: OnBadRecord):
    """The input file's pyarrow ParquetFile, or None (reported) when it is no parquet file or lacks the column."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as error:
        on_bad(BadRecord(str(path), 0, "unreadable_file", f"not a readable parquet file ({error})"))
        return None
    if column not in parquet.schema_arrow.names:
        on_bad(BadRecord(str(path), 0, "missing_column",
                         f"no {column!r} column (columns: {', '.join(parquet.schema_arrow.names)})"))
        return None
    return parquet


def open_parquet_metadata(path: Path):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata


def parquet_row_group_documents(
    path: Path, parquet, groups: range, first_row: int, column: str, max_bytes: int, on_bad: OnBadRecord,
    max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO,
) -> Iterator[Document]:
    """The documents of row groups `groups`, whose first row is row `first_row` (1-based) of the file.

    Nothing over a limit is held as Python text: a row group whose column inflates past `max_inflate_ratio`
    times its stored bytes (by the file's metadata, or by the rows read so far: a dictionary repeats one
    value) is dropped from there on as one bad record, and a row longer than `max_bytes` is reported from
    its length in the Arrow batch, before its text is made."""
    row = first_row - 1
    batch_rows = max(1, min(_PARQUET_BATCH_ROWS, _PARQUET_BATCH_BYTES // max_bytes))
    for group in groups:
        metadata = parquet.metadata.row_group(group)
        last = row + metadata.num_rows
        stored, inflated = _column_chunk_bytes(metadata, column)
        allowed = inflate_allowance(stored, max_inflate_ratio)
        decoded = inflated if inflated > allowed else 0  # the metadata's count, then the rows' (dictionaries)
        batches = parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=[column])
        while decoded <= allowed and (batch := next(batches, None)) is not None:
            values = batch.column(0)
            sizes = _text_sizes(values)
            decoded += int(sizes.sum()) if sizes is not None else 0
            if decoded > allowed:
                break
            for index, text in enumerate(_texts(values, sizes, max_bytes)):
                row += 1
                if sizes is not None and sizes[index] > max_bytes:
                    on_bad(BadRecord(str(path), row, "oversize_record", f"{column!r} is {sizes[index]} bytes, "
                                                                        f"over --max-document-bytes {max_bytes}"))
                elif text is None:
                    on_bad(BadRecord(str(path), row, "missing_key", f"{column!r} is null"))
                elif not isinstance(text, str):
                    on_bad(BadRecord(str(path), row, "non_string_text", f"{column!r} is {type(text).__name__}"))
                else:
                    yield Document(row, text, int(sizes[index]))
        if row < last:
            on_bad(BadRecord(str(path), row + 1, "inflate_ratio",
                             f"row group {group}: {column!r} inflates past {allowed:.0f} bytes, {max_inflate_ratio:g} "
                             f"times its {stored} stored bytes (--max-inflate-ratio): its {last - row} row(s) from here "
                             "are dropped"))
            row = last


def _texts(values, sizes: np.ndarray | None, max_bytes: int) -> list:
    """The batch's values as Python objects, None for those longer than `max_bytes` (never made)."""
    if sizes is None or not (sizes > max_bytes).any():
        return values.to_pylist()
    return [None if size > max_bytes else values[index].as_py() for index, size in enumerate(sizes)]


def _column_chunk_bytes(row_group, column: str) -> tuple[int, int]:
    """The stored (compressed) and the uncompressed bytes of `column` in a row group, by its metadata."""
    chunks = [row_group.column(index) for index in range(row_group.num_columns)]
    mine = [chunk for chunk in chunks if f"{chunk.path_in_schema}.".startswith(f"{column}.")]
    return sum(c.total_compressed_size for c in mine), sum(c.total_uncompressed_size for c in mine)


def _text_sizes(values) -> np.ndarray | None:
    """The bytes of each value of a text (or binary) Arrow array, from its offsets, without making the values
    (0 for a null; a dictionary's by its indices); None for a column of another type."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(values.type):
        sizes = _text_sizes(values.dictionary)
        if sizes is None:
            return None
        indices = values.indices.fill_null(0).to_numpy(zero_copy_only=False)
        return np.where(values.is_null().to_numpy(zero_copy_only=False), 0, sizes[indices] if len(sizes) else 0)
    kind = values.type
    if not any(test(kind) for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view,
                                       pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view)):
        return None
    return pc.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _parquet_documents(path: Path, json_key: str, on_bad: OnBadRecord, max_bytes: int,
                       max_inflate_ratio: float) -> Iterator[Document]:
    parquet = open_parquet(path, json_key, on_bad)
    if parquet is not None:
        groups = range(parquet.metadata.num_row_groups)
        yield from parquet_row_group_documents(path, parquet, groups, 1, json_key, max_bytes, on_bad,
                                               max_inflate_ratio)


def _open_binary(path: Path) -> io.BufferedIOBase:
    name = str(path)
    if name.endswith((".zstd", ".zst")):
        return io.BufferedReader(_ZstdStream(open(path, "rb")), buffer_size=_READ_CHUNK_BYTES)
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=_READ_CHUNK_BYTES)


class _ZstdStream(io.RawIOBase):
    """Streaming zstd decompression that, unlike zstandard's stream_reader, reports truncation, and
    that inflates a small piece of input at a time, so one read never yields more than 32 MiB however
    far the data inflates.

    Supports concatenated frames (as written by parallel compressors).
    """

    def __init__(self, compressed: io.BufferedIOBase):
        self._compressed = compressed
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._frame_started = False
        self._input = memoryview(b"")  # read from the file, not yet inflated
        self._pending = memoryview(b"")  # inflated, not yet handed out

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            if not self._input:
                self._input = memoryview(self._compressed.read(_READ_CHUNK_BYTES))
                if not self._input:
                    if self._frame_started and not self._frame.eof:
                        raise TruncatedStreamError("compressed input ends inside a zstd frame")
                    return 0
            piece, self._input = self._input[:_ZSTD_FEED_BYTES], self._input[_ZSTD_FEED_BYTES:]
            self._pending = memoryview(self._decompress(bytes(piece)))
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def _decompress(self, chunk: bytes) -> bytes:
        output = []
        while chunk:
            self._frame_started = True
            output.append(self._frame.decompress(chunk))
            chunk = self._frame.unused_data if self._frame.eof else b""
            if self._frame.eof:
                self._frame = self._decompressor.decompressobj()
                self._frame_started = False
        return b"".join(output)

    def close(self) -> None:
        self._compressed.close()
        super().close()
