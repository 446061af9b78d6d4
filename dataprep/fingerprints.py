"""What a preprocessing run's outputs depend on, hashed: an input file's parts, a chunk's part, and an input group's
output files. A rerun whose fingerprint matches reuses what an earlier run finished; any change redoes it.

The fingerprints hash their identity's keys as first spelled ("shard", "bucket", "shards_per_file", ...): the same
inputs and options keep their fingerprints across the renames, so a run started before one still resumes.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dataprep.chunks import Chunk
from dataprep.input_files import DEFAULT_MAX_INFLATE_RATIO
from dataprep.listing import Listing
from dataprep.partition import InputGroup

# Bump when the part file contents would change for the same inputs, to invalidate old parts.
PART_FORMAT_VERSION = 2


def part_identity(tokenizer_sha256: str, json_key: str, append_eod: bool, dtype: type[np.number],
                  max_document_bytes: int, max_inflate_ratio: float) -> dict:
    """The run's settings every part depends on."""
    identity = {"version": PART_FORMAT_VERSION, "tokenizer_sha256": tokenizer_sha256, "json_key": json_key,
                "append_eod": append_eod, "dtype": np.dtype(dtype).name, "max_document_bytes": max_document_bytes}
    if max_inflate_ratio != DEFAULT_MAX_INFLATE_RATIO:  # the default keeps earlier runs' fingerprints
        identity["max_inflate_ratio"] = max_inflate_ratio
    return identity


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
