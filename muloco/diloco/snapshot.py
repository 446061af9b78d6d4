"""One rank's outer state as one snapshot, in one form checked in one place: what a checkpoint saves
(the DeepSpeed hook's `outer.save`, the trainer's rank files) and what an elastic member that is
behind receives from a peer (its catch-up).

A snapshot says who wrote it (`Identity`: the job, the worker, the global rank, the layout and the
plan's signature), where the run stood (its inner step), the outer optimizer's state of the tensors
this rank owns (global weights and momentum, fp32; the error feedback in a checkpoint), and the syncs in
flight: in a checkpoint each with the buckets this rank sent, replayed on resume (every worker resumes
together and the exchange is deterministic); for a peer each landed one with its result (the member
behind takes the results, not the exchange). A catch-up also names the sync the member joins (`joins`)
with the lr schedule's state there.

Nothing in a snapshot is believed: `Snapshot.from_tree` checks every field's type, every tensor's
dtype and shape against this rank's own (`Form`: they are loaded with copy_, which would broadcast a
smaller tensor), and `identity_problems` refuses another job's, worker's, rank's, layout's or plan's.
The file of `save_rank_snapshot` is a rank file (muloco/core/rank_file.py: safetensors and a JSON tree,
nothing pickled) with its SHA-256 beside it, both written durably.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from muloco.core.durable import write_durably, write_text_durably
from muloco.core.errors import CheckpointError
from muloco.core.rank_file import RankFileError, read_rank_file, to_plain, write_rank_file

FORMAT = "muloco-outer-snapshot-1"
CHECKPOINT, CATCH_UP = "checkpoint", "catch_up"
SNAPSHOT_FOLDER = "muloco_outer"  # inside a checkpoint folder: one file per global rank
_SHA256_BYTES = 64  # a sidecar holds the hex digest and nothing else


class SnapshotError(RankFileError):
    """A snapshot that is malformed or belongs to another job, worker, rank, layout or plan; the
    message names the source and the problems."""


@dataclass(frozen=True)
class Identity:
    job_id: str  # muloco.auth.job_id ("" when the workers do not talk)
    job_key: str  # a tag of the job secret (hex; "" without one): equal iff the same secret
    worker: int
    rank: int  # the global rank
    layout: tuple[int, int, int, int]  # K, D, P, T
    plan: str  # plan.plan_signature of this rank's tensors (hex)


@dataclass
class InFlight:
    """A sync launched and not yet applied."""
    fragment: int
    launched_at: int  # the inner step it was launched after
    apply_at: int
    outer_step: int
    deltas: list[torch.Tensor] = field(default_factory=list)  # checkpoint: this rank's buckets, to replay
    averages: list[torch.Tensor] | None = None  # catch-up: its landed result (None: the sync was skipped)


@dataclass
class Joins:
    """The sync a member that caught up takes part in, and where the run stood when it launched."""
    fragment: int
    step: int
    outer_step: int
    scheduler: dict | None


@dataclass
class Snapshot:
    kind: str  # CHECKPOINT or CATCH_UP
    identity: Identity
    step: int  # the host's inner step when it was taken
    outer_step: int
    skipped: int
    global_weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    error_feedback: dict[str, torch.Tensor]  # residuals by tensor name, wire shape (a checkpoint's; none before a sync)
    in_flight: list[InFlight]
    overlap_needed: dict[int, float]  # `overlap_steps: "auto"`: each fragment's last measured need
    pace_deadline_s: float | None  # wall-clock pacing: the next interval's deadline (None: not set)
    joins: Joins | None = None  # catch-up only

    def to_tree(self) -> dict:
        """The snapshot as a rank file's tree (tensors shared, not copied)."""
        tree = {f.name: getattr(self, f.name) for f in fields(self)}
        tree["identity"] = {f.name: getattr(self.identity, f.name) for f in fields(Identity)}
        tree["identity"]["layout"] = list(self.identity.layout)
        tree["in_flight"] = [{f.name: getattr(e, f.name) for f in fields(InFlight)} for e in self.in_flight]
        tree["overlap_needed"] = {str(k): v for k, v in self.overlap_needed.items()}
        tree["joins"] = None if self.joins is None else {f.name: getattr(self.joins, f.name) for f in fields(Joins)}
        return {"format": FORMAT, **tree}

    @classmethod
    def from_tree(cls, tree: Any, form: Form, source: str) -> Snapshot:
        """The snapshot in `tree` (a rank file's, fully read), checked against this rank's `form`;
        SnapshotError naming `source` and the first problems."""
        problems = _Checker(form).snapshot(tree)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise SnapshotError(f"{source} is not an outer-loop snapshot of this run: " + "; ".join(problems[:5]) + more)
        identity = Identity(**{**tree["identity"], "layout": tuple(tree["identity"]["layout"])})
        joins = None if tree["joins"] is None else Joins(**tree["joins"])
        return cls(tree["kind"], identity, tree["step"], tree["outer_step"], tree["skipped"],
                   dict(tree["global_weights"]), dict(tree["momentum"]), dict(tree["error_feedback"]),
                   [InFlight(**entry) for entry in tree["in_flight"]],
                   {int(k): v for k, v in tree["overlap_needed"].items()}, tree["pace_deadline_s"], joins)


@dataclass
class Form:
    """What this rank's snapshots look like: its owned tensors, the error-feedback residuals it may
    hold, each fragment's bucket sizes, and its lr schedule's keys (None: it has none)."""
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    error_feedback: dict[str, tuple[int, ...]]
    bucket_sizes: list[list[int]]
    schedule_keys: frozenset[str] | None


def identity_problems(theirs: Identity, mine: Identity, kind: str) -> list[str]:
    """How a snapshot's writer differs from what this rank may load: a checkpoint must be this very
    rank's (of this job, worker, layout and plan); a peer's catch-up state of this job, layout and plan."""
    problems = []
    if (theirs.job_id, theirs.job_key) != (mine.job_id, mine.job_key):
        problems.append(f"it is of another job (job_id {theirs.job_id!r}"
                        + (", another job secret" if theirs.job_key != mine.job_key else "")
                        + f"; this run's job_id is {mine.job_id!r})")
    if theirs.layout != mine.layout:
        problems.append(f"it was written at K x D x P x T = {' x '.join(map(str, theirs.layout))}, this run is "
                        f"{' x '.join(map(str, mine.layout))}")
    if kind == CHECKPOINT and (theirs.worker, theirs.rank) != (mine.worker, mine.rank):
        problems.append(f"it is worker {theirs.worker}'s, rank {theirs.rank}'s, not this rank's (worker {mine.worker}, "
                        f"rank {mine.rank}): each worker loads its own folder")
    if theirs.plan != mine.plan:
        problems.append("its plan (parameter names, shapes, ZeRO partitions, compression groups, fragments) is not "
                        "this run's: another model or ds_config")
    return problems


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Checker:
    """Every problem of a tree that claims to be a snapshot of this rank's form."""

    def __init__(self, form: Form):
        self.form = form
        self.problems: list[str] = []

    def snapshot(self, tree: Any) -> list[str]:
        keys = {"format", *(f.name for f in fields(Snapshot))}
        if not isinstance(tree, Mapping) or set(tree) != keys:
            found = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
            return [f"its keys are {found}, not {sorted(keys)}"]
        if tree["format"] != FORMAT:
            return [f"its format is {tree['format']!r}, not {FORMAT!r}"]
        if tree["kind"] not in (CHECKPOINT, CATCH_UP):
            return [f"its kind {tree['kind']!r} is not {CHECKPOINT!r} or {CATCH_UP!r}"]
        self.identity(tree["identity"])
        for key in ("step", "outer_step", "skipped"):
            if not _is_count(tree[key]):
                self.problems.append(f"{key} {tree[key]!r} is not a count")
        for key in ("global_weights", "momentum"):
            self.tensors(key, tree[key], {n: dtype_shape for n, dtype_shape in self.form.tensors.items()}, exact=True)
        feedback = {n: (torch.float32, shape) for n, shape in self.form.error_feedback.items()}
        if tree["kind"] == CATCH_UP and tree["error_feedback"] != {}:
            self.problems.append("a peer's state carries its own error feedback")
        else:  # none before the first sync of a compressed bucket, else every residual
            self.tensors("error_feedback", tree["error_feedback"], feedback, exact=bool(tree["error_feedback"]))
        self.in_flight(tree["in_flight"], tree["kind"])
        self.overlap(tree["overlap_needed"])
        deadline = tree["pace_deadline_s"]
        if deadline is not None and not (isinstance(deadline, float) and 0 < deadline < math.inf):
            self.problems.append(f"pace_deadline_s {deadline!r} is not a positive number")
        self.joins(tree["joins"], tree["kind"])
        return self.problems

    def identity(self, identity: Any) -> None:
        keys = {f.name for f in fields(Identity)}
        if not isinstance(identity, Mapping) or set(identity) != keys:
            self.problems.append(f"its identity is not a record of {sorted(keys)}")
            return
        if not all(isinstance(identity[k], str) for k in ("job_id", "job_key", "plan")):
            self.problems.append("its identity's job_id, job_key and plan are not strings")
        if not (_is_count(identity["worker"]) and _is_count(identity["rank"])):
            self.problems.append("its identity's worker and rank are not counts")
        layout = identity["layout"]
        if not (isinstance(layout, list) and len(layout) == 4 and all(_is_count(n) and n > 0 for n in layout)):
            self.problems.append(f"its identity's layout {layout!r} is not four positive sizes")

    def tensors(self, key: str, theirs: Any, mine: dict[str, tuple[torch.dtype, tuple[int, ...]]], exact: bool) -> None:
        if not isinstance(theirs, Mapping) or (set(theirs) != set(mine) if exact else not set(theirs) <= set(mine)):
            self.problems.append(f"{key} holds other parameters than this rank owns")
            return
        for name, t in theirs.items():
            dtype, shape = mine[name]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                self.problems.append(f"{key}[{name}] is not a {dtype} tensor of shape {shape}")

    def in_flight(self, entries: Any, kind: str) -> None:
        keys = {f.name for f in fields(InFlight)}
        if not isinstance(entries, list) or not all(isinstance(e, Mapping) and set(e) == keys for e in entries):
            self.problems.append(f"its syncs in flight are not records of {sorted(keys)}")
            return
        for i, entry in enumerate(entries):
            fragment = entry["fragment"]
            if not _is_count(fragment) or fragment >= len(self.form.bucket_sizes):
                self.problems.append(f"in_flight[{i}].fragment {fragment!r} is not a fragment of this run")
                continue
            if not all(_is_count(entry[k]) for k in ("launched_at", "apply_at", "outer_step")) \
                    or entry["apply_at"] < entry["launched_at"]:
                self.problems.append(f"in_flight[{i}]'s steps are not counts with apply_at >= launched_at")
            sizes = self.form.bucket_sizes[fragment]
            # A checkpoint replays what this rank sent; a peer hands over what landed (None: skipped).
            sent, result = (entry["deltas"], None) if kind == CHECKPOINT else (None, entry["averages"])
            if kind == CHECKPOINT and entry["averages"] is not None or kind == CATCH_UP and entry["deltas"] != []:
                self.problems.append(f"in_flight[{i}] carries a {'result' if kind == CHECKPOINT else 'payload'} "
                                     f"a {kind} does not hold")
            for what, buffers in (("deltas", sent), ("averages", result)):
                if buffers is not None and not self.buckets(buffers, sizes):
                    self.problems.append(f"in_flight[{i}].{what} are not fp32 buckets of sizes {sizes}")

    @staticmethod
    def buckets(buffers: Any, sizes: list[int]) -> bool:
        return isinstance(buffers, list) and len(buffers) == len(sizes) and all(
            isinstance(b, torch.Tensor) and b.dtype == torch.float32 and tuple(b.shape) == (n,)
            for b, n in zip(buffers, sizes))

    def overlap(self, needed: Any) -> None:
        fragments = {str(f) for f in range(len(self.form.bucket_sizes))}
        if not isinstance(needed, Mapping) or not set(needed) <= fragments or not all(
                isinstance(v, float) and 0 <= v < math.inf for v in needed.values()):
            self.problems.append("overlap_needed is not a non-negative time per fragment of this run")

    def joins(self, joins: Any, kind: str) -> None:
        if kind == CHECKPOINT:
            if joins is not None:
                self.problems.append("a checkpoint names a sync to join")
            return
        keys = {f.name for f in fields(Joins)}
        if not isinstance(joins, Mapping) or set(joins) != keys:
            self.problems.append(f"its sync to join is not a record of {sorted(keys)}")
            return
        if not all(_is_count(joins[k]) for k in ("fragment", "step", "outer_step")):
            self.problems.append("its sync to join has steps that are not counts")
        elif joins["fragment"] >= len(self.form.bucket_sizes):
            self.problems.append(f"joins.fragment {joins['fragment']} is not a fragment of this run")
        schedule, mine = joins["scheduler"], self.form.schedule_keys
        if (schedule is None) != (mine is None) or (
                mine is not None and (not isinstance(schedule, Mapping) or set(schedule) != mine)):
            self.problems.append("the lr schedule's state has other keys than this run's")


# -- the files ------------------------------------------------------------------------------------

def snapshot_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / SNAPSHOT_FOLDER / f"rank_{rank:05d}.safetensors"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save_rank_snapshot(directory: str | Path, snapshot: Snapshot) -> Path:
    """This rank's snapshot into DIRECTORY/muloco_outer/, durably: the rank file, then its SHA-256."""
    path = snapshot_file(directory, snapshot.identity.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest: list[str] = []
    write_durably(path, lambda f: digest.append(write_rank_file(f, snapshot.to_tree())))
    write_text_durably(_sidecar(path), digest[0] + "\n")
    return path


def _regular_file(path: Path, what: str) -> None:
    if not path.exists():
        raise CheckpointError(f"{what} {path} does not exist: no outer-loop snapshot of this rank was saved there")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} is not a regular file")


def read_rank_snapshot(directory: str | Path, rank: int) -> dict:
    """The tree of rank `rank`'s snapshot file, after its SHA-256 is checked (CheckpointError naming the
    file when it is missing, damaged or not a snapshot file)."""
    path = snapshot_file(directory, rank)
    sidecar = _sidecar(path)
    _regular_file(path, "the snapshot file")
    _regular_file(sidecar, "the snapshot's checksum file")
    with open(sidecar, "rb") as f:
        expected = f.read(_SHA256_BYTES + 2).decode(errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise CheckpointError(f"{sidecar} does not hold a SHA-256")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise CheckpointError(f"{path} is damaged: its SHA-256 is not the one saved beside it")
    return to_plain(read_rank_file(path))
