"""Tokenize corpus shards into Megatron's indexed dataset format (P_text_document.bin/.idx).

python tools/preprocess_data.py --input <files/dirs/globs ...> --output-prefix P \
    --tokenizer-model M [--json-key text] [--workers N] [--strict] [--keep-parts]

One document per JSON line (or parquet row), each followed by the end-of-document token. Shards
are tokenized in parallel, one whole shard per worker task; each shard's result is published
atomically as a part file pair in P_text_document.parts/ together with a manifest, and the parts
are merged in shard order at the end. A rerun with the same arguments skips the shards whose
parts are complete, so an interrupted run resumes; the final files appear only once complete.
"""
from __future__ import annotations

import argparse
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
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with warnings.catch_warnings():  # megatron warns about GPU kernels that preprocessing never uses
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402

from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer  # noqa: E402
from trainer.durable import fsync_dir, write_text_durably  # noqa: E402
from tools.shard_reader import BadRecord, NoInputMatchedError, read_documents, resolve_inputs  # noqa: E402

# Bump when the part file contents would change for the same inputs, to invalidate old parts.
PART_FORMAT_VERSION = 1
BAD_RECORDS_REPORTED_PER_SHARD = 10
PROGRESS_EVERY_DOCUMENTS = 256
# Test hook: "SHARD_INDEX:DOCUMENTS" SIGKILLs the worker after that many documents of that shard.
KILL_HOOK_ENV = "MULOCO_PREPROCESS_TEST_KILL_AT"


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer_model: Path
    json_key: str = "text"
    workers: int = 1
    strict: bool = False
    keep_parts: bool = False

    @property
    def dataset_prefix(self) -> str:
        return f"{self.output_prefix}_text_document"

    @property
    def parts_dir(self) -> Path:
        return Path(f"{self.dataset_prefix}.parts")


@dataclass
class ShardStats:
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    empty_documents: int = 0
    bad_by_kind: dict[str, int] = field(default_factory=dict)
    bad_examples: list[str] = field(default_factory=list)  # the first few, "file:line: kind: detail"

    @property
    def bad_records(self) -> int:
        return sum(self.bad_by_kind.values())

    def record_bad(self, record: BadRecord) -> None:
        self.bad_by_kind[record.kind] = self.bad_by_kind.get(record.kind, 0) + 1
        if len(self.bad_examples) < BAD_RECORDS_REPORTED_PER_SHARD:
            self.bad_examples.append(str(record))


@dataclass
class PreprocessSummary:
    shards: int
    skipped_shards: int  # complete parts reused from an earlier run
    documents: int
    tokens: int
    empty_documents: int
    bad_records: int
    bad_by_kind: dict[str, int]
    seconds: float
    processed_tokens: int  # tokenized in this run, excluding reused parts
    processed_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.processed_tokens / max(self.seconds, 1e-9)

    @property
    def megabytes_per_second(self) -> float:
        return self.processed_bytes / 1e6 / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class ShardTask:
    index: int
    path: Path
    part_prefix: str
    fingerprint: str

    @property
    def manifest_path(self) -> Path:
        return Path(f"{self.part_prefix}.json")


class StrictModeError(RuntimeError):
    """--strict and a bad record was found."""


def token_dtype(vocab_size: int) -> type[np.number]:
    return np.uint16 if vocab_size < 65500 else np.int32


# ---------------------------------------------------------------------------------------------
# Worker side: one whole shard per task.

_worker: dict = {}


def _init_worker(config: PreprocessConfig, progress_queue) -> None:
    # Workers must not die on the parent's Ctrl-C before the parent can report it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = SentencePieceTokenizer(config.tokenizer_model)
    kill_at = os.environ.get(KILL_HOOK_ENV)
    _worker.update(
        config=config,
        tokenizer=tokenizer,
        dtype=token_dtype(tokenizer.vocab_size),
        progress=progress_queue,
        kill_at=tuple(int(x) for x in kill_at.split(":")) if kill_at else None,
    )


def _tokenize_shard(task: ShardTask) -> ShardStats:
    config: PreprocessConfig = _worker["config"]
    tokenizer: SentencePieceTokenizer = _worker["tokenizer"]
    # A manifest left from different arguments must not vouch for the files about to be replaced.
    task.manifest_path.unlink(missing_ok=True)
    stats = ShardStats()

    def on_bad(record: BadRecord) -> None:
        if config.strict:
            raise StrictModeError(f"bad record (--strict): {record}")
        stats.record_bad(record)

    bin_tmp, idx_tmp = f"{task.part_prefix}.bin.tmp", f"{task.part_prefix}.idx.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=_worker["dtype"])
    reported = ShardStats()
    for document in read_documents(task.path, config.json_key, on_bad):
        stats.input_bytes += document.nbytes
        if not document.text:
            stats.empty_documents += 1
            continue
        try:
            ids = tokenizer.encode(document.text)
        except UnicodeEncodeError as error:  # lone surrogates from JSON "\ud800" escapes
            on_bad(BadRecord(str(task.path), document.line, "unencodable_text", str(error)))
            continue
        ids.append(tokenizer.eod_id)
        builder.add_document(np.asarray(ids, dtype=_worker["dtype"]), [len(ids)])
        stats.documents += 1
        stats.tokens += len(ids)
        if stats.documents % PROGRESS_EVERY_DOCUMENTS == 0:
            _report_progress(stats, reported)
        if _worker["kill_at"] == (task.index, stats.documents):
            os.kill(os.getpid(), signal.SIGKILL)
    builder.finalize(idx_tmp)
    _report_progress(stats, reported)

    for tmp in (bin_tmp, idx_tmp):
        _fsync_file(tmp)
    os.replace(bin_tmp, f"{task.part_prefix}.bin")
    os.replace(idx_tmp, f"{task.part_prefix}.idx")
    manifest = {
        "fingerprint": task.fingerprint,
        "shard": str(task.path),
        "part_sizes": _part_sizes(task.part_prefix),
        "stats": asdict(stats),
    }
    write_text_durably(task.manifest_path, json.dumps(manifest, indent=1))  # last: it marks the part complete
    return stats


def _report_progress(stats: ShardStats, reported: ShardStats) -> None:
    _worker["progress"].put(
        (stats.documents - reported.documents, stats.tokens - reported.tokens,
         stats.input_bytes - reported.input_bytes)
    )
    reported.documents, reported.tokens, reported.input_bytes = stats.documents, stats.tokens, stats.input_bytes


# ---------------------------------------------------------------------------------------------
# Parent side: plan, resume, run, merge.


def shard_fingerprint(shard: Path, tokenizer_sha256: str, config: PreprocessConfig, dtype) -> str:
    """Everything a part's content depends on; a change in any of them redoes the shard."""
    stat = shard.stat()
    identity = {
        "version": PART_FORMAT_VERSION,
        "shard": str(shard),
        "shard_size": stat.st_size,
        "shard_mtime_ns": stat.st_mtime_ns,
        "tokenizer_sha256": tokenizer_sha256,
        "json_key": config.json_key,
        "dtype": np.dtype(dtype).name,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def completed_part_stats(task: ShardTask) -> ShardStats | None:
    """The stats of a part finished by an earlier run with the same fingerprint, else None."""
    try:
        manifest = json.loads(task.manifest_path.read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("fingerprint") != task.fingerprint:
        return None
    if manifest.get("part_sizes") != _part_sizes(task.part_prefix):
        return None
    return ShardStats(**manifest["stats"])


def run_preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize all shards and write the final indexed dataset. Raises on errors (see main)."""
    start = time.monotonic()
    shards = resolve_inputs(config.inputs)
    tokenizer = SentencePieceTokenizer(config.tokenizer_model)
    dtype = token_dtype(tokenizer.vocab_size)
    tokenizer_sha256 = hashlib.sha256(Path(config.tokenizer_model).read_bytes()).hexdigest()

    config.parts_dir.mkdir(parents=True, exist_ok=True)
    tasks = [
        ShardTask(i, shard, str(config.parts_dir / f"shard-{i:05d}"),
                  shard_fingerprint(shard, tokenizer_sha256, config, dtype))
        for i, shard in enumerate(shards)
    ]
    stats: dict[int, ShardStats] = {}
    for task in tasks:
        previous = completed_part_stats(task)
        if previous is not None:
            stats[task.index] = previous
    if stats:
        print(f"resuming: {len(stats)} of {len(tasks)} shards already done, skipping "
              + " ".join(tasks[i].path.name for i in sorted(stats)), file=sys.stderr)
    skipped = set(stats)
    pending = [task for task in tasks if task.index not in skipped]
    stats.update(_tokenize_in_workers(config, pending, len(tasks), len(skipped)))

    _merge_parts(tasks, config.dataset_prefix, dtype)
    if not config.keep_parts:
        shutil.rmtree(config.parts_dir)

    new_stats = [stats[task.index] for task in pending]
    all_stats = [stats[task.index] for task in tasks]
    bad_by_kind: dict[str, int] = {}
    for shard_stats in all_stats:
        for kind, count in shard_stats.bad_by_kind.items():
            bad_by_kind[kind] = bad_by_kind.get(kind, 0) + count
    for shard_stats in all_stats:
        for example in shard_stats.bad_examples:
            print(f"bad record: {example}", file=sys.stderr)
        if shard_stats.bad_records > len(shard_stats.bad_examples):
            hidden = shard_stats.bad_records - len(shard_stats.bad_examples)
            print(f"bad record: ... and {hidden} more in this shard", file=sys.stderr)
    return PreprocessSummary(
        shards=len(tasks),
        skipped_shards=len(skipped),
        documents=sum(s.documents for s in all_stats),
        tokens=sum(s.tokens for s in all_stats),
        empty_documents=sum(s.empty_documents for s in all_stats),
        bad_records=sum(bad_by_kind.values()),
        bad_by_kind=bad_by_kind,
        seconds=time.monotonic() - start,
        processed_tokens=sum(s.tokens for s in new_stats),
        processed_bytes=sum(s.input_bytes for s in new_stats),
    )


def _tokenize_in_workers(
    config: PreprocessConfig, pending: list[ShardTask], total_shards: int, skipped: int
) -> dict[int, ShardStats]:
    from tqdm import tqdm

    if not pending:
        return {}
    # fork: workers inherit the already-imported megatron and sentencepiece modules for free.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    progress_queue = context.Queue()
    results: dict[int, ShardStats] = {}
    documents = tokens = input_bytes = 0
    start = time.monotonic()
    bar = tqdm(total=total_shards, initial=skipped, unit="shard", file=sys.stderr, dynamic_ncols=True)
    with ProcessPoolExecutor(
        max_workers=max(1, min(config.workers, len(pending))),
        mp_context=context,
        initializer=_init_worker,
        initargs=(config, progress_queue),
    ) as pool:
        futures = {pool.submit(_tokenize_shard, task): task for task in pending}
        not_done = set(futures)
        try:
            while not_done:
                done, not_done = wait(not_done, timeout=0.2, return_when=FIRST_COMPLETED)
                while not progress_queue.empty():
                    delta_documents, delta_tokens, delta_bytes = progress_queue.get()
                    documents += delta_documents
                    tokens += delta_tokens
                    input_bytes += delta_bytes
                for future in done:
                    results[futures[future].index] = future.result()
                    bar.update(1)
                _show_throughput(bar, documents, tokens, input_bytes, start)
            # The last progress messages may still be in flight; the results are exact.
            done_stats = results.values()
            _show_throughput(bar, sum(s.documents for s in done_stats), sum(s.tokens for s in done_stats),
                             sum(s.input_bytes for s in done_stats), start)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            bar.close()
    return results


def _show_throughput(bar, documents: int, tokens: int, input_bytes: int, start: float) -> None:
    seconds = max(time.monotonic() - start, 1e-9)
    bar.set_postfix_str(f"docs={documents} tokens={tokens} {input_bytes / 1e6 / seconds:.1f} MB/s", refresh=False)


def _merge_parts(tasks: list[ShardTask], dataset_prefix: str, dtype) -> None:
    final_bin, final_idx = f"{dataset_prefix}.bin", f"{dataset_prefix}.idx"
    bin_tmp, idx_tmp = f"{final_bin}.tmp", f"{final_idx}.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    # add_index runs gc.collect() per part; frozen, the large torch/megatron heap is not rescanned.
    gc.freeze()
    try:
        for task in tasks:
            builder.add_index(task.part_prefix)
    finally:
        gc.unfreeze()
    builder.finalize(idx_tmp)
    for tmp in (bin_tmp, idx_tmp):
        _fsync_file(tmp)
    # Never pair a new .bin with a stale .idx from an earlier run: the .idx goes first, comes last.
    Path(final_idx).unlink(missing_ok=True)
    os.replace(bin_tmp, final_bin)
    os.replace(idx_tmp, final_idx)
    fsync_dir(Path(final_idx).parent)


def _part_sizes(part_prefix: str) -> dict[str, int | None]:
    sizes = {}
    for suffix in (".bin", ".idx"):
        path = Path(part_prefix + suffix)
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
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_text_document.bin/.idx")
    parser.add_argument("--tokenizer-model", type=Path, required=True, help="SentencePiece .model file")
    parser.add_argument("--json-key", default="text", help="field (or parquet column) holding the text")
    parser.add_argument("--workers", type=int, default=1, help="processes, each tokenizing whole shards")
    parser.add_argument("--strict", action="store_true", help="fail on the first bad record")
    parser.add_argument("--keep-parts", action="store_true", help="keep the per-shard parts after merging")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        json_key=args.json_key,
        workers=args.workers,
        strict=args.strict,
        keep_parts=args.keep_parts,
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
        f"done: shards={summary.shards} (reused {summary.skipped_shards}) documents={summary.documents} "
        f"tokens={summary.tokens} empty_documents={summary.empty_documents} "
        f"bad_records={summary.bad_records} ({bad}) seconds={summary.seconds:.2f} "
        f"tokens/s={summary.tokens_per_second:.0f} MB/s={summary.megabytes_per_second:.2f}"
    )
    print(f"wrote {config.dataset_prefix}.bin and .idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
