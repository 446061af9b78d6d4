"""The .parts/ folder of a preprocessing output: each chunk's tokens as a part file pair (.bin/.idx) with a manifest
of its stats, and each input file's chunk plan. A part counts as finished only once its manifest is written (last)
and its file sizes still match it, so an interrupted run's rerun reuses exactly the finished chunks."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dataprep.chunks import Chunk
from dataprep.fingerprints import chunk_fingerprint
from dataprep.indexed_writer import write_index
from dataprep.input_files import BadRecord
from muloco.core.durable import write_text_durably
from muloco.core.small_files import loads_json, read_capped_text

BAD_RECORDS_REPORTED_PER_FILE = 10
PART_MANIFEST_MAX_BYTES = 64 << 20  # a chunk's stats, or an input file's chunk plan (about 40 bytes a chunk)


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


def part_prefix(parts_dir: Path, chunk: Chunk) -> str:
    return str(parts_dir / chunk.name)


def publish_part(prefix: str, dtype: type[np.number], lengths: list[int], stats: ChunkStats, fingerprint: str) -> None:
    """A tokenized chunk's .idx (Megatron's writer, which the tokenizing processes never import), then its files
    under their names; the manifest last: it marks the part complete."""
    idx_tmp = f"{prefix}.idx.tmp"
    write_index(idx_tmp, dtype, lengths)
    fsync_file(idx_tmp)
    os.replace(f"{prefix}.bin.tmp", f"{prefix}.bin")
    os.replace(idx_tmp, f"{prefix}.idx")
    manifest = {"fingerprint": fingerprint, "part_sizes": _part_sizes(prefix), "stats": asdict(stats)}
    write_text_durably(Path(f"{prefix}.json"), json.dumps(manifest))


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


def write_file_plan(parts_dir: Path, plan: InputFilePlan) -> None:
    """The input file's full chunk plan: with it, a rerun that finds every chunk done need not read the file."""
    manifest = {
        "fingerprint": plan.fingerprint,
        "chunks": [[chunk.start, chunk.stop, chunk.records_before] for chunk in plan.chunks],
        "problems": [[record.line, record.kind, record.detail] for record in plan.problems],
    }
    write_text_durably(_file_plan_path(parts_dir, plan.file_index), json.dumps(manifest))


def reuse_finished_file(parts_dir: Path, plan: InputFilePlan) -> dict | None:
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


def rename_format_1_parts(parts_dir: Path) -> None:
    """Give the parts of a run interrupted before input files were called so (`shard-00001-chunk-00002.bin`,
    `shard-00001.json`) today's names, so that the rerun reuses them."""
    for path in parts_dir.glob("shard-*"):
        path.rename(parts_dir / ("input-" + path.name.removeprefix("shard-")))


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _file_plan_path(parts_dir: Path, file_index: int) -> Path:
    return parts_dir / f"input-{file_index:05d}.json"


def _part_sizes(prefix: str) -> dict[str, int | None]:
    sizes = {}
    for suffix in (".bin", ".idx"):
        path = Path(prefix + suffix)
        sizes[suffix] = path.stat().st_size if path.exists() else None
    return sizes
