"""The on-disk checkpoint format: paths, meta.json, the `latest` pointer, retention, and a reader that
merges tensor-parallel shards by canonical name.

    DIR/latest                              text: the step of the newest complete checkpoint
    DIR/iter_{step:07d}/
        rank_{global_rank:05d}.safetensors  one per rank: its state as tensors plus a JSON tree
                                            (trainer/checkpoint/rank_file.py); nothing is pickled
        meta.json                           rank 0: sizes K/D/P/T, model shape, vocab (padded and not),
                                            the rank -> (worker, data, pipeline, tensor) map, the
                                            resolved config, and each rank file's SHA-256
        tokenizer.model                     rank 0: copy of --tokenizer-model, when one was used
        complete                            rank 0, after every rank's file is durable

A rank file holds, under canonical parameter names (global layer indices, same at every P): `model`
(this rank's TP shard), `optimizer` (hyperparameters per param group and per-parameter state),
`scheduler`, `engine` (DeepSpeed's counters), `step`, `rng` (python, numpy, torch, accelerator,
Megatron's RNG tracker), `extra` (each `trainer.extra_state` component, e.g. the MuLoCo outer loop)
and, on last-stage ranks, `probe`: token ids and this shard's logits, which the exporter's
`--verify` checks the merged weights against.

Saving (trainer/checkpoint/checkpointer.py): each rank writes its file under a temporary name,
fsyncs and renames, hashing the bytes as they go; the ranks exchange their hashes (or their errors);
rank 0 writes meta.json, then `complete`, then moves `latest` by rename, then removes leftovers of
crashed saves and, with --keep-last N, all but the newest N complete checkpoints. A crash mid-save
leaves the previous checkpoint and `latest` untouched. An OSError on any rank (full disk, read-only
folder) ends every rank together with one `checkpoint error:` line: temporary files and the
unpublished iteration are removed and `latest` still names the previous checkpoint.

Loading: a rank file is checked against meta.json's SHA-256 when first opened (a damaged file is
refused with its name; --no-verify-checksums skips the extra read at scale) and read with the
safetensors library, tensors on lookup. Checkpoints of format version 1 (pickled rank files) are
refused: unpickling can run code.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainer.checkpoint.rank_file import RankFileError, read_rank_file
from trainer.durable import TMP_SUFFIX, write_text_durably
from trainer.model.layout import layout_of, unshard
from trainer.model.presets import ModelShape
from trainer.topology import ParallelSizes, RankCoordinates

FORMAT_VERSION = 2  # 1: pickled rank files (no longer read: unpickling can run code)
COMPLETE = "complete"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit this run; the message says which."""


def iteration_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.safetensors"


def sha256_of(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


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


def complete_iterations(root: Path) -> list[int]:
    return sorted(int(d.name.removeprefix("iter_")) for d in root.glob("iter_*") if (d / COMPLETE).is_file())


def prune(root: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names).
    The marker goes first, so a crash mid-delete leaves an incomplete iteration the next save removes."""
    latest = latest_iteration(root)
    doomed = [s for s in complete_iterations(root)[:-keep_last] if s != latest]
    for step in doomed:
        directory = iteration_dir(root, step)
        (directory / COMPLETE).unlink()
        shutil.rmtree(directory)
    return doomed


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    sizes: ParallelSizes
    model: ModelShape
    vocab_size: int  # the model's vocabulary before padding: the tokenizer's, or an imported model's embedding rows
    padded_vocab_size: int
    ranks: list[RankCoordinates]  # index = global rank
    tokenizer_model: str | None  # file name inside the iteration directory
    extra_state: list[str]  # names of trainer.extra_state components saved
    config: dict
    rank_files: dict[str, str]  # file name -> SHA-256 of its bytes, index = global rank
    format_version: int = FORMAT_VERSION
    # Only `model` (and `probe`) in the rank files, as Megatron's "release" checkpoints (an import from
    # Hugging Face): a run loads it as --finetune does, at step 0 with fresh optimizer, schedule and RNG.
    weights_only: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMeta:
        d = json.loads(text)
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint format version {d.get('format_version')} is not {FORMAT_VERSION}"
                                  + (" (version 1 rank files are pickles, which this trainer never loads: unpickling "
                                     "can run code)" if d.get("format_version") == 1 else ""))
        return cls(**{**d, "sizes": ParallelSizes(**d["sizes"]), "model": ModelShape(**d["model"]),
                      "ranks": [RankCoordinates(**r) for r in d["ranks"]]})

    def rank_of(self, coords: RankCoordinates) -> int:
        return self.ranks.index(coords)

    def describe_layout(self) -> str:
        s = self.sizes
        return f"K={s.workers} D={s.data} P={s.pipeline} T={s.tensor}"


class CheckpointReader:
    """One complete iteration of a checkpoint. A rank file is checked against its SHA-256 in
    meta.json when first opened (unless `verify_checksums` is off) and then read lazily: a tensor
    is read from the file only when it is looked up."""

    def __init__(self, root: str | Path, iteration: int | None = None, verify_checksums: bool = True):
        self.root = Path(root)
        if iteration is None:
            iteration = latest_iteration(self.root)
            if iteration is None:
                raise CheckpointError(f"no checkpoint in {self.root}: {self.root / LATEST} does not exist")
        self.directory = iteration_dir(self.root, iteration)
        if not (self.directory / COMPLETE).is_file():
            raise CheckpointError(f"checkpoint {self.directory} is incomplete or missing (no {COMPLETE!r} marker)")
        self.meta = CheckpointMeta.from_json((self.directory / "meta.json").read_text())
        self.verify_checksums = verify_checksums
        self._open: dict[int, dict] = {}

    @property
    def tokenizer_path(self) -> Path | None:
        """The tokenizer file saved with the checkpoint. meta.json names it; a name that leads outside
        the iteration's folder (`../`, an absolute path, a link) is refused: a crafted checkpoint must
        not make an export copy someone else's file."""
        name = self.meta.tokenizer_model
        if name is None:
            return None
        folder = self.directory.resolve()
        path = (folder / str(name)).resolve()
        if path.parent != folder:
            raise CheckpointError(f"{self.directory / 'meta.json'}: tokenizer_model {name!r} is not a file in the "
                                  f"checkpoint's folder")
        return path

    def rank_state(self, rank: int) -> Mapping:
        if rank not in self._open:
            path = rank_file(self.directory, rank)
            if not path.is_file():
                raise CheckpointError(f"rank file {path} is missing")
            if self.verify_checksums:
                expected, actual = self.meta.rank_files.get(path.name), sha256_of(path)
                if actual != expected:
                    raise CheckpointError(f"rank file {path} is damaged: its SHA-256 is {actual}, meta.json records "
                                          f"{expected} (--no-verify-checksums skips this check)")
            try:
                self._open[rank] = read_rank_file(path)
            except RankFileError as err:
                raise CheckpointError(str(err)) from None
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
