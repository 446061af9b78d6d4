"""Tokenize corpus shards into Megatron's indexed dataset format (P_text_document.bin/.idx/.meta.json).

python tools/preprocess_data.py --input <files/dirs/globs ...> --output-prefix P \
    --tokenizer-model M [--tokenizer-type T] [--json-key text] [--workers N] [--strict] [--keep-parts]

One document per JSON line (or parquet row), each followed by the end-of-document token (unless
--no-append-eod). Megatron's spellings work too: --json-keys text, --append-eod, --tokenizer-type
SentencePieceTokenizer|HuggingFaceTokenizer. --tokenizer-model names a SentencePiece .model, a Hugging
Face tokenizer.json, or a folder holding one.

Each shard is cut into chunks (dataprep.chunks) so that N workers share even one big shard: uncompressed
JSONL by byte ranges, compressed JSONL decompressed once here and handed out in blocks of lines, parquet by
row groups. Each chunk's result is published atomically as a part file pair in P_text_document.parts/
with a manifest; the parts are merged in order at the end, so the output is byte-identical for any number
of workers. A rerun with the same arguments reuses the finished chunks, so an interrupted run resumes;
the final files appear only once complete, P_text_document.meta.json (dataprep.dataset_meta) last.

Bad records (malformed JSON, missing key, invalid UTF-8, lone surrogates, ...) are dropped, counted and
reported with file and line; a shard that cannot be read is reported and skipped. --strict stops at the
first. Writing no document at all is an error.
"""
from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with warnings.catch_warnings():  # megatron warns about GPU kernels that preprocessing never uses
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

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
from dataprep.shards import BadRecord, NoInputMatchedError, resolve_inputs
from tokenizer.interface import TOKENIZER_TYPES, load_tokenizer, tokenizer_sha256
from trainer.durable import fsync_dir, write_text_durably

# Bump when the part file contents would change for the same inputs, to invalidate old parts.
PART_FORMAT_VERSION = 2
BAD_RECORDS_REPORTED_PER_SHARD = 10
ENCODE_BATCH_DOCUMENTS = 64
PROGRESS_EVERY_DOCUMENTS = 256
CHUNKS_IN_FLIGHT_PER_WORKER = 2  # bounds the decompressed bytes held for the workers
# Test hook: "SHARD:CHUNK:DOCUMENTS" SIGKILLs the worker after that many documents of that chunk.
KILL_HOOK_ENV = "MULOCO_PREPROCESS_TEST_KILL_AT"


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer_model: Path
    tokenizer_type: str | None = None  # None: read from the model file
    json_key: str = "text"
    append_eod: bool = True
    workers: int = 1
    strict: bool = False
    keep_parts: bool = False
    chunk_bytes: int | None = None  # None: a share of each shard (dataprep.chunks.chunk_bytes_for)

    @property
    def dataset_prefix(self) -> str:
        return f"{self.output_prefix}_text_document"

    @property
    def parts_dir(self) -> Path:
        return Path(f"{self.dataset_prefix}.parts")


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
        if len(self.bad_examples) < BAD_RECORDS_REPORTED_PER_SHARD:
            self.bad_examples.append((record.line, record.kind, record.detail))


@dataclass
class ShardPlan:
    """A shard's chunks in order, and the problems of the whole shard found while planning them."""

    path: Path
    fingerprint: str
    chunks: list[Chunk] = field(default_factory=list)
    problems: list[BadRecord] = field(default_factory=list)


@dataclass
class PreprocessSummary:
    shards: int
    chunks: int
    reused_chunks: int  # complete parts reused from an earlier run
    documents: int
    tokens: int
    max_token_id: int
    empty_documents: int
    bad_records: int
    bad_by_kind: dict[str, int]
    seconds: float  # the whole run
    # First chunk handed out to last chunk done: imports, tokenizer loading and the merge excluded (the
    # workers' own start is in: it runs in parallel with the first chunks).
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


def part_prefix(config: PreprocessConfig, chunk: Chunk) -> str:
    return str(config.parts_dir / chunk.name)


# ---------------------------------------------------------------------------------------------
# Worker side: one chunk per task.

_worker: dict = {}


def _init_worker(config: PreprocessConfig, progress_queue) -> None:
    # Workers must not die on the parent's Ctrl-C before the parent can report it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    tokenizer = load_tokenizer(config.tokenizer_model, config.tokenizer_type)
    kill_at = os.environ.get(KILL_HOOK_ENV)
    _worker.update(
        config=config,
        tokenizer=tokenizer,
        dtype=token_dtype(tokenizer.vocab_size),
        progress=progress_queue,
        kill_at=tuple(int(x) for x in kill_at.split(":")) if kill_at else None,
    )


def _tokenize_chunk(chunk: Chunk, payload: bytes | None, fingerprint: str) -> ChunkStats:
    config: PreprocessConfig = _worker["config"]
    tokenizer = _worker["tokenizer"]
    dtype = _worker["dtype"]
    prefix = part_prefix(config, chunk)
    manifest_path = Path(f"{prefix}.json")
    # A manifest left from different arguments must not vouch for the files about to be replaced.
    manifest_path.unlink(missing_ok=True)
    stats = ChunkStats()

    def on_bad(record: BadRecord) -> None:
        if config.strict:
            line = records_before(chunk) + record.line
            raise StrictModeError(f"bad record (--strict): {BadRecord(record.path, line, record.kind, record.detail)}")
        stats.record_bad(record)

    bin_tmp, idx_tmp = f"{prefix}.bin.tmp", f"{prefix}.idx.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    reported = ChunkStats()
    data = load_chunk(chunk, payload)
    stats.records = count_records(chunk, data)
    batch: list[str] = []

    def add(texts: list[str]) -> None:
        for ids in tokenizer.encode_batch(texts):
            if config.append_eod:
                ids.append(tokenizer.eod_id)
            tokens = np.asarray(ids, dtype=dtype)
            builder.add_document(tokens, [len(tokens)])
            if len(tokens):
                stats.max_token_id = max(stats.max_token_id, int(tokens.max()))
            stats.documents += 1
            stats.tokens += len(tokens)
            if stats.documents % PROGRESS_EVERY_DOCUMENTS == 0:
                _report_progress(stats, reported)
            if _worker["kill_at"] == (chunk.shard, chunk.index, stats.documents):
                os.kill(os.getpid(), signal.SIGKILL)

    for document in chunk_documents(chunk, data, config.json_key, on_bad):
        stats.input_bytes += document.nbytes
        if not document.text:
            stats.empty_documents += 1
            continue
        batch.append(document.text)
        if len(batch) == ENCODE_BATCH_DOCUMENTS:
            add(batch)
            batch = []
    add(batch)
    builder.finalize(idx_tmp)
    _report_progress(stats, reported)

    for tmp in (bin_tmp, idx_tmp):
        _fsync_file(tmp)
    os.replace(bin_tmp, f"{prefix}.bin")
    os.replace(idx_tmp, f"{prefix}.idx")
    manifest = {"fingerprint": fingerprint, "part_sizes": _part_sizes(prefix), "stats": asdict(stats)}
    write_text_durably(manifest_path, json.dumps(manifest))  # last: it marks the part complete
    return stats


def _report_progress(stats: ChunkStats, reported: ChunkStats) -> None:
    _worker["progress"].put(
        (stats.documents - reported.documents, stats.tokens - reported.tokens,
         stats.input_bytes - reported.input_bytes)
    )
    reported.documents, reported.tokens, reported.input_bytes = stats.documents, stats.tokens, stats.input_bytes


# ---------------------------------------------------------------------------------------------
# Parent side: plan, resume, hand out, merge.


def shard_fingerprint(shard: Path, run_identity: dict, chunk_bytes: int) -> str:
    """Everything a shard's parts depend on; a change in any of them redoes the shard."""
    stat = shard.stat()
    identity = {**run_identity, "shard": str(shard), "shard_size": stat.st_size,
                "shard_mtime_ns": stat.st_mtime_ns, "chunk_bytes": chunk_bytes}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def chunk_fingerprint(shard_fingerprint_: str, chunk: Chunk) -> str:
    return hashlib.sha256(f"{shard_fingerprint_}:{chunk.index}:{chunk.start}:{chunk.stop}".encode()).hexdigest()


def completed_chunk_stats(config: PreprocessConfig, chunk: Chunk, fingerprint: str) -> ChunkStats | None:
    """The stats of a part finished by an earlier run with the same fingerprint, else None."""
    prefix = part_prefix(config, chunk)
    try:
        manifest = json.loads(Path(f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("fingerprint") != fingerprint or manifest.get("part_sizes") != _part_sizes(prefix):
        return None
    stats = ChunkStats(**manifest["stats"])
    stats.bad_examples = [tuple(example) for example in stats.bad_examples]
    return stats


class _ChunkDispatcher:
    """Hands chunks to the worker pool, a bounded number at a time, and collects their stats."""

    def __init__(self, config: PreprocessConfig):
        from tqdm import tqdm

        # fork: workers inherit the already-imported megatron and tokenizer modules for free.
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        self._progress = context.Queue()
        self._pool = ProcessPoolExecutor(max_workers=config.workers, mp_context=context,
                                         initializer=_init_worker, initargs=(config, self._progress))
        self._max_in_flight = CHUNKS_IN_FLIGHT_PER_WORKER * config.workers
        self._in_flight: dict[Future, Chunk] = {}
        self.results: dict[tuple[int, int], ChunkStats] = {}
        self.first_submit: float | None = None
        self.last_done: float | None = None
        self._documents = self._input_bytes = 0
        self._bar = tqdm(unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True)

    def submit(self, chunk: Chunk, payload: bytes | None, fingerprint: str) -> None:
        while len(self._in_flight) >= self._max_in_flight:
            self._collect()
        if self.first_submit is None:
            self.first_submit = time.monotonic()
        self._in_flight[self._pool.submit(_tokenize_chunk, chunk, payload, fingerprint)] = chunk

    def finish(self) -> None:
        while self._in_flight:
            self._collect()

    def _collect(self) -> None:
        done, _ = wait(self._in_flight, timeout=0.2, return_when=FIRST_COMPLETED)
        while not self._progress.empty():
            documents, tokens, input_bytes = self._progress.get()
            self._documents += documents
            self._input_bytes += input_bytes
            self._bar.update(tokens)
        for future in done:
            chunk = self._in_flight.pop(future)
            self.results[(chunk.shard, chunk.index)] = future.result()
            self.last_done = time.monotonic()
        seconds = max(time.monotonic() - (self.first_submit or time.monotonic()), 1e-9)
        self._bar.set_postfix_str(f"docs={self._documents} chunks={len(self.results)} "
                                  f"{self._input_bytes / 1e6 / seconds:.1f} MB/s", refresh=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._bar.close()


def run_preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize all shards and write the final indexed dataset. Raises on errors (see main)."""
    start = time.monotonic()
    shard_paths = resolve_inputs(config.inputs)
    tokenizer = load_tokenizer(config.tokenizer_model, config.tokenizer_type)
    dtype = token_dtype(tokenizer.vocab_size)
    tokenizer_hash = tokenizer_sha256(tokenizer)
    run_identity = {"version": PART_FORMAT_VERSION, "tokenizer_sha256": tokenizer_hash, "json_key": config.json_key,
                    "append_eod": config.append_eod, "dtype": np.dtype(dtype).name}
    config.parts_dir.mkdir(parents=True, exist_ok=True)

    plans: list[ShardPlan] = []
    stats: dict[tuple[int, int], ChunkStats] = {}
    reused = 0
    with _ChunkDispatcher(config) as dispatcher:
        for shard, path in enumerate(shard_paths):
            chunk_bytes = chunk_bytes_for(path, config.chunk_bytes)
            plan = ShardPlan(path, shard_fingerprint(path, run_identity, chunk_bytes))
            plans.append(plan)
            finished = _reuse_finished_shard(config, plan, shard)
            if finished is not None:
                stats.update(finished)
                reused += len(finished)
                continue
            for chunk, payload in plan_chunks(shard, path, chunk_bytes, config.json_key,
                                              functools.partial(_shard_problem, config, plan)):
                plan.chunks.append(chunk)
                fingerprint = chunk_fingerprint(plan.fingerprint, chunk)
                previous = completed_chunk_stats(config, chunk, fingerprint)
                if previous is not None:
                    stats[(shard, chunk.index)] = previous
                    reused += 1
                else:
                    dispatcher.submit(chunk, payload, fingerprint)
            _write_shard_manifest(config, plan, shard)
        dispatcher.finish()
        stats.update(dispatcher.results)
        tokenize_seconds = (dispatcher.last_done or 0.0) - (dispatcher.first_submit or 0.0)
    if reused:
        print(f"resuming: reused {reused} finished chunks of {sum(len(p.chunks) for p in plans)}", file=sys.stderr)

    bad_by_kind = _report_bad_records(plans, stats)
    all_stats = [stats[(shard, chunk.index)] for shard, plan in enumerate(plans) for chunk in plan.chunks]
    documents = sum(s.documents for s in all_stats)
    if documents == 0:
        raise NoDocumentsError(f"no document written: every record of the {len(plans)} shard(s) was empty or bad "
                               f"(see the bad records above); nothing was written to {config.dataset_prefix}")
    tokens = sum(s.tokens for s in all_stats)
    max_token_id = max(s.max_token_id for s in all_stats)
    _merge_parts([part_prefix(config, chunk) for plan in plans for chunk in plan.chunks], config.dataset_prefix, dtype)
    write_dataset_meta(config.dataset_prefix, DatasetMeta(
        max_token_id=max_token_id, vocab_size=tokenizer.vocab_size, tokenizer_sha256=tokenizer_hash,
        documents=documents, tokens=tokens))  # last: the dataset is complete
    if not config.keep_parts:
        shutil.rmtree(config.parts_dir)

    new_stats = [stats[key] for key in dispatcher.results]
    return PreprocessSummary(
        shards=len(plans),
        chunks=len(all_stats),
        reused_chunks=reused,
        documents=documents,
        tokens=tokens,
        max_token_id=max_token_id,
        empty_documents=sum(s.empty_documents for s in all_stats),
        bad_records=sum(bad_by_kind.values()),
        bad_by_kind=bad_by_kind,
        seconds=time.monotonic() - start,
        tokenize_seconds=tokenize_seconds,
        processed_tokens=sum(s.tokens for s in new_stats),
        processed_bytes=sum(s.input_bytes for s in new_stats),
    )


def _shard_problem(config: PreprocessConfig, plan: ShardPlan, record: BadRecord) -> None:
    if config.strict:
        raise StrictModeError(f"bad record (--strict): {record}")
    plan.problems.append(record)


def _shard_manifest_path(config: PreprocessConfig, shard: int) -> Path:
    return config.parts_dir / f"shard-{shard:05d}.json"


def _write_shard_manifest(config: PreprocessConfig, plan: ShardPlan, shard: int) -> None:
    """The shard's full chunk plan: with it, a rerun that finds every chunk done need not read the shard."""
    manifest = {
        "fingerprint": plan.fingerprint,
        "chunks": [[chunk.start, chunk.stop, chunk.records_before] for chunk in plan.chunks],
        "problems": [[record.line, record.kind, record.detail] for record in plan.problems],
    }
    write_text_durably(_shard_manifest_path(config, shard), json.dumps(manifest))


def _reuse_finished_shard(config: PreprocessConfig, plan: ShardPlan, shard: int) -> dict | None:
    """The stats of every chunk when an earlier run finished the whole shard (filling `plan`), else None."""
    try:
        manifest = json.loads(_shard_manifest_path(config, shard).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("fingerprint") != plan.fingerprint:
        return None
    chunks = [Chunk(shard, index, plan.path, start, stop, before)
              for index, (start, stop, before) in enumerate(manifest["chunks"])]
    finished = {}
    for chunk in chunks:
        previous = completed_chunk_stats(config, chunk, chunk_fingerprint(plan.fingerprint, chunk))
        if previous is None:
            return None
        finished[(shard, chunk.index)] = previous
    plan.chunks = chunks
    plan.problems = [BadRecord(str(plan.path), line, kind, detail) for line, kind, detail in manifest["problems"]]
    return finished


def _report_bad_records(plans: list[ShardPlan], stats: dict[tuple[int, int], ChunkStats]) -> dict[str, int]:
    """Print the first bad records of each shard with their line in the shard; return the counts by kind."""
    bad_by_kind: dict[str, int] = {}
    for shard, plan in enumerate(plans):
        records: list[BadRecord] = list(plan.problems)
        total = len(plan.problems)
        lines_before = 0
        well_formed = 0
        for chunk in plan.chunks:
            chunk_stats = stats[(shard, chunk.index)]
            records += [BadRecord(str(plan.path), lines_before + line, kind, detail)
                        for line, kind, detail in chunk_stats.bad_examples]
            total += chunk_stats.bad_records
            for kind, count in chunk_stats.bad_by_kind.items():
                bad_by_kind[kind] = bad_by_kind.get(kind, 0) + count
            lines_before += chunk_stats.records
            well_formed += chunk_stats.documents + chunk_stats.empty_documents
        for record in plan.problems:
            bad_by_kind[record.kind] = bad_by_kind.get(record.kind, 0) + 1
        if well_formed == 0 and not any(record.line == 0 for record in plan.problems):
            records.append(BadRecord(str(plan.path), 0, "empty_shard", "shard holds no document"))
            bad_by_kind["empty_shard"] = bad_by_kind.get("empty_shard", 0) + 1
            total += 1
        records.sort(key=lambda record: record.line)
        for record in records[:BAD_RECORDS_REPORTED_PER_SHARD]:
            print(f"bad record: {record}", file=sys.stderr)
        if total > BAD_RECORDS_REPORTED_PER_SHARD:
            print(f"bad record: ... and {total - BAD_RECORDS_REPORTED_PER_SHARD} more in {plan.path}", file=sys.stderr)
    return bad_by_kind


def _merge_parts(part_prefixes: list[str], dataset_prefix: str, dtype) -> None:
    final_bin, final_idx = f"{dataset_prefix}.bin", f"{dataset_prefix}.idx"
    bin_tmp, idx_tmp = f"{final_bin}.tmp", f"{final_idx}.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    # add_index runs gc.collect() per part; frozen, the large torch/megatron heap is not rescanned.
    gc.freeze()
    try:
        for prefix in part_prefixes:
            builder.add_index(prefix)
    finally:
        gc.unfreeze()
    builder.finalize(idx_tmp)
    for tmp in (bin_tmp, idx_tmp):
        _fsync_file(tmp)
    # Never pair a new .bin with a stale .idx or .meta.json from an earlier run: they go first, come last.
    meta_path(dataset_prefix).unlink(missing_ok=True)
    Path(final_idx).unlink(missing_ok=True)
    os.replace(bin_tmp, final_bin)
    os.replace(idx_tmp, final_idx)
    fsync_dir(Path(final_idx).parent)


def _part_sizes(prefix: str) -> dict[str, int | None]:
    sizes = {}
    for suffix in (".bin", ".idx"):
        path = Path(prefix + suffix)
        sizes[suffix] = path.stat().st_size if path.exists() else None
    return sizes


def _fsync_file(path: str | Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="shard files, dirs (searched recursively) or globs: "
                             ".jsonl.zstd .jsonl.zst .jsonl.gz .jsonl .parquet")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_text_document.bin/.idx/.meta.json")
    parser.add_argument("--tokenizer-model", type=Path, required=True,
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
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizing processes; they share the chunks of every shard, big or small")
    parser.add_argument("--chunk-mb", type=float,
                        help="chunk size in MB of uncompressed text (default: 1/64 of each shard, 1-256 MiB)")
    parser.add_argument("--strict", action="store_true", help="fail on the first bad record")
    parser.add_argument("--keep-parts", action="store_true", help="keep the per-chunk parts after merging")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.json_keys is not None and len(args.json_keys) != 1:
        parser.error(f"--json-keys takes one key here (every document is one field), got {args.json_keys}")
    if args.chunk_mb is not None and args.chunk_mb <= 0:
        parser.error("--chunk-mb must be positive")
    return PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        tokenizer_type=args.tokenizer_type,
        json_key=args.json_keys[0] if args.json_keys else args.json_key,
        append_eod=args.append_eod,
        workers=args.workers,
        strict=args.strict,
        keep_parts=args.keep_parts,
        chunk_bytes=None if args.chunk_mb is None else max(1, int(args.chunk_mb * 1e6)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        summary = run_preprocess(config)
    except (NoInputMatchedError, StrictModeError, FileNotFoundError, ValueError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 1
    except BrokenProcessPool:
        print("preprocess_data: error: a worker process died; rerun the same command to resume",
              file=sys.stderr)
        return 1
    bad = ", ".join(f"{kind}={count}" for kind, count in sorted(summary.bad_by_kind.items())) or "none"
    print(
        f"done: shards={summary.shards} chunks={summary.chunks} (reused {summary.reused_chunks}) "
        f"documents={summary.documents} tokens={summary.tokens} max_token_id={summary.max_token_id} "
        f"empty_documents={summary.empty_documents} bad_records={summary.bad_records} ({bad}) "
        f"seconds={summary.seconds:.2f} tokens/s={summary.tokens_per_second:.0f} MB/s={summary.megabytes_per_second:.2f}"
    )
    print(f"wrote {config.dataset_prefix}.bin, .idx and .meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
