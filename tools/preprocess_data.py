"""Tokenize a corpus's input files into Megatron's indexed dataset format (P_text_document.bin/.idx/.meta.json).

python tools/preprocess_data.py --input <files/dirs/globs ...> --output-prefix P \
    --tokenizer-model M [--tokenizer-type T] [--json-key text] [--processes N] [--strict] [--keep-parts]
    [--partition I/N] [--input-files-per-output K] [--max-tokens-per-file T]
python tools/preprocess_data.py --merge-manifests 'P_partition-*.json' --data-args-path P.data_args \
    [--subset-weights high=2,medium=1 | weights.json]

One document per JSON line (or parquet row), each followed by the end-of-document token (unless
--no-append-eod). Megatron's spellings work too: --json-keys text, --append-eod, --workers N (for
--processes), --tokenizer-type SentencePieceTokenizer|HuggingFaceTokenizer. --tokenizer-model names a
SentencePiece .model, a Hugging Face tokenizer.json, or a folder holding one.

Each input file is cut into chunks (dataprep.chunks) so that N processes share even one big file: uncompressed
JSONL by byte ranges, compressed JSONL decompressed once here and handed out in blocks of lines, parquet by
row groups. Each chunk's result is published atomically as a part file pair in a .parts/ folder with a
manifest; the parts are merged in order, so the output is byte-identical for any number of processes. The
processes only tokenize (into each part's .bin); this one writes the .idx files with Megatron's own writer, whose
import (torch and megatron.core, seconds) it makes while the first chunks are tokenized. A rerun
with the same arguments reuses the finished chunks, so an interrupted run resumes; the final files appear
only once complete, their .meta.json (dataprep.dataset_meta) last.

Without --partition, --input-files-per-output or --max-tokens-per-file everything goes into P_text_document.
With any of them there is one output per input group (dataprep.partition: K consecutive input files of one
subset, default 1), written as P_000123_text_document (P_000123_0000_text_document, ... when cut by
--max-tokens-per-file), the same files whichever process writes them. --partition I/N (or a Slurm
array's variables) processes only the I-th of N shares of the groups and records them in
P_partition-IIIII-of-NNNNN.json (dataprep.manifest); a rerun skips its finished groups. --merge-manifests
checks that the partitions covered every input file exactly once and writes the blend (dataprep.blend).

Bad records (malformed JSON, missing key, invalid UTF-8, lone surrogates, a record longer than
--max-document-bytes, ...) are dropped, counted and reported with file and line; an input file that cannot be
read is reported and skipped. --strict stops at the first. Writing no document at all is an error. No input is
held whole: compressed files inflate a piece at a time and an over-long line streams past unread.
"""
from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Self

import numpy as np

from dataprep.blend import BlendEntry, parse_subset_weights, subset_multipliers, write_data_args
from dataprep.chunks import (
    Chunk,
    chunk_bytes_for,
    chunk_documents,
    count_records,
    load_chunk,
    plan_chunks,
    records_before,
)
from dataprep.dataset_meta import DatasetMeta, meta_path, write_dataset_meta
from dataprep.indexed_writer import DocumentWriter, document_lengths, load_index_code, plan_files, write_index
from dataprep.listing import Listing
from dataprep.input_files import DEFAULT_MAX_DOCUMENT_BYTES, BadRecord, NoInputMatchedError, resolve_inputs
from dataprep.input_files import DEFAULT_MAX_INFLATE_RATIO, is_parquet
from dataprep.manifest import (
    GroupRecord,
    ManifestError,
    OutputFile,
    PartitionManifest,
    SubsetStats,
    check_coverage,
    manifest_path,
    output_file_problem,
    read_manifest,
    subset_totals,
    write_manifest,
)
from dataprep.partition import InputGroup, Partition, PartitionError, assign_groups, plan_groups
from dataprep.progress import ProgressLine
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import TOKENIZER_TYPES, load_tokenizer
from muloco.core.durable import fsync_dir, write_text_durably
from muloco.core.small_files import loads_json, read_capped_text

# Bump when the part file contents would change for the same inputs, to invalidate old parts.
PART_FORMAT_VERSION = 2
BAD_RECORDS_REPORTED_PER_FILE = 10
ENCODE_BATCH_DOCUMENTS = 64
ENCODE_BATCH_BYTES = 4 << 20  # the tokenizer needs tens of bytes per byte of text: batches stay small
PROGRESS_EVERY_DOCUMENTS = 256
CHUNKS_IN_FLIGHT_PER_PROCESS = 2  # bounds the decompressed bytes held for the processes
# Test hook: "FILE:CHUNK:DOCUMENTS" SIGKILLs the process once that many documents of that chunk (of that input file,
# by its position in the listing) are encoded.
KILL_HOOK_ENV = "MULOCO_PREPROCESS_TEST_KILL_AT"
PART_MANIFEST_MAX_BYTES = 64 << 20  # a chunk's stats, or an input file's chunk plan (about 40 bytes a chunk)


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer_model: Path
    tokenizer_type: str | None = None  # None: read from the model file
    json_key: str = "text"
    append_eod: bool = True
    processes: int = 1
    strict: bool = False
    keep_parts: bool = False
    chunk_bytes: int | None = None  # None: a share of each input file (dataprep.chunks.chunk_bytes_for)
    partition: Partition | None = None  # None: this process covers the whole input
    input_files_per_output: int | None = None  # None: 1 when there is one output per input group
    max_tokens_per_file: int | None = None
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES  # longer records are dropped as bad
    max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO  # a compressed file inflating further is cut there

    @property
    def output_per_group(self) -> bool:
        """One output per input group (else one output for everything)."""
        return not (self.partition is None and self.input_files_per_output is None
                    and self.max_tokens_per_file is None)

    @property
    def dataset_prefix(self) -> str:
        """The single output's dataset prefix (without one output per group)."""
        return f"{self.output_prefix}_text_document"


@dataclass(frozen=True)
class MergeConfig:
    manifests: tuple[str, ...]  # files or globs
    data_args_path: Path
    subset_weights: str | None = None  # dataprep.blend.parse_subset_weights


@dataclass
class ChunkStats:
    records: int = 0  # lines (parquet rows) in the chunk, good or bad
    documents: int = 0
    tokens: int = 0
    max_token_id: int = -1
    input_bytes: int = 0
    empty_documents: int = 0
    bad_by_kind: dict[str, int] = field(default_factory=dict)
    bad_examples: list[tuple[int, str, str]] = field(default_factory=list)  # the first few: (line in chunk, kind, detail)

    @property
    def bad_records(self) -> int:
        return sum(self.bad_by_kind.values())

    def record_bad(self, record: BadRecord) -> None:
        self.bad_by_kind[record.kind] = self.bad_by_kind.get(record.kind, 0) + 1
        if len(self.bad_examples) < BAD_RECORDS_REPORTED_PER_FILE:
            self.bad_examples.append((record.line, record.kind, record.detail))


@dataclass
class InputFilePlan:
    """An input file's chunks in order, and the problems of the whole file found while planning them."""

    file_index: int  # position in the listing
    path: Path
    fingerprint: str
    chunks: list[Chunk] = field(default_factory=list)
    problems: list[BadRecord] = field(default_factory=list)
    planned: bool = False  # every chunk is known


@dataclass(frozen=True)
class GroupOutput:
    """Where an input group's files go: `base`_text_document, or with pieces `base`_0000_text_document, ..."""

    group: InputGroup
    base: str  # P for the single output, P_000123 for group 123
    pieces: bool  # cut by --max-tokens-per-file

    def dataset_prefix(self, piece: int) -> str:
        return f"{self.base}_{piece:04d}_text_document" if self.pieces else f"{self.base}_text_document"

    @property
    def parts_dir(self) -> Path:
        return Path(f"{self.base}_text_document.parts")


@dataclass
class PreprocessSummary:
    input_files: int
    chunks: int
    reused_chunks: int  # complete parts reused from an earlier run
    reused_groups: int  # whole input groups a partition's earlier run finished
    documents: int
    tokens: int
    max_token_id: int
    empty_documents: int
    bad_records: int
    bad_by_kind: dict[str, int]
    subsets: dict[str, SubsetStats]
    files: list[str]  # dataset prefixes written (or kept from an earlier run)
    manifest: Path | None  # the partition's manifest (one output per group)
    seconds: float  # the whole run
    # First chunk handed out to last chunk done: imports, tokenizer loading and the merge excluded (the
    # processes' own start is in: it runs in parallel with the first chunks).
    tokenize_seconds: float
    processed_tokens: int  # tokenized in this run, excluding reused parts
    processed_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.processed_tokens / max(self.tokenize_seconds, 1e-9)

    @property
    def megabytes_per_second(self) -> float:
        return self.processed_bytes / 1e6 / max(self.tokenize_seconds, 1e-9)


class StrictModeError(RuntimeError):
    """--strict and a bad record was found."""


class NoDocumentsError(ValueError):
    """Every record was empty or bad: an empty dataset would only fail later, in training."""


def token_dtype(vocab_size: int) -> type[np.number]:
    return np.uint16 if vocab_size < 65500 else np.int32


def part_prefix(parts_dir: Path, chunk: Chunk) -> str:
    return str(parts_dir / chunk.name)


# ---------------------------------------------------------------------------------------------
# The pool's side (each of the --processes processes): one chunk per task.

_process: dict = {}


def _init_process(config: PreprocessConfig, progress_queue) -> None:
    # The processes must not die on the parent's Ctrl-C before the parent can report it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process
    tokenizer = load_tokenizer(config.tokenizer_model, config.tokenizer_type)
    kill_at = os.environ.get(KILL_HOOK_ENV)
    _process.update(
        config=config,
        tokenizer=tokenizer,
        dtype=token_dtype(tokenizer.vocab_size),
        progress=progress_queue,
        kill_at=tuple(int(x) for x in kill_at.split(":")) if kill_at else None,
    )


def _tokenize_chunk(chunk: Chunk, payload: bytes | None, prefix: str) -> tuple[ChunkStats, list[int]]:
    """The chunk's tokens in `prefix`.bin.tmp; its stats and the lengths of its documents (the parent writes the
    part's .idx and publishes it: `_publish_part`)."""
    config: PreprocessConfig = _process["config"]
    tokenizer = _process["tokenizer"]
    # A manifest left from different arguments must not vouch for the files about to be replaced.
    Path(f"{prefix}.json").unlink(missing_ok=True)
    stats = ChunkStats()

    def on_bad(record: BadRecord) -> None:
        if config.strict:
            line = records_before(chunk) + record.line
            raise StrictModeError(f"bad record (--strict): {BadRecord(record.path, line, record.kind, record.detail)}")
        stats.record_bad(record)

    bin_tmp = f"{prefix}.bin.tmp"
    writer = DocumentWriter(bin_tmp, _process["dtype"])
    reported = ChunkStats()
    data = load_chunk(chunk, payload, config.max_document_bytes, on_bad)
    stats.records = count_records(chunk, data)
    batch: list[str] = []
    batch_bytes = 0

    def add(texts: list[str]) -> None:
        # One native batch call, then one array per batch: no Python object per token beyond the ids.
        ids = tokenizer.encode_batch(texts)
        if config.append_eod:
            for document in ids:
                document.append(tokenizer.eod_id)
        lengths = [len(document) for document in ids]
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=writer.dtype, count=sum(lengths))
        documents_before = stats.documents
        writer.add_documents(tokens, lengths)
        stats.documents, stats.tokens, stats.max_token_id = writer.documents, writer.tokens, writer.max_token_id
        if stats.documents // PROGRESS_EVERY_DOCUMENTS > documents_before // PROGRESS_EVERY_DOCUMENTS:
            _report_progress(stats, reported)
        kill_at = _process["kill_at"]
        if (kill_at and kill_at[:2] == (chunk.file_index, chunk.index)
                and documents_before < kill_at[2] <= stats.documents):
            os.kill(os.getpid(), signal.SIGKILL)

    for document in chunk_documents(chunk, data, config.json_key, config.max_document_bytes, on_bad,
                                    config.max_inflate_ratio):
        stats.input_bytes += document.nbytes
        if not document.text:
            stats.empty_documents += 1
            continue
        batch.append(document.text)
        batch_bytes += document.nbytes
        if len(batch) == ENCODE_BATCH_DOCUMENTS or batch_bytes >= ENCODE_BATCH_BYTES:
            add(batch)
            batch, batch_bytes = [], 0
    if batch:
        add(batch)
    lengths = writer.close()
    _report_progress(stats, reported)
    _fsync_file(bin_tmp)
    return stats, lengths


def _report_progress(stats: ChunkStats, reported: ChunkStats) -> None:
    _process["progress"].put(stats.tokens - reported.tokens)
    reported.tokens = stats.tokens


def _publish_part(prefix: str, dtype: type[np.number], lengths: list[int], stats: ChunkStats, fingerprint: str) -> None:
    """A tokenized chunk's .idx (Megatron's writer, which the tokenizing processes never import), then its files
    under their names; the manifest last: it marks the part complete."""
    idx_tmp = f"{prefix}.idx.tmp"
    write_index(idx_tmp, dtype, lengths)
    _fsync_file(idx_tmp)
    os.replace(f"{prefix}.bin.tmp", f"{prefix}.bin")
    os.replace(idx_tmp, f"{prefix}.idx")
    manifest = {"fingerprint": fingerprint, "part_sizes": _part_sizes(prefix), "stats": asdict(stats)}
    write_text_durably(Path(f"{prefix}.json"), json.dumps(manifest))


# ---------------------------------------------------------------------------------------------
# Parent side: plan, resume, hand out, write each group's files.


# The fingerprints hash their identity's keys as first spelled ("shard", "bucket", "shards_per_file", ...): the same
# inputs and options keep their fingerprints across the renames, so a run started before one still resumes.


def file_fingerprint(path: Path, run_identity: dict, chunk_bytes: int) -> str:
    """Everything an input file's parts depend on; a change in any of them redoes the file."""
    stat = path.stat()
    identity = {**run_identity, "shard": str(path), "shard_size": stat.st_size,
                "shard_mtime_ns": stat.st_mtime_ns, "chunk_bytes": chunk_bytes}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def chunk_fingerprint(file_fingerprint_: str, chunk: Chunk) -> str:
    return hashlib.sha256(f"{file_fingerprint_}:{chunk.index}:{chunk.start}:{chunk.stop}".encode()).hexdigest()


def group_fingerprint(output_identity: dict, listing: Listing, group: InputGroup) -> str:
    """Everything a group's files depend on (chunking aside: it does not change them)."""
    files = [[listing.files[p].name, listing.files[p].size, listing.files[p].path.stat().st_mtime_ns]
             for p in group.input_files]
    first_spelling = {{"input_files_per_output": "shards_per_file"}.get(key, key): value
                      for key, value in output_identity.items()}
    identity = {**first_spelling, "group": group.index, "bucket": group.subset, "shards": files}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def completed_chunk_stats(parts_dir: Path, chunk: Chunk, fingerprint: str) -> ChunkStats | None:
    """The stats of a part finished by an earlier run with the same fingerprint, else None."""
    prefix = part_prefix(parts_dir, chunk)
    try:
        manifest = loads_json(read_capped_text(f"{prefix}.json", PART_MANIFEST_MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != fingerprint \
            or manifest.get("part_sizes") != _part_sizes(prefix):
        return None
    stats = ChunkStats(**manifest["stats"])
    stats.bad_examples = [tuple(example) for example in stats.bad_examples]
    return stats


def _input_order(chunk: Chunk) -> tuple[int, int]:
    return chunk.file_index, chunk.index


@dataclass(frozen=True)
class _Part:
    """Where a chunk handed out goes, and once tokenized, what its .idx needs."""

    chunk: Chunk
    prefix: str
    fingerprint: str
    stats: ChunkStats | None = None
    lengths: list[int] | None = None


class _ChunkDispatcher:
    """Hands chunks to the process pool, a bounded number at a time, publishes each finished one's part (its .idx
    written here, by Megatron's code) and reports it."""

    def __init__(self, config: PreprocessConfig, dtype: type[np.number], on_done: Callable[[Chunk, ChunkStats], None],
                 progress: ProgressLine):
        # fork: the processes inherit the already-imported tokenizer modules for free.
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        self._progress_queue = context.Queue()
        self._pool = ProcessPoolExecutor(max_workers=config.processes, mp_context=context,
                                         initializer=_init_process, initargs=(config, self._progress_queue))
        self._dtype = dtype
        self._max_in_flight = CHUNKS_IN_FLIGHT_PER_PROCESS * config.processes
        self._in_flight: dict[Future, _Part] = {}
        # Megatron's .idx code (torch and megatron.core, ~2.5 s) is imported by a thread while the first chunks are
        # tokenized, on a core the processes leave (or beside them); their parts wait for it in _unpublished.
        self._index_code: threading.Thread | None = None
        self._unpublished: list[_Part] = []
        self._on_done = on_done
        self._progress = progress
        self.new_stats: list[ChunkStats] = []
        self._reported: StrictModeError | None = None  # the strict error _collect raised, already the first
        self.first_submit: float | None = None
        self.last_done: float | None = None

    def submit(self, chunk: Chunk, payload: bytes | None, fingerprint: str, prefix: str) -> None:
        while len(self._in_flight) >= self._max_in_flight:
            self._collect()
        if self.first_submit is None:
            self.first_submit = time.monotonic()
        self._in_flight[self._pool.submit(_tokenize_chunk, chunk, payload, prefix)] = _Part(chunk, prefix, fingerprint)
        if self._index_code is None:  # after the first submit: the pool's processes are forked, none mid-import
            self._index_code = threading.Thread(target=load_index_code, name="load-index-code", daemon=True)
            self._index_code.start()

    def finish(self) -> None:
        while self._in_flight:
            self._collect()
        self._publish()

    def _collect(self) -> None:
        done, _ = wait(self._in_flight, timeout=0.2, return_when=FIRST_COMPLETED)
        while not self._progress_queue.empty():
            self._progress.add_tokens(self._progress_queue.get())
        for future in sorted(done, key=lambda f: _input_order(self._in_flight[f].chunk)):
            part = self._in_flight.pop(future)
            try:
                stats, lengths = future.result()
            except StrictModeError as error:
                self._reported = self.first_bad_record(error, _input_order(part.chunk))
                raise self._reported from None
            self._unpublished.append(replace(part, stats=stats, lengths=lengths))
            self.last_done = time.monotonic()
        if not self._index_code.is_alive():
            self._publish()
        self._progress.maybe_print()

    def _publish(self, report: bool = True) -> None:
        """Publish the parts tokenized so far (once Megatron's .idx code is imported); `report` them to on_done."""
        if self._index_code is not None:
            self._index_code.join()
        parts, self._unpublished = self._unpublished, []
        for part in parts:
            _publish_part(part.prefix, self._dtype, part.lengths, part.stats, part.fingerprint)
            if report:
                self.new_stats.append(part.stats)
                self._on_done(part.chunk, part.stats)

    def first_bad_record(self, error: StrictModeError, order: tuple[int, int] | None = None) -> StrictModeError:
        """--strict stops at the first bad record in input order, but the chunks finish in any order: the
        earliest strict error among the chunks in flight before `order` (None: all of them; chunks are
        handed out in input order, so no chunk before it is still to come), else `error`."""
        earlier = sorted((f for f, part in self._in_flight.items()
                          if order is None or _input_order(part.chunk) < order),
                         key=lambda f: _input_order(self._in_flight[f].chunk))
        wait(earlier)
        return next((f.exception() for f in earlier if isinstance(f.exception(), StrictModeError)), error)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if isinstance(exc, StrictModeError) and exc is not self._reported:  # the planner's: after every chunk
                first = self.first_bad_record(exc)
                if first is not exc:
                    raise first from None
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            if exc is not None:  # the chunks that finished, published all the same: the rerun reuses them
                for future, part in self._in_flight.items():
                    if future.done() and not future.cancelled() and future.exception() is None:
                        stats, lengths = future.result()
                        self._unpublished.append(replace(part, stats=stats, lengths=lengths))
                self._publish(report=False)


@dataclass
class _GroupWork:
    output: GroupOutput
    plans: list[InputFilePlan] = field(default_factory=list)
    stats: dict[tuple[int, int], ChunkStats] = field(default_factory=dict)
    pending: int = 0  # chunks handed out and not yet done
    planned: bool = False


class _Preprocess:
    """One run (or partition): its input groups planned, tokenized and written, group by group."""

    def __init__(self, config: PreprocessConfig):
        self.config = config
        self.listing = Listing.of(resolve_inputs(config.inputs))
        tokenizer = load_tokenizer(config.tokenizer_model, config.tokenizer_type)
        self.vocab_size, self.dtype = tokenizer.vocab_size, token_dtype(tokenizer.vocab_size)
        self.tokenizer_hash = tokenizer_identity(tokenizer)
        self.part_identity = {"version": PART_FORMAT_VERSION, "tokenizer_sha256": self.tokenizer_hash,
                              "json_key": config.json_key, "append_eod": config.append_eod,
                              "dtype": np.dtype(self.dtype).name, "max_document_bytes": config.max_document_bytes}
        if config.max_inflate_ratio != DEFAULT_MAX_INFLATE_RATIO:  # the default keeps earlier runs' fingerprints
            self.part_identity["max_inflate_ratio"] = config.max_inflate_ratio
        self.output_identity = {**self.part_identity, "input_files_per_output": config.input_files_per_output or 1,
                                "max_tokens_per_file": config.max_tokens_per_file}
        if config.output_per_group:
            groups = plan_groups(self.listing, config.input_files_per_output or 1)
            self.partition = config.partition or Partition(0, 1, "the whole input")
            self.groups = assign_groups(groups, self.partition.count)[self.partition.index]
        else:
            everything = tuple(range(len(self.listing.files)))
            self.groups = [InputGroup(0, "", everything, sum(file.size for file in self.listing.files))]
            self.partition = None
        self.manifest: PartitionManifest | None = None
        self.records: dict[int, GroupRecord] = {}  # finished groups (one output per group)
        self.subsets: dict[str, SubsetStats] = {}
        self.files: list[str] = []
        self.max_token_id = -1
        self.chunks = self.reused_chunks = self.reused_groups = 0
        self._work_of_file: dict[int, _GroupWork] = {}
        self._files_done: set[int] = set()
        label = f"partition {self.partition}: " if config.partition else ""
        self.progress = ProgressLine(label, sum(len(group.input_files) for group in self.groups),
                                     sum(group.size for group in self.groups))

    def output_of(self, group: InputGroup) -> GroupOutput:
        if not self.config.output_per_group:
            return GroupOutput(group, self.config.output_prefix, pieces=False)
        return GroupOutput(group, f"{self.config.output_prefix}_{group.index:06d}",
                           pieces=self.config.max_tokens_per_file is not None)

    def run(self) -> PreprocessSummary:
        start = time.monotonic()
        Path(self.config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        if self.config.output_per_group:
            self._open_manifest()
        with _ChunkDispatcher(self.config, self.dtype, self._chunk_done, self.progress) as dispatcher:
            for group in self.groups:
                if group.index in self.records:
                    continue
                self._plan_group(group, dispatcher)
            dispatcher.finish()
            tokenize_seconds = (dispatcher.last_done or 0.0) - (dispatcher.first_submit or 0.0)
            new_stats = dispatcher.new_stats
        if self.reused_chunks:
            print(f"resuming: reused {self.reused_chunks} finished chunks of {self.chunks}", file=sys.stderr)
        manifest_file = None
        if self.manifest is not None:
            self.manifest.groups = [self.records[index] for index in sorted(self.records)]
            self.manifest.complete = True
            manifest_file = self._write_manifest()
        self.progress.print()
        totals = SubsetStats()
        for stats in self.subsets.values():
            totals.add(stats)
        if totals.documents == 0 and self.groups:
            where = (f"; {manifest_file} records its input files as covered" if manifest_file
                     else f"; nothing was written to {self.config.dataset_prefix}")
            raise NoDocumentsError(f"no document written: every record of the {totals.input_files} input file(s) was "
                                   f"empty or bad (see the bad records above){where}")
        return PreprocessSummary(
            input_files=totals.input_files, chunks=self.chunks, reused_chunks=self.reused_chunks,
            reused_groups=self.reused_groups, documents=totals.documents, tokens=totals.tokens,
            max_token_id=self.max_token_id, empty_documents=totals.empty_documents,
            bad_records=totals.dropped_records, bad_by_kind=totals.dropped, subsets=self.subsets, files=self.files,
            manifest=manifest_file, seconds=time.monotonic() - start, tokenize_seconds=tokenize_seconds,
            processed_tokens=sum(s.tokens for s in new_stats), processed_bytes=sum(s.input_bytes for s in new_stats))

    # -- planning and handing out

    def _plan_group(self, group: InputGroup, dispatcher: _ChunkDispatcher) -> None:
        work = _GroupWork(self.output_of(group))
        parts_dir = work.output.parts_dir
        parts_dir.mkdir(parents=True, exist_ok=True)
        _rename_format_1_parts(parts_dir)
        for file_index in group.input_files:
            path = self.listing.files[file_index].path
            chunk_bytes = chunk_bytes_for(path, self.config.chunk_bytes)
            plan = InputFilePlan(file_index, path, file_fingerprint(path, self.part_identity, chunk_bytes))
            work.plans.append(plan)
            self._work_of_file[file_index] = work
            finished = _reuse_finished_file(parts_dir, plan)
            if finished is not None:
                work.stats.update(finished)
                self.chunks += len(finished)
                self.reused_chunks += len(finished)
                plan.planned = True
                self._file_finished(work, plan)
                continue
            for chunk, payload in plan_chunks(file_index, path, chunk_bytes, self.config.json_key,
                                              self.config.max_document_bytes,
                                              functools.partial(_file_problem, self.config, plan),
                                              self.config.max_inflate_ratio):
                plan.chunks.append(chunk)
                self.chunks += 1
                fingerprint = chunk_fingerprint(plan.fingerprint, chunk)
                previous = completed_chunk_stats(parts_dir, chunk, fingerprint)
                if previous is not None:
                    work.stats[(file_index, chunk.index)] = previous
                    self.reused_chunks += 1
                else:
                    work.pending += 1
                    dispatcher.submit(chunk, payload, fingerprint, part_prefix(parts_dir, chunk))
            _write_file_plan(parts_dir, plan)
            plan.planned = True
            self._file_finished(work, plan)
        work.planned = True
        if work.pending == 0:
            self._finish_group(work)

    def _chunk_done(self, chunk: Chunk, stats: ChunkStats) -> None:
        # A JSONL chunk spans its (decompressed) bytes; a parquet one its row groups, whose text is counted.
        read_bytes = stats.input_bytes if is_parquet(chunk.path) else chunk.stop - chunk.start
        self.progress.chunk_done(stats.records, read_bytes)
        work = self._work_of_file[chunk.file_index]
        work.stats[(chunk.file_index, chunk.index)] = stats
        work.pending -= 1
        self._file_finished(work, next(plan for plan in work.plans if plan.file_index == chunk.file_index))
        if work.planned and work.pending == 0:
            self._finish_group(work)  # at once: its parts go, and the manifest records it for a resume

    def _file_finished(self, work: _GroupWork, plan: InputFilePlan) -> None:
        """Count the input file as done for the progress line once it is planned whole and all its chunks are in."""
        if plan.planned and plan.file_index not in self._files_done and all(
                (plan.file_index, chunk.index) in work.stats for chunk in plan.chunks):
            self._files_done.add(plan.file_index)
            self.progress.file_done(self.listing.files[plan.file_index].size)

    # -- writing a finished group

    def _finish_group(self, work: _GroupWork) -> None:
        group = work.output.group
        group_stats = SubsetStats()
        for plan in work.plans:
            file_stats = _account_file(plan, [work.stats[(plan.file_index, chunk.index)] for chunk in plan.chunks])
            self.subsets.setdefault(self.listing.files[plan.file_index].subset, SubsetStats()).add(file_stats)
            group_stats.add(file_stats)
        written = group_stats.documents > 0
        files = self._write_files(work) if written else []
        if not self.config.keep_parts:
            shutil.rmtree(work.output.parts_dir, ignore_errors=True)
        if not self.config.output_per_group and not written:
            return  # run() reports it; nothing is written
        if self.manifest is not None:
            self.records[group.index] = GroupRecord(
                group.index, group.subset, [self.listing.files[p].name for p in group.input_files],
                group_fingerprint(self.output_identity, self.listing, group), files, group_stats)
            self.manifest.groups = [self.records[index] for index in sorted(self.records)]
            self._write_manifest()

    def _write_files(self, work: _GroupWork) -> list[OutputFile]:
        chunks = [chunk for plan in work.plans for chunk in plan.chunks]
        prefixes = [part_prefix(work.output.parts_dir, chunk) for chunk in chunks]
        lengths = [document_lengths(prefix) if work.stats[(chunk.file_index, chunk.index)].documents
                   else np.zeros(0, np.int64) for prefix, chunk in zip(prefixes, chunks)]
        files = []
        for piece, ranges in enumerate(plan_files(lengths, self.config.max_tokens_per_file)):
            dataset_prefix = work.output.dataset_prefix(piece)
            writer = DocumentWriter(f"{dataset_prefix}.bin.tmp", self.dtype)
            for part, first, stop in ranges:
                writer.copy_documents(prefixes[part], lengths[part], first, stop)
            _publish(writer, dataset_prefix)
            write_dataset_meta(dataset_prefix, DatasetMeta(
                max_token_id=writer.max_token_id, vocab_size=self.vocab_size, tokenizer_sha256=self.tokenizer_hash,
                documents=writer.documents, tokens=writer.tokens))  # last: the file is complete
            files.append(OutputFile(Path(dataset_prefix).name, writer.documents, writer.tokens, writer.max_token_id,
                                    Path(f"{dataset_prefix}.bin").stat().st_size,
                                    Path(f"{dataset_prefix}.idx").stat().st_size))
            self.files.append(dataset_prefix)
            self.max_token_id = max(self.max_token_id, writer.max_token_id)
        return files

    # -- the partition's manifest

    def _manifest_path(self) -> Path:
        return manifest_path(self.config.output_prefix, self.partition.index, self.partition.count)

    def _write_manifest(self) -> Path:
        path = self._manifest_path()
        write_manifest(path, self.manifest)
        return path

    def _open_manifest(self) -> None:
        """Start the manifest, keeping the groups an earlier run of this partition finished intact."""
        self.manifest = PartitionManifest(self.partition.index, self.partition.count, self.output_identity,
                                          str(self.listing.root), self.listing.identity())
        path = self._manifest_path()
        try:
            previous = read_manifest(path) if path.exists() else None
        except ManifestError as error:
            print(f"not resuming from {path}: {error}", file=sys.stderr)
            previous = None
        if previous is not None and (previous.run, previous.listing) == (self.manifest.run, self.manifest.listing):
            expected = {group.index: group for group in self.groups}
            for record in previous.groups:
                group = expected.get(record.index)
                if group is None or record.fingerprint != group_fingerprint(self.output_identity, self.listing, group):
                    continue
                if any(output_file_problem(path.parent, output) for output in record.files):
                    continue
                self.records[record.index] = record
                self.reused_groups += 1
                self.subsets.setdefault(record.subset, SubsetStats()).add(record.stats)
                self.files += [str(path.parent / output.name) for output in record.files]
                self.max_token_id = max([self.max_token_id, *(output.max_token_id for output in record.files)])
                for file_index in group.input_files:
                    self.progress.file_done(self.listing.files[file_index].size, reused=True)
        if self.reused_groups:
            print(f"resuming: partition {self.partition} reuses {self.reused_groups} finished group(s) of "
                  f"{len(self.groups)}", file=sys.stderr)
        self.manifest.groups = [self.records[index] for index in sorted(self.records)]
        self._write_manifest()


def run_preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize all input files (of this partition) and write the indexed datasets. Raises on errors (see main)."""
    return _Preprocess(config).run()


def _publish(writer: DocumentWriter, dataset_prefix: str) -> None:
    """Finish the writer's temporary .bin, write the .idx, and move both over the final names."""
    final_bin, final_idx = f"{dataset_prefix}.bin", f"{dataset_prefix}.idx"
    idx_tmp = f"{final_idx}.tmp"
    writer.finalize(idx_tmp)
    for tmp in (f"{final_bin}.tmp", idx_tmp):
        _fsync_file(tmp)
    # Never pair a new .bin with a stale .idx or .meta.json from an earlier run: they go first, come last.
    meta_path(dataset_prefix).unlink(missing_ok=True)
    Path(final_idx).unlink(missing_ok=True)
    os.replace(f"{final_bin}.tmp", final_bin)
    os.replace(idx_tmp, final_idx)
    fsync_dir(Path(final_idx).parent)


def _file_problem(config: PreprocessConfig, plan: InputFilePlan, record: BadRecord) -> None:
    if config.strict:
        raise StrictModeError(f"bad record (--strict): {record}")
    plan.problems.append(record)


def _file_plan_path(parts_dir: Path, file_index: int) -> Path:
    return parts_dir / f"input-{file_index:05d}.json"


def _rename_format_1_parts(parts_dir: Path) -> None:
    """Give the parts of a run interrupted before input files were called so (`shard-00001-chunk-00002.bin`,
    `shard-00001.json`) today's names, so that the rerun reuses them."""
    for path in parts_dir.glob("shard-*"):
        path.rename(parts_dir / ("input-" + path.name.removeprefix("shard-")))


def _write_file_plan(parts_dir: Path, plan: InputFilePlan) -> None:
    """The input file's full chunk plan: with it, a rerun that finds every chunk done need not read the file."""
    manifest = {
        "fingerprint": plan.fingerprint,
        "chunks": [[chunk.start, chunk.stop, chunk.records_before] for chunk in plan.chunks],
        "problems": [[record.line, record.kind, record.detail] for record in plan.problems],
    }
    write_text_durably(_file_plan_path(parts_dir, plan.file_index), json.dumps(manifest))


def _reuse_finished_file(parts_dir: Path, plan: InputFilePlan) -> dict | None:
    """The stats of every chunk when an earlier run finished the whole input file (filling `plan`), else None."""
    try:
        manifest = loads_json(read_capped_text(_file_plan_path(parts_dir, plan.file_index), PART_MANIFEST_MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("fingerprint") != plan.fingerprint:
        return None
    chunks = [Chunk(plan.file_index, index, plan.path, start, stop, before)
              for index, (start, stop, before) in enumerate(manifest["chunks"])]
    finished = {}
    for chunk in chunks:
        previous = completed_chunk_stats(parts_dir, chunk, chunk_fingerprint(plan.fingerprint, chunk))
        if previous is None:
            return None
        finished[(plan.file_index, chunk.index)] = previous
    plan.chunks = chunks
    plan.problems = [BadRecord(str(plan.path), line, kind, detail) for line, kind, detail in manifest["problems"]]
    return finished


def _account_file(plan: InputFilePlan, chunk_stats: list[ChunkStats]) -> SubsetStats:
    """Print the input file's first bad records with their line in the file; return its counts."""
    stats = SubsetStats(input_files=1)
    records: list[BadRecord] = list(plan.problems)
    lines_before = well_formed = 0
    for chunk in chunk_stats:
        records += [BadRecord(str(plan.path), lines_before + line, kind, detail)
                    for line, kind, detail in chunk.bad_examples]
        for kind, count in chunk.bad_by_kind.items():
            stats.dropped[kind] = stats.dropped.get(kind, 0) + count
        lines_before += chunk.records
        well_formed += chunk.documents + chunk.empty_documents
        stats.documents += chunk.documents
        stats.tokens += chunk.tokens
        stats.empty_documents += chunk.empty_documents
    for record in plan.problems:
        stats.dropped[record.kind] = stats.dropped.get(record.kind, 0) + 1
    if well_formed == 0 and not any(record.line == 0 for record in plan.problems):
        records.append(BadRecord(str(plan.path), 0, "empty_file", "the file holds no document"))
        stats.dropped["empty_file"] = stats.dropped.get("empty_file", 0) + 1
    records.sort(key=lambda record: record.line)
    for record in records[:BAD_RECORDS_REPORTED_PER_FILE]:
        print(f"bad record: {record}", file=sys.stderr)
    if stats.dropped_records > BAD_RECORDS_REPORTED_PER_FILE:
        print(f"bad record: ... and {stats.dropped_records - BAD_RECORDS_REPORTED_PER_FILE} more in {plan.path}",
              file=sys.stderr)
    return stats


def _part_sizes(prefix: str) -> dict[str, int | None]:
    sizes = {}
    for suffix in (".bin", ".idx"):
        path = Path(prefix + suffix)
        sizes[suffix] = path.stat().st_size if path.exists() else None
    return sizes


def _fsync_file(path: str | Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


# ---------------------------------------------------------------------------------------------
# The merge: manifests -> the blend.


@dataclass
class MergeSummary:
    partitions: int
    entries: list[BlendEntry]
    subsets: dict[str, SubsetStats]
    multipliers: dict[str, float]


def run_merge(config: MergeConfig) -> MergeSummary:
    """Check that the partitions' manifests cover every input file exactly once; write the blend."""
    paths = []
    for pattern in config.manifests:
        matches = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).exists() else [])
        if not matches:
            raise ManifestError(f"--merge-manifests {pattern!r} matched no file")
        paths += [Path(match) for match in matches]
    manifests = {path: read_manifest(path) for path in dict.fromkeys(paths)}
    groups = check_coverage(manifests)
    subsets = subset_totals([covered.record for covered in groups])
    weights = parse_subset_weights(config.subset_weights) if config.subset_weights else {}
    multipliers = subset_multipliers(subsets, weights)
    entries = [BlendEntry(output.tokens * multipliers[covered.record.subset],
                          str((covered.folder / output.name).resolve()))
               for covered in groups for output in covered.record.files if multipliers[covered.record.subset] > 0]
    if not entries:
        raise ManifestError("the blend would be empty: no partition wrote a document"
                            + (" in a subset of weight > 0" if weights else ""))
    write_data_args(config.data_args_path, entries)
    return MergeSummary(len(manifests), entries, subsets, multipliers)


# ---------------------------------------------------------------------------------------------
# The command line.


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig | MergeConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+",
                        help="input files, dirs (searched recursively) or globs: "
                             ".jsonl.zstd .jsonl.zst .jsonl.gz .jsonl .parquet")
    parser.add_argument("--output-prefix", help="writes PREFIX_text_document.bin/.idx/.meta.json (one output per "
                                                "input group: PREFIX_000123_text_document..., and a manifest)")
    parser.add_argument("--tokenizer-model", type=Path,
                        help="SentencePiece .model, Hugging Face tokenizer.json, or a folder holding a tokenizer.json")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                        help="Megatron's spelling; checked against the model file (default: read from it)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--json-key", default="text", help="field (or parquet column) holding the text")
    key.add_argument("--json-keys", nargs="+", metavar="KEY", help="Megatron's spelling; exactly one key")
    parser.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                        help="end every document with the end-of-document token (the default here; "
                             "accepted for Megatron's scripts, where it is off by default)")
    parser.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    parser.add_argument("--processes", "--workers", type=int, default=1,
                        help="tokenizing processes; they share the chunks of every input file, big or small "
                             "(--workers: Megatron's spelling)")
    parser.add_argument("--chunk-mb", type=float,
                        help="chunk size in MB of uncompressed text (default: 1/64 of each input file, 1-256 MiB)")
    parser.add_argument("--max-document-bytes", type=int, default=DEFAULT_MAX_DOCUMENT_BYTES,
                        help="drop (as a bad record) a JSON line or parquet text longer than this many bytes, "
                             "without holding it (default: %(default)s)")
    parser.add_argument("--max-inflate-ratio", type=float, default=DEFAULT_MAX_INFLATE_RATIO,
                        help="drop (as one bad record) the rest of a compressed input file, or a parquet column "
                             "chunk, once it inflates past this many times its stored bytes (16 MiB always pass; "
                             "default: %(default)g)")
    parser.add_argument("--strict", action="store_true", help="fail on the first bad record")
    parser.add_argument("--keep-parts", action="store_true", help="keep the per-chunk parts after merging")
    per_group = parser.add_argument_group("one output per group of input files, split across machines")
    per_group.add_argument("--partition", metavar="I/N",
                           help="process the I-th (0-based) of N shares of the input (default inside a Slurm array "
                                "job: its SLURM_ARRAY_TASK_ID among the array's tasks)")
    per_group.add_argument("--input-files-per-output", "--shards-per-file", type=int,
                           help="input files (of one subset) per output (default 1; --shards-per-file: its "
                                "former spelling)")
    per_group.add_argument("--max-tokens-per-file", type=int,
                           help="cut each output file at document boundaries to at most this many tokens (a group's "
                                 "last file, if under half of it, shares the documents of the one before evenly)")
    merge = parser.add_argument_group("merging the partitions (reads metadata only)")
    merge.add_argument("--merge-manifests", nargs="+", metavar="MANIFEST",
                       help="the partitions' PREFIX_partition-*-of-*.json files (or globs)")
    merge.add_argument("--data-args-path", type=Path, help="where the merge writes the blend (weights and prefixes, "
                                                           "as the trainer's and Megatron's --data-args-path read it)")
    merge.add_argument("--subset-weights", "--bucket-weights", metavar="NAME=W,...|FILE.json",
                       help="multiply the token-count weight of each subset matching NAME (a folder such as "
                            "quality=high, or its value high) by W (--bucket-weights: its former spelling)")
    args = parser.parse_args(argv)
    if args.merge_manifests:
        if not args.data_args_path:
            parser.error("--merge-manifests needs --data-args-path FILE (where the blend goes)")
        given = [flag for flag in ("input", "output_prefix", "tokenizer_model", "partition") if getattr(args, flag)]
        if given:
            parser.error(f"--merge-manifests reads manifests only; drop --{given[0].replace('_', '-')}")
        return MergeConfig(tuple(args.merge_manifests), args.data_args_path, args.subset_weights)
    missing = [flag for flag in ("input", "output_prefix", "tokenizer_model") if not getattr(args, flag)]
    if missing:
        parser.error(f"the following arguments are required: --{missing[0].replace('_', '-')}")
    if args.data_args_path or args.subset_weights:
        parser.error("--data-args-path and --subset-weights belong to --merge-manifests")
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.json_keys is not None and len(args.json_keys) != 1:
        parser.error(f"--json-keys takes one key here (every document is one field), got {args.json_keys}")
    if args.chunk_mb is not None and args.chunk_mb <= 0:
        parser.error("--chunk-mb must be positive")
    if args.max_document_bytes < 1:
        parser.error("--max-document-bytes must be at least 1")
    if not args.max_inflate_ratio >= 1:  # NaN too
        parser.error("--max-inflate-ratio must be a number >= 1")
    for flag in ("input_files_per_output", "max_tokens_per_file"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        partition = Partition.parse(args.partition) if args.partition else Partition.from_slurm(os.environ)
    except PartitionError as error:
        parser.error(str(error))
    return PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        tokenizer_type=args.tokenizer_type,
        json_key=args.json_keys[0] if args.json_keys else args.json_key,
        append_eod=args.append_eod,
        processes=args.processes,
        strict=args.strict,
        keep_parts=args.keep_parts,
        chunk_bytes=None if args.chunk_mb is None else max(1, int(args.chunk_mb * 1e6)),
        partition=partition,
        input_files_per_output=args.input_files_per_output,
        max_tokens_per_file=args.max_tokens_per_file,
        max_document_bytes=args.max_document_bytes,
        max_inflate_ratio=args.max_inflate_ratio,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        if isinstance(config, MergeConfig):
            _print_merge(config, run_merge(config))
            return 0
        if config.partition is not None:
            print(f"partition {config.partition} (from {config.partition.source})", file=sys.stderr)
        summary = run_preprocess(config)
    except (NoInputMatchedError, StrictModeError, FileNotFoundError, ValueError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 1
    except BrokenProcessPool:
        print("preprocess_data: error: a tokenizing process died; rerun the same command to resume",
              file=sys.stderr)
        return 1
    bad = ", ".join(f"{kind}={count}" for kind, count in sorted(summary.bad_by_kind.items())) or "none"
    print(
        f"done: input_files={summary.input_files} chunks={summary.chunks} (reused {summary.reused_chunks}) "
        f"documents={summary.documents} tokens={summary.tokens} max_token_id={summary.max_token_id} "
        f"empty_documents={summary.empty_documents} bad_records={summary.bad_records} ({bad}) "
        f"seconds={summary.seconds:.2f} tokens/s={summary.tokens_per_second:.0f} MB/s={summary.megabytes_per_second:.2f}"
    )
    for subset, stats in sorted(summary.subsets.items()):
        print(f"subset {subset or '(all)'}: {stats.describe()}")
    if summary.manifest is None:
        print(f"wrote {config.dataset_prefix}.bin, .idx and .meta.json")
    else:
        count = config.partition.count if config.partition else 1
        print(f"wrote {len(summary.files)} file(s) ({summary.reused_groups} group(s) from an earlier run) and "
              f"{summary.manifest}; once all {count} partition(s) are done: python tools/preprocess_data.py "
              f"--merge-manifests '{config.output_prefix}_partition-*-of-{count:05d}.json' "
              f"--data-args-path {config.output_prefix}.data_args")
    return 0


def _print_merge(config: MergeConfig, summary: MergeSummary) -> None:
    total_weight = sum(entry.weight for entry in summary.entries)
    weight_of = {subset: summary.multipliers[subset] * stats.tokens for subset, stats in summary.subsets.items()}
    for subset, stats in sorted(summary.subsets.items()):
        print(f"subset {subset or '(all)'}: {stats.describe()} weight x{summary.multipliers[subset]:g} "
              f"share {100 * weight_of[subset] / total_weight:.2f}%")
    totals = SubsetStats()
    for stats in summary.subsets.values():
        totals.add(stats)
    print(f"merged {summary.partitions} partition(s): {totals.describe()}")
    print(f"wrote {config.data_args_path}: {len(summary.entries)} prefixes weighted by tokens x subset weight "
          f"(use it as --data-args-path)")


if __name__ == "__main__":
    sys.exit(main())
