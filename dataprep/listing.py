"""The input listing that every partition of a run must agree on: each shard named relative to the
shards' common folder (so machines that mount the corpus at different paths still agree), its size,
and the bucket it belongs to.

Buckets come from the folder names. Nemotron-CC names them Hive-style (`quality=high/kind=actual/
kind2=actual`): a shard's bucket is its `key=value` folders, wherever they sit in its path, so a run over
one quality level still knows which level it is. In other layouts the bucket is the shard's folder
relative to the common folder (`.` for the common folder itself).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ListedShard:
    path: Path  # absolute, on this machine
    name: str  # relative to the listing's root, POSIX separators
    size: int  # bytes on disk
    bucket: str


@dataclass(frozen=True)
class Listing:
    root: Path
    shards: tuple[ListedShard, ...]

    @classmethod
    def of(cls, paths: list[Path]) -> Listing:
        """The listing of sorted, absolute shard paths (as `dataprep.shards.resolve_inputs` returns them)."""
        if not paths:
            raise ValueError("no input shard")
        root = Path(os.path.commonpath([path.parent for path in paths]))
        return cls(root, tuple(ListedShard(path, path.relative_to(root).as_posix(), path.stat().st_size,
                                           bucket_of(path, root)) for path in paths))

    def identity(self) -> list[list]:
        """What partitions compare to know they split the same input: names and sizes, in order."""
        return [[shard.name, shard.size] for shard in self.shards]


def bucket_of(path: Path, root: Path) -> str:
    hive = [part for part in path.parent.parts if "=" in part]
    if hive:
        return "/".join(hive)
    return path.parent.relative_to(root).as_posix()
