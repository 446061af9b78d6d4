"""Run logging on the logging rank: metrics.jsonl (one JSON object per record), TensorBoard scalars
and a progress line.

A run that goes on from a checkpoint redoes the steps its predecessor logged after that checkpoint,
so `start(step)` first drops the records (and TensorBoard events) of later steps: metrics.jsonl then
holds each step once. It is rewritten atomically, so a crash during the rewrite keeps the old file."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from muloco.core.durable import write_text_durably

METRICS_FILE = "metrics.jsonl"


def records_up_to(text: str, step: int) -> tuple[list[str], int]:
    """The lines of a metrics.jsonl whose record is of `step` or before, and how many were dropped
    (later steps, and lines that are not a record: the torn last line of a killed run)."""
    kept, dropped = [], 0
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
        elif line.strip():
            dropped += 1
    return kept, dropped


def validation_losses(path: Path) -> dict[int, float]:
    """step -> val_loss of the records of a metrics.jsonl (none when there is no file yet)."""
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in records_up_to(path.read_text(errors="replace"), step=2**62)[0]]
    return {r["step"]: r["val_loss"] for r in records if isinstance(r.get("val_loss"), (int, float))}


def tensorboard_tag(prefix: str, key: str) -> str:
    """A record field's TensorBoard tag: validation fields under valid/, the others under `prefix`."""
    return f"valid/{key.removeprefix('val_')}" if key.startswith("val_") else f"{prefix}/{key}"


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard_dir: str | None, total_steps: int, enabled: bool):
        self.enabled = enabled
        self.total_steps = total_steps
        self.path = Path(run_dir) / METRICS_FILE
        self.tensorboard_dir = tensorboard_dir
        self._start = time.time()
        self._file = None
        self._tb = None

    def start(self, step: int) -> None:
        """Open the logs of a run that goes on from `step` (0: from the start), dropping what an
        earlier run in the same folder logged for later steps."""
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            kept, dropped = records_up_to(self.path.read_text(errors="replace"), step)
            if dropped:
                write_text_durably(self.path, "".join(line + "\n" for line in kept))
                print(f"{self.path}: dropped {dropped} records past step {step} (an earlier run's, redone from "
                      "here)", flush=True)
        self._file = open(self.path, "a", buffering=1)
        if self.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir, purge_step=step + 1)

    def log(self, record: dict, step: int, prefix: str = "train") -> None:
        """Write one record; every numeric field also goes to TensorBoard as prefix/field, a validation
        field (val_X) as valid/X."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(tensorboard_tag(prefix, key), value, step)

    def progress(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self._start
        eta = elapsed / max(step, 1) * (self.total_steps - step)
        print(f"[{step}/{self.total_steps} {100 * step / self.total_steps:5.1f}% "
              f"elapsed {elapsed:6.0f}s eta {eta:6.0f}s] {text}", file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flush and close the files and TensorBoard's writer thread (safe to call twice)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
