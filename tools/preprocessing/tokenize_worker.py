"""The tokenizing processes' side (each of --processes): one chunk per task, its tokens written to the part's
.bin.tmp. They never import Megatron: the parent writes each part's .idx (dataprep.parts.publish_part)."""
from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import numpy as np

from dataprep.chunks import Chunk, chunk_documents, count_records, load_chunk, records_before
from dataprep.indexed_writer import DocumentWriter
from dataprep.input_files import BadRecord
from dataprep.parts import ChunkStats, fsync_file
from tokenizer.interface import load_tokenizer
from tools.preprocessing.config import PreprocessConfig

ENCODE_BATCH_DOCUMENTS = 64
ENCODE_BATCH_BYTES = 4 << 20  # the tokenizer needs tens of bytes per byte of text: batches stay small
PROGRESS_EVERY_DOCUMENTS = 256
# Test hook: "FILE:CHUNK:DOCUMENTS" SIGKILLs the process once that many documents of that chunk (of that input file,
# by its position in the listing) are encoded.
KILL_HOOK_ENV = "MULOCO_PREPROCESS_TEST_KILL_AT"


class StrictModeError(RuntimeError):
    """--strict and a bad record was found."""


def token_dtype(vocab_size: int) -> type[np.number]:
    return np.uint16 if vocab_size < 65500 else np.int32


_process: dict = {}


def init_process(config: PreprocessConfig, progress_queue) -> None:
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


def tokenize_chunk(chunk: Chunk, payload: bytes | None, prefix: str) -> tuple[ChunkStats, list[int]]:
    """The chunk's tokens in `prefix`.bin.tmp; its stats and the lengths of its documents (the parent writes the
    part's .idx and publishes it: `dataprep.parts.publish_part`)."""
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
    fsync_file(bin_tmp)
    return stats, lengths


def _report_progress(stats: ChunkStats, reported: ChunkStats) -> None:
    _process["progress"].put(stats.tokens - reported.tokens)
    reported.tokens = stats.tokens
