"""The record of finished runs: one JSON line per run in `<out>/<corpus>/runs.jsonl` (committed), so
the protocol completes over several sittings and a rerun skips what is done.

A line is appended whole (one write of the encoded line, then fsync) only after its run finished, so
a killed sitting leaves no partial line; a line that does not parse, or that misses fields, stops the
tool with one error naming the file and line. A record is trusted only when it was made with this
invocation's protocol (steps, H, warm-up, batch, validation size, model, vocabulary), on this corpus,
with the current content of its method's config: otherwise the tool refuses to go on (use another
--out, or remove the stale lines). A later line for the same run (the alignment rerun of the first
seed) supersedes an earlier one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.compare.protocol import RunSpec


@dataclass(frozen=True)
class Alignment:
    """Cosine between the K-worker averaged pseudogradient and the one-worker full-batch pseudogradient
    at the given outer steps (and the ratio of their norms)."""
    syncs: list[int]
    cosines: list[float]
    norm_ratios: list[float]  # |averaged| / |full batch|

    @property
    def mean(self) -> float:
        return sum(self.cosines) / len(self.cosines)


@dataclass(frozen=True)
class RunRecord:
    corpus: str
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
    alignment: Alignment | None
    seconds: float
    commit: str

    @property
    def spec(self) -> RunSpec:
        return RunSpec(self.method, self.inner_lr, self.outer_lr, self.seed)

    @property
    def bytes_per_worker(self) -> float:
        return self.bytes_curve[-1][1] if self.bytes_curve else 0.0

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, obj: dict) -> RunRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(obj, dict) or set(obj) != names:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"expected the fields {sorted(names)}, got {got}")
        alignment = obj["alignment"]
        return cls(**{**obj, "alignment": Alignment(**alignment) if alignment is not None else None})


class RecordError(SystemExit):
    """A record file the tool cannot trust; the message names the file and line."""


class RecordFile:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()  # the scheduler's threads append concurrently

    def load(self, corpus: str, protocol: dict | None, config_sha256: dict[str, str]) -> dict[RunSpec, RunRecord]:
        """Every run recorded, by spec. `protocol` None: whatever the file's first line has (for a report
        from the record alone); the corpus, the protocol and each method's config must match throughout."""
        records: dict[RunSpec, RunRecord] = {}
        if not self.path.exists():
            return records
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                where = f"{self.path}:{number}"
                if not line.endswith("\n"):
                    raise RecordError(f"{where}: incomplete last line (a write was cut short); remove it")
                try:
                    record = RunRecord.from_json(json.loads(line))
                except (ValueError, TypeError) as err:
                    raise RecordError(f"{where}: not a run record ({err}); fix or remove that line") from None
                protocol = record.protocol if protocol is None else protocol
                problem = _mismatch(record, corpus, protocol, config_sha256)
                if problem:
                    raise RecordError(f"{where}: recorded with other settings ({problem}); use another --out or "
                                      "remove the stale lines")
                records[record.spec] = record
        return records

    def append(self, record: RunRecord) -> None:
        """One whole line, durable before returning."""
        data = record.to_line().encode()
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


def _mismatch(record: RunRecord, corpus: str, protocol: dict, config_sha256: dict[str, str]) -> str | None:
    if record.corpus != corpus:
        return f"corpus {record.corpus!r}, this run {corpus!r}"
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
