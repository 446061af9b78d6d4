"""The files of a Hugging Face folder as the importer opens them.

Only regular files are opened (a device, fifo or socket is refused: `config.json` linked to /dev/zero would
be read until memory runs out). Links are followed while they stay inside the folder or, for a folder laid
out as the Hugging Face hub cache (`<repo>/snapshots/<revision>/`, every file a link into `<repo>/blobs/`,
the normal case for a downloaded model), inside that blobs folder; any other target is refused. The small
files (JSON) are read with a size cap no real one comes near.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


class HfFolderError(ValueError):
    """A Hugging Face folder the importer cannot represent or read; the message names every problem."""


def has_entry(directory: Path, name: str) -> bool:
    """Whether the folder has an entry `name` (a dangling or refused link counts: opening it says why)."""
    return os.path.lexists(directory / name)


def link_roots(directory: Path) -> tuple[Path, ...]:
    """Where the folder's links may lead: the folder itself and, for a hub-cache snapshot, the repo's blobs/."""
    folder = directory.resolve()
    return (folder, folder.parent.parent / "blobs") if folder.parent.name == "snapshots" else (folder,)


def folder_file(directory: Path, name: str, max_bytes: int | None = None) -> Path:
    """The regular file `name` of the folder, with its links resolved; HfFolderError naming it otherwise."""
    path = directory / name
    try:
        target = path.resolve(strict=True)
        mode = target.stat().st_mode
    except (OSError, RuntimeError) as err:  # missing, dangling, a link loop, unreadable
        raise HfFolderError(f"{path}: cannot be opened ({err})") from None
    roots = link_roots(directory)
    if not any(target.is_relative_to(root) for root in roots):
        raise HfFolderError(f"{path} leads to {target}, outside {' and '.join(map(str, roots))}: links are followed "
                            "only inside the folder (and a hub-cache snapshot's blobs/)")
    if not stat.S_ISREG(mode):
        raise HfFolderError(f"{path} is not a regular file (a folder, device, fifo or socket)")
    if max_bytes is not None and target.stat().st_size > max_bytes:
        raise HfFolderError(f"{path}: {target.stat().st_size} bytes, more than the {max_bytes} any such file needs")
    return target


def read_folder_text(directory: Path, name: str, max_bytes: int) -> str:
    """A small text file of the folder, read with a cap (it cannot grow past it while being read)."""
    path = folder_file(directory, name, max_bytes)
    with open(path, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise HfFolderError(f"{directory / name}: more than the {max_bytes} bytes any such file needs")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HfFolderError(f"{directory / name}: not UTF-8 text ({err})") from None
