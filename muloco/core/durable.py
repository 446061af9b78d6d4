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
    the old file or the whole new one, never a part. A write that fails (a full disk) removes its
    temporary file."""
    tmp = path.with_name(f"{path.name}{TMP_SUFFIX}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        before_publish()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    write_durably(path, lambda f: f.write(text.encode()))


def check_writable_folder(folder: str | Path, flag: str) -> None:
    """Fail at start-up, with one line naming the folder and the flag, when `folder` cannot be created
    or written (a read-only mount, no permission, a file in the way), rather than with a traceback at
    the first save. Creates nothing."""
    from muloco.core.errors import ConfigError

    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == path else f"would be created in {existing}, which is"
        raise ConfigError(f"{flag} {folder} {what} not writable (read-only file system or no permission)")


def check_output_folders(config) -> None:
    """The run's output folders (a RunConfig's run, TensorBoard and checkpoint folders)."""
    for flag, folder in (("--run-dir", config.run_dir), ("--tensorboard-dir", config.tensorboard_dir),
                         ("--save", config.save)):
        if folder:
            check_writable_folder(folder, flag)
