"""The on-disk layout (see trainer/checkpoint/__init__.py): paths, meta.json, durable writes, the
`latest` pointer, and a reader that merges tensor-parallel shards by canonical name."""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from trainer.durable import TMP_SUFFIX, write_text_durably
from trainer.model.layout import layout_of, unshard
from trainer.model.presets import ModelShape
from trainer.topology import ParallelSizes, RankCoordinates

FORMAT_VERSION = 1
COMPLETE = "complete"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit this run; the message says which."""


def iteration_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def latest_iteration(root: str | Path) -> int | None:
    pointer = Path(root) / LATEST
    return int(pointer.read_text().strip()) if pointer.is_file() else None


def publish(root: Path, step: int) -> None:
    """Rank 0, after every rank's file is durable: mark the iteration complete, move `latest`."""
    directory = iteration_dir(root, step)
    write_text_durably(directory / COMPLETE, f"{step}\n")
    write_text_durably(root / LATEST, f"{step}\n")


def remove_incomplete(root: Path, keep: int) -> None:
    """Leftovers of crashed saves: iterations without the complete marker, and temporary files."""
    for directory in root.glob("iter_*"):
        if directory != iteration_dir(root, keep) and not (directory / COMPLETE).exists():
            shutil.rmtree(directory, ignore_errors=True)
    for tmp in root.glob(f"**/*{TMP_SUFFIX}.*"):
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    sizes: ParallelSizes
    model: ModelShape
    vocab_size: int  # the tokenizer's
    padded_vocab_size: int
    ranks: list[RankCoordinates]  # index = global rank
    tokenizer_model: str | None  # file name inside the iteration directory
    extra_state: list[str]  # names of trainer.extra_state components saved
    config: dict
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointMeta":
        d = json.loads(text)
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint format version {d.get('format_version')} is not {FORMAT_VERSION}")
        return cls(**{**d, "sizes": ParallelSizes(**d["sizes"]), "model": ModelShape(**d["model"]),
                      "ranks": [RankCoordinates(**r) for r in d["ranks"]]})

    def rank_of(self, coords: RankCoordinates) -> int:
        return self.ranks.index(coords)

    def describe_layout(self) -> str:
        s = self.sizes
        return f"K={s.workers} D={s.data} P={s.pipeline} T={s.tensor}"


class CheckpointReader:
    """One complete iteration of a checkpoint. Rank files are opened memory-mapped, so reading one
    tensor does not read the rest of the file."""

    def __init__(self, root: str | Path, iteration: int | None = None):
        self.root = Path(root)
        if iteration is None:
            iteration = latest_iteration(self.root)
            if iteration is None:
                raise CheckpointError(f"no checkpoint in {self.root}: {self.root / LATEST} does not exist")
        self.directory = iteration_dir(self.root, iteration)
        if not (self.directory / COMPLETE).is_file():
            raise CheckpointError(f"checkpoint {self.directory} is incomplete or missing (no {COMPLETE!r} marker)")
        self.meta = CheckpointMeta.from_json((self.directory / "meta.json").read_text())
        self._open: dict[int, dict] = {}

    def rank_state(self, rank: int) -> dict:
        if rank not in self._open:
            self._open[rank] = torch.load(rank_file(self.directory, rank), map_location="cpu", mmap=True,
                                          weights_only=False)
        return self._open[rank]

    def close(self, rank: int) -> None:
        self._open.pop(rank, None)

    def stage_ranks(self, worker: int, data: int, pipeline: int) -> list[int]:
        """The global ranks of one pipeline stage of one replica, in TP-rank order."""
        return [self.meta.rank_of(RankCoordinates(worker, data, pipeline, t)) for t in range(self.meta.sizes.tensor)]

    def stage_of(self, worker: int, data: int) -> dict[str, int]:
        """Canonical parameter name -> pipeline stage holding it, for one replica."""
        return {name: p for p in range(self.meta.sizes.pipeline)
                for name in self.rank_state(self.stage_ranks(worker, data, p)[0])["model"]}

    def full_tensor(self, ranks: list[int], name: str, get: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        """The full (T=1) layout of a tensor that is sharded like parameter `name` over `ranks`;
        `get` picks it out of a rank file (the weight itself, or optimizer state)."""
        return unshard([get(self.rank_state(r)) for r in ranks], layout_of(name))
