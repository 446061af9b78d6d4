"""Streaming reader for pretraining corpus shards (Nemotron-CC layout and similar).

Finds shards from globs/dirs and yields their documents one JSON line (or parquet row) at a time,
never holding a whole shard in memory. Bad records are handed to a callback with file and line so
that one broken line never costs its good neighbours.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import zstandard

# Nemotron-CC v1 ships zstd JSONL, v2 parquet; the others are common in the wild.
SHARD_SUFFIXES = (".jsonl.zstd", ".jsonl.zst", ".jsonl.gz", ".jsonl", ".parquet")

_READ_CHUNK_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 1024


class NoInputMatchedError(ValueError):
    """An input path, dir or glob matched no file with a supported suffix."""


class TruncatedStreamError(EOFError):
    """A compressed shard ends in the middle of a frame."""


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


def resolve_inputs(patterns: Iterable[str], suffixes: Sequence[str] = SHARD_SUFFIXES) -> list[Path]:
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


def read_documents(path: Path, json_key: str, on_bad: OnBadRecord) -> Iterator[Document]:
    """Yield every well-formed document of one shard; report everything else to `on_bad`."""
    records = _parquet_documents if str(path).endswith(".parquet") else _jsonl_documents
    count = 0
    for document in records(path, json_key, on_bad):
        count += 1
        yield document
    if count == 0:
        on_bad(BadRecord(str(path), 0, "empty_shard", "shard holds no document"))


def _jsonl_documents(path: Path, json_key: str, on_bad: OnBadRecord) -> Iterator[Document]:
    line_number = 0
    try:
        with _open_binary(path) as stream:
            # Lines stay bytes until each is decoded on its own: one invalid byte sequence
            # must not poison the rest of the shard, as a TextIOWrapper would.
            for line_number, raw in enumerate(stream, start=1):
                if not raw.strip():
                    continue
                document = _parse_json_line(path, line_number, raw, json_key, on_bad)
                if document is not None:
                    yield document
    except (EOFError, zstandard.ZstdError, gzip.BadGzipFile) as error:
        # gzip raises EOFError, our zstd reader TruncatedStreamError (an EOFError), corrupt data
        # ZstdError or BadGzipFile; the lines before the damage have been yielded already.
        on_bad(BadRecord(str(path), line_number + 1, "truncated", f"stream ends early ({error})"))


def _parse_json_line(
    path: Path, line_number: int, raw: bytes, json_key: str, on_bad: OnBadRecord
) -> Document | None:
    def bad(kind: str, detail: str) -> None:
        on_bad(BadRecord(str(path), line_number, kind, detail))

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
    if not isinstance(record, dict) or json_key not in record:
        bad("missing_key", f"no {json_key!r} key")
        return None
    text = record[json_key]
    if not isinstance(text, str):
        bad("non_string_text", f"{json_key!r} is {type(text).__name__}, not a string")
        return None
    return Document(line_number, text, len(raw))


def _parquet_documents(path: Path, json_key: str, on_bad: OnBadRecord) -> Iterator[Document]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if json_key not in parquet.schema_arrow.names:
        on_bad(BadRecord(str(path), 0, "missing_key", f"no {json_key!r} column"))
        return
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[json_key]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                on_bad(BadRecord(str(path), row, "missing_key", f"{json_key!r} is null"))
            elif not isinstance(text, str):
                kind = type(text).__name__
                on_bad(BadRecord(str(path), row, "non_string_text", f"{json_key!r} is {kind}"))
            else:
                yield Document(row, text, len(text.encode("utf-8", "surrogatepass")))


def _open_binary(path: Path) -> io.BufferedIOBase:
    name = str(path)
    if name.endswith((".zstd", ".zst")):
        return io.BufferedReader(_ZstdStream(open(path, "rb")), buffer_size=_READ_CHUNK_BYTES)
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=_READ_CHUNK_BYTES)


class _ZstdStream(io.RawIOBase):
    """Streaming zstd decompression that, unlike zstandard's stream_reader, reports truncation.

    Supports concatenated frames (as written by parallel compressors).
    """

    def __init__(self, compressed: io.BufferedIOBase):
        self._compressed = compressed
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._frame_started = False
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._compressed.read(_READ_CHUNK_BYTES)
            if not chunk:
                if self._frame_started and not self._frame.eof:
                    raise TruncatedStreamError("compressed input ends inside a zstd frame")
                return 0
            self._pending = memoryview(self._decompress(chunk))
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

