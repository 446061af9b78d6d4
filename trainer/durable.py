"""Durable writes: a file appears whole under its name or not at all, even across a crash.

Shared by checkpoints and preprocessing: write to a temporary name, fsync, rename over the final name,
fsync the folder (so the rename itself survives a power cut)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

TMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[Any], None], before_publish: Callable[[], None] = lambda: None) -> None:
    """Write through `write(file)` to a temporary name, fsync, then rename over `path`: readers see
    the old file or the whole new one, never a part."""
    tmp = path.with_name(f"{path.name}{TMP_SUFFIX}.{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    before_publish()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    write_durably(path, lambda f: f.write(text.encode()))
