"""The on-disk checkpoint format: paths, meta.json, the `latest` pointer, retention, and a reader that
merges tensor-parallel shards by canonical name.

    DIR/latest                              text: the step of the newest complete checkpoint
    DIR/iter_{step:07d}/
        rank_{global_rank:05d}.safetensors  one per rank: its state as tensors plus a JSON tree
                                            (muloco/core/rank_file.py); nothing is pickled
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
leaves the previous checkpoint and `latest` untouched. With --async-save the rank files are written
by a background thread and the same agreement and publishing follow a few steps later
(trainer/checkpoint/async_save.py). An OSError on any rank (full disk, read-only
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
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from muloco.core.errors import CheckpointError
from muloco.core.rank_file import read_rank_file
from trainer.config import BatchConfig, CheckpointArgs
from muloco.core.errors import ConfigError
from muloco.core.durable import TMP_SUFFIX, write_text_durably
from trainer.model.sharding import sharding_of, unshard
from trainer.model.presets import ModelShape
from muloco.core.topology import ParallelSizes, RankCoordinates, coordinates
from muloco.core.typed_json import ConfigBlock, ConfigProblems, Problem, load, setting

FORMAT_VERSION = 2  # 1: pickled rank files (no longer read: unpickling can run code)
COMPLETE = "complete"
LATEST = "latest"


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
    """The step `latest` names (None: no checkpoint yet)."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text(errors="replace").strip()
    if not re.fullmatch(r"[0-9]{1,12}", text):
        raise CheckpointError(f"{pointer} must hold a step number, got {text[:40]!r}")
    return int(text)


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


def prune(root: Path, keep_last: int, val_losses: Mapping[int, float] | None = None) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints, never the one `latest` names nor the
    best (the lowest of `val_losses`, step -> validation loss, among them). The marker goes first, so a
    crash mid-delete leaves an incomplete iteration the next save removes."""
    steps = complete_iterations(root)
    rated = [s for s in steps if s in (val_losses or {})]
    keep = {latest_iteration(root), *([min(rated, key=val_losses.__getitem__)] if rated else [])}
    doomed = [s for s in steps[:-keep_last] if s not in keep]
    for step in doomed:
        directory = iteration_dir(root, step)
        (directory / COMPLETE).unlink()
        shutil.rmtree(directory)
    return doomed


_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class CheckpointMeta(ConfigBlock):
    """meta.json. Read through the configuration loader, so a crafted file is refused field by field
    (types, ranges, the rank map and the rank files' names) before anything else is read."""
    step: int = setting(ge=0)
    sizes: ParallelSizes = setting()
    model: ModelShape = setting()
    vocab_size: int = setting(ge=1)  # the model's rows before padding: the tokenizer's, or an import's
    padded_vocab_size: int = setting(ge=1)
    ranks: tuple[RankCoordinates, ...] = setting()  # index = global rank
    tokenizer_model: str | None = setting()  # file name inside the iteration directory
    extra_state: tuple[str, ...] = setting()  # names of trainer.extra_state components saved
    config: dict[str, Any] = setting()  # the resolved RunConfig
    rank_files: dict[str, str] = setting()  # file name -> SHA-256 of its bytes, index = global rank
    format_version: int = FORMAT_VERSION
    # Only `model` (and `probe`) in the rank files, as Megatron's "release" checkpoints (an import from
    # Hugging Face): a run loads it as --finetune does, at step 0 with fresh optimizer, schedule and RNG.
    weights_only: bool = False
    # Whether every worker's weights were the outer loop's global weights when saved (right after a sync
    # of every fragment, or no outer loop): the K workers held one model. False: K models, between syncs.
    # None: not recorded (a checkpoint from before the field, or an import: one model by construction).
    workers_hold_one_model: bool | None = None

    def problems(self) -> list[Problem]:
        problems = [(f"sizes.{k}", f"must be >= 1, got {v!r}") for k, v in asdict(self.sizes).items() if v < 1]
        if problems:
            return problems
        world = self.sizes.world
        if self.ranks != tuple(coordinates(r, self.sizes) for r in range(world)):
            problems.append(("ranks", f"must map each of the {world} ranks of {self.describe_layout()} to its "
                                      "coordinates in order"))
        names = {rank_file(Path(), r).name for r in range(world)}
        if set(self.rank_files) != names:
            problems.append(("rank_files", f"must name rank_00000..rank_{world - 1:05d}.safetensors, got "
                                           f"{sorted(self.rank_files)[:4]}"))
        bad = [name for name, digest in self.rank_files.items() if not _SHA256.fullmatch(digest)]
        if bad:
            problems.append((f"rank_files.{bad[0]}", f"must be a SHA-256 in hex, got {self.rank_files[bad[0]]!r}"))
        if self.padded_vocab_size < self.vocab_size:
            problems.append(("padded_vocab_size", f"({self.padded_vocab_size}) is below vocab_size ({self.vocab_size})"))
        if self.weights_only:  # no run wrote it: nothing of a batch to continue
            return problems
        try:
            load(BatchConfig, self.config.get("batch"), "config.batch")
        except ConfigProblems as err:
            problems.extend(err.problems)
        return problems

    @property
    def global_batch(self) -> int:
        return load(BatchConfig, self.config["batch"]).global_batch

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    @classmethod
    def from_json(cls, text: str, path: Path | str = "meta.json") -> CheckpointMeta:
        """meta.json's contents; CheckpointError naming `path` and every bad field."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format version {d.get('format_version')!r} is not "
                                  f"{FORMAT_VERSION}" + (" (version 1 rank files are pickles, which this trainer never "
                                                         "loads: unpickling can run code)"
                                                         if d.get("format_version") == 1 else ""))
        try:
            return load(cls, d)
        except ConfigProblems as err:
            raise CheckpointError(f"{path}: {err}") from None

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
        named_by_latest = iteration is None
        if iteration is None:
            iteration = latest_iteration(self.root)
            if iteration is None:
                raise CheckpointError(f"no checkpoint in {self.root}: {self.root / LATEST} does not exist")
        self.directory = iteration_dir(self.root, iteration)
        if named_by_latest and not self.directory.is_dir():
            raise CheckpointError(f"{self.root / LATEST} names step {iteration}, but {self.directory} does not exist")
        if not (self.directory / COMPLETE).is_file():
            raise CheckpointError(f"checkpoint {self.directory} is incomplete or missing (no {COMPLETE!r} marker)")
        meta_file = self.directory / "meta.json"
        if not meta_file.is_file():
            raise CheckpointError(f"{meta_file} is missing")
        self.meta = CheckpointMeta.from_json(meta_file.read_text(errors="replace"), meta_file)
        if self.meta.step != iteration:
            raise CheckpointError(f"{meta_file}: step {self.meta.step} is not its folder's ({iteration})")
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
            self._open[rank] = read_rank_file(path)
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
        """The full (T=1) form of a tensor that is sharded like parameter `name` over `ranks`;
        `get` picks it out of a rank file (the weight itself, or optimizer state)."""
        return unshard([get(self.rank_state(r)) for r in ranks], sharding_of(name))


def checkpoint_args(load: str | None) -> CheckpointArgs:
    """The --load checkpoint's model, vocabulary and saved tokenizer (its latest iteration), for
    --use-checkpoint-args; a problem is a ConfigError, as a bad flag's."""
    if not load:
        raise ConfigError("--use-checkpoint-args needs --load DIR")
    try:
        reader = CheckpointReader(load)
        tokenizer = reader.tokenizer_path
    except (CheckpointError, OSError, ValueError) as err:
        raise ConfigError(f"--use-checkpoint-args: {err}") from None
    return CheckpointArgs(reader.meta.model, reader.meta.vocab_size, None if tokenizer is None else str(tokenizer))
