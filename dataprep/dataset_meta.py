"""`<data prefix>.meta.json`, written by preprocessing beside `<data prefix>.bin/.idx`: which tokenizer made
the data and its largest token id, so that training can refuse data its tokenizer (embedding) cannot hold.

Keys: `max_token_id` (the largest id in the .bin), `vocab_size` (the tokenizer's), `tokenizer_sha256` (the
tokenizer's identity, tokenizer/identity.py: the same for a SentencePiece .model and the
tokenizer.json exported from it; data made before records its model file's SHA-256), `documents`, `tokens`."""
from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from muloco.core.durable import write_text_durably
from muloco.core.small_files import loads_json, read_capped_text
from muloco.core.typed_json import ConfigBlock, load, setting

SUFFIX = ".meta.json"
META_MAX_BYTES = 1 << 20  # preprocessing writes about 200 bytes


@dataclass(frozen=True)
class DatasetMeta(ConfigBlock):
    max_token_id: int = setting(ge=-1, doc="-1: no token")
    vocab_size: int = setting(ge=1)
    tokenizer_sha256: str = setting()
    documents: int = setting(ge=0)
    tokens: int = setting(ge=0)


def meta_path(data_prefix: str | Path) -> Path:
    return Path(f"{data_prefix}{SUFFIX}")


def write_dataset_meta(data_prefix: str | Path, meta: DatasetMeta) -> Path:
    path = meta_path(data_prefix)
    write_text_durably(path, json.dumps(asdict(meta), indent=1) + "\n")
    return path


def read_dataset_meta(data_prefix: str | Path) -> DatasetMeta | None:
    """The dataset's metadata, or None for data preprocessed without it (older runs, other tools): no
    entry of that name at all. Anything else that is not a readable regular file raises ValueError, as do
    JSON that is not one, or too large or deep (a FIFO would block, /dev/zero never end), and a ConfigError
    names each key of the wrong type or range."""
    path = meta_path(data_prefix)
    if not os.path.lexists(path):
        return None
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise ValueError("not a regular file (a folder, device, fifo or socket)")
        return load(DatasetMeta, loads_json(read_capped_text(path, META_MAX_BYTES)))
    except OSError as error:  # a dangling link, no permission
        raise ValueError(f"cannot be read ({error.strerror or error})") from None
