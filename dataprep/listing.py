"""The input listing that every partition of a run must agree on: each input file named relative to the
input files' common folder (so machines that mount the corpus at different paths still agree), its size,
and the subset it belongs to.

Subsets come from the folder names. Nemotron-CC names them Hive-style (`quality=high/kind=actual/
kind2=actual`): an input file's subset is its `key=value` folders, wherever they sit in its path, so a run over
one quality level still knows which level it is. In other folder structures the subset is the file's folder
relative to the common folder (`.` for the common folder itself).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ListedFile:
    path: Path  # absolute, on this machine
    name: str  # relative to the listing's root, POSIX separators
    size: int  # bytes on disk
    subset: str


@dataclass(frozen=True)
class Listing:
    root: Path
    files: tuple[ListedFile, ...]

    @classmethod
    def of(cls, paths: list[Path]) -> Listing:
        """The listing of sorted, absolute input paths (as `dataprep.input_files.resolve_inputs` returns them)."""
        if not paths:
            raise ValueError("no input file")
        root = Path(os.path.commonpath([path.parent for path in paths]))
        return cls(root, tuple(ListedFile(path, path.relative_to(root).as_posix(), path.stat().st_size,
                                          subset_of(path, root)) for path in paths))

    def identity(self) -> list[list]:
        """What partitions compare to know they split the same input: names and sizes, in order."""
        return [[file.name, file.size] for file in self.files]


def subset_of(path: Path, root: Path) -> str:
    hive = [part for part in path.parent.parts if "=" in part]
    if hive:
        return "/".join(hive)
    return path.parent.relative_to(root).as_posix()
