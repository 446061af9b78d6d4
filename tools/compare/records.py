"""The records of finished work, one JSON line each (committed): `<out>/<corpus>/runs.jsonl` for
training runs, `<out>/<corpus>/alignment.jsonl` for alignment measurements,
`<out>/<corpus>/alignment_batch.jsonl` for the alignment's per-worker-batch sweep. A rerun skips what
is recorded, so the protocol completes over several sittings.

A line is appended whole (one write of the encoded line, then fsync) only after its work finished,
so a killed sitting leaves no partial line; a line that does not parse, or that misses fields, stops
the tool with one error naming the file and line. A record is trusted only when it was made with
this invocation's protocol (steps, H, warm-up, batch, validation size, model, architecture,
vocabulary, selection seed), on this corpus (its name, and the digest of its prepared data: the
tokenizer and both tokenized splits, which a corpus built on another machine may not share), with
the current content of its method's config: otherwise the tool refuses to go on (use another --out,
or remove the stale lines). A later line for the same key supersedes an earlier one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Generic, TypeVar

from tools.compare.protocol import RunSpec


@dataclass(frozen=True)
class RunRecord:
    corpus: str
    data_sha256: str  # Data.sha256 of the prepared corpus the run read
    method: str
    inner_lr: float
    outer_lr: float | None
    seed: int
    protocol: dict
    config_sha256: str
    final_val_loss: float
    val_curve: list[list[float]]  # [step, val loss] after every outer sync
    bytes_curve: list[list[float]]  # [step, cumulative bytes sent per worker]
    worker_cosine: float | None  # the trainer's mean cosine of each worker's pseudogradient with the average
    seconds: float
    commit: str

    @property
    def key(self) -> RunSpec:
        return RunSpec(self.method, self.inner_lr, self.outer_lr, self.seed)

    @property
    def bytes_per_worker(self) -> float:
        return self.bytes_curve[-1][1] if self.bytes_curve else 0.0


@dataclass(frozen=True)
class BranchKey:
    """One alignment measurement: `method`'s K workers (and its K=1 reference) at `lr_multiplier` x
    its selected inner lr, branched from its DP baseline's test run of `seed` at `start_step`."""
    method: str
    lr_multiplier: float
    seed: int
    start_step: int

    @property
    def name(self) -> str:
        return f"{self.method}_x{self.lr_multiplier:g}_s{self.seed}_at{self.start_step}"


@dataclass(frozen=True)
class AlignmentRecord:
    corpus: str
    data_sha256: str
    method: str
    lr_multiplier: float
    seed: int
    start_step: int
    inner_lr: float
    start_run: str  # the DP run the branch started from (RunSpec.name)
    protocol: dict
    config_sha256: str
    cosine: float  # averaged K-worker pseudogradient vs the K=1 reference's, over the whole model
    norm_ratio: float  # |averaged| / |reference|
    matrix_cosines: dict[str, float]  # the same per logical hidden matrix (Muon's matrices in MuLoCo)
    seconds: float
    commit: str

    @property
    def key(self) -> BranchKey:
        return BranchKey(self.method, self.lr_multiplier, self.seed, self.start_step)


@dataclass(frozen=True)
class BatchBranchKey:
    """One measurement of the alignment's per-worker-batch sweep (tools/alignment_batch_sweep.py): as
    BranchKey, with the branch and its K=1 reference at `per_worker_batch` sequences per worker (the
    reference at K x that)."""
    method: str
    per_worker_batch: int
    lr_multiplier: float
    seed: int
    start_step: int

    @property
    def name(self) -> str:
        return f"{self.method}_bk{self.per_worker_batch}_x{self.lr_multiplier:g}_s{self.seed}_at{self.start_step}"


@dataclass(frozen=True)
class BatchAlignmentRecord:
    """An AlignmentRecord's measure at another per-worker batch, with the functional measure
    (alignment.HeldOutLosses); in its own file, `<out>/<corpus>/alignment_batch.jsonl`."""
    corpus: str
    data_sha256: str
    method: str
    per_worker_batch: int
    lr_multiplier: float
    seed: int
    start_step: int
    inner_lr: float
    start_run: str  # the DP run the branch started from (RunSpec.name), at the protocol's batch
    protocol: dict  # the comparison's, whose DP runs give the start states
    config_sha256: str
    cosine: float
    norm_ratio: float
    matrix_cosines: dict[str, float]
    held_out_sequences: int  # validation sequences both runs were evaluated on
    loss_after_average: float  # the start weights minus the K workers' averaged pseudogradient
    loss_after_reference: float  # the start weights minus the K=1 reference's
    seconds: float
    commit: str

    @property
    def key(self) -> BatchBranchKey:
        return BatchBranchKey(self.method, self.per_worker_batch, self.lr_multiplier, self.seed, self.start_step)


Record = TypeVar("Record", RunRecord, AlignmentRecord, BatchAlignmentRecord)


def to_line(record: RunRecord | AlignmentRecord | BatchAlignmentRecord) -> str:
    return json.dumps(asdict(record), separators=(",", ":")) + "\n"


def _from_json(kind: type[Record], obj) -> Record:
    names = {f.name for f in dataclasses.fields(kind)}
    if not isinstance(obj, dict) or set(obj) != names:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"expected the fields {sorted(names)}, got {got}")
    return kind(**obj)


class RecordError(SystemExit):
    """A record file the tool cannot trust; the message names the file and line."""


class RecordFile(Generic[Record]):
    def __init__(self, path: Path, kind: type[Record]):
        self.path, self.kind = path, kind
        self._lock = threading.Lock()  # the scheduler's threads append concurrently

    def load(self, corpus: str, data_sha256: str | None, protocol: dict | None, config_sha256: dict[str, str]) -> dict:
        """Every record, by key. `data_sha256` or `protocol` None: whatever the file's first line has (for
        a report from the records alone); the corpus, its data, the protocol and each method's config
        must match throughout."""
        records: dict = {}
        if not self.path.exists():
            return records
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                where = f"{self.path}:{number}"
                if not line.endswith("\n"):
                    raise RecordError(f"{where}: incomplete last line (a write was cut short); remove it")
                try:
                    record = _from_json(self.kind, json.loads(line))
                except (ValueError, TypeError) as err:
                    raise RecordError(f"{where}: not a {self.kind.__name__} ({err}); fix or remove that line") from None
                protocol = record.protocol if protocol is None else protocol
                data_sha256 = record.data_sha256 if data_sha256 is None else data_sha256
                problem = _mismatch(record, corpus, data_sha256, protocol, config_sha256)
                if problem:
                    raise RecordError(f"{where}: recorded with other settings ({problem}); use another --out or "
                                      "remove the stale lines")
                records[record.key] = record
        return records

    def append(self, record: Record) -> None:
        """One whole line, durable before returning."""
        data = to_line(record).encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")
                os.fsync(fd)
            finally:
                os.close(fd)


def _mismatch(record, corpus: str, data_sha256: str, protocol: dict, config_sha256: dict[str, str]) -> str | None:
    if record.corpus != corpus:
        return f"corpus {record.corpus!r}, this run {corpus!r}"
    if record.data_sha256 != data_sha256:
        return (f"prepared data {record.data_sha256[:12]} vs {data_sha256[:12]} now: the corpus's content or its "
                "tokenizer differs")
    differences = [f"{k} {record.protocol.get(k)} vs {protocol.get(k)} now" for k in sorted(set(protocol)
                   | set(record.protocol)) if record.protocol.get(k) != protocol.get(k)]
    if differences:
        return ", ".join(differences)
    expected = config_sha256.get(record.method)
    if expected is None:
        return f"method {record.method!r} has no config in configs/compare"
    if record.config_sha256 != expected:
        return f"configs/compare/{record.method}.json has changed since"
    return None
