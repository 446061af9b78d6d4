"""`<data prefix>.meta.json`, written by preprocessing beside `<data prefix>.bin/.idx`: which tokenizer made
the data and its largest token id, so that training can refuse data its tokenizer (embedding) cannot hold.

Keys: `max_token_id` (the largest id in the .bin), `vocab_size` (the tokenizer's), `tokenizer_sha256` (the
tokenizer's identity, tokenizer/identity.py: the same for a SentencePiece .model and the
tokenizer.json exported from it; data made before records its model file's SHA-256), `documents`, `tokens`."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.durable import write_text_durably

SUFFIX = ".meta.json"


@dataclass(frozen=True)
class DatasetMeta:
    max_token_id: int
    vocab_size: int
    tokenizer_sha256: str
    documents: int
    tokens: int


def meta_path(data_prefix: str | Path) -> Path:
    return Path(f"{data_prefix}{SUFFIX}")


def write_dataset_meta(data_prefix: str | Path, meta: DatasetMeta) -> Path:
    path = meta_path(data_prefix)
    write_text_durably(path, json.dumps(asdict(meta), indent=1) + "\n")
    return path


def read_dataset_meta(data_prefix: str | Path) -> DatasetMeta | None:
    """The dataset's metadata, or None for data preprocessed without it (older runs, other tools)."""
    path = meta_path(data_prefix)
    if not path.is_file():
        return None
    return DatasetMeta(**json.loads(path.read_text()))
