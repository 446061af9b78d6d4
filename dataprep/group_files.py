"""An input group's output files, written from its chunks' parts in input order (so they are the same for any number
of processes): `base`_text_document, or cut by a token limit into `base`_0000_text_document, ... Each file appears
only once complete, its .meta.json last."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataprep.chunks import Chunk
from dataprep.dataset_meta import DatasetMeta, meta_path, write_dataset_meta
from dataprep.indexed_writer import DocumentWriter, document_lengths, plan_files
from dataprep.manifest import OutputFile
from dataprep.partition import InputGroup
from dataprep.parts import ChunkStats, fsync_file, part_prefix
from muloco.core.durable import fsync_dir


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


@dataclass(frozen=True)
class DatasetIdentity:
    """What every output file's .meta.json records of the tokenizer, and the token width."""

    dtype: type[np.number]
    vocab_size: int
    tokenizer_sha256: str


def write_group_files(output: GroupOutput, chunks: list[Chunk], stats: dict[tuple[int, int], ChunkStats],
                      identity: DatasetIdentity, max_tokens_per_file: int | None) -> list[OutputFile]:
    """The group's files from its chunks' parts (`stats` by (file index, chunk index)), in order."""
    prefixes = [part_prefix(output.parts_dir, chunk) for chunk in chunks]
    lengths = [document_lengths(prefix) if stats[(chunk.file_index, chunk.index)].documents
               else np.zeros(0, np.int64) for prefix, chunk in zip(prefixes, chunks)]
    files = []
    for piece, ranges in enumerate(plan_files(lengths, max_tokens_per_file)):
        dataset_prefix = output.dataset_prefix(piece)
        writer = DocumentWriter(f"{dataset_prefix}.bin.tmp", identity.dtype)
        for part, first, stop in ranges:
            writer.copy_documents(prefixes[part], lengths[part], first, stop)
        _publish(writer, dataset_prefix)
        write_dataset_meta(dataset_prefix, DatasetMeta(
            max_token_id=writer.max_token_id, vocab_size=identity.vocab_size,
            tokenizer_sha256=identity.tokenizer_sha256, documents=writer.documents,
            tokens=writer.tokens))  # last: the file is complete
        files.append(OutputFile(Path(dataset_prefix).name, writer.documents, writer.tokens, writer.max_token_id,
                                Path(f"{dataset_prefix}.bin").stat().st_size,
                                Path(f"{dataset_prefix}.idx").stat().st_size))
    return files


def _publish(writer: DocumentWriter, dataset_prefix: str) -> None:
    """Finish the writer's temporary .bin, write the .idx, and move both over the final names."""
    final_bin, final_idx = f"{dataset_prefix}.bin", f"{dataset_prefix}.idx"
    idx_tmp = f"{final_idx}.tmp"
    writer.finalize(idx_tmp)
    for tmp in (f"{final_bin}.tmp", idx_tmp):
        fsync_file(tmp)
    # Never pair a new .bin with a stale .idx or .meta.json from an earlier run: they go first, come last.
    meta_path(dataset_prefix).unlink(missing_ok=True)
    Path(final_idx).unlink(missing_ok=True)
    os.replace(f"{final_bin}.tmp", final_bin)
    os.replace(idx_tmp, final_idx)
    fsync_dir(Path(final_idx).parent)
