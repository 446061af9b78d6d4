"""Run logging on the logging rank: metrics.jsonl (one JSON object per record), TensorBoard scalars
and a progress line."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard_dir: str | None, total_steps: int, enabled: bool):
        self.enabled = enabled
        self.total_steps = total_steps
        self._start = time.time()
        self._file = None
        self._tb = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)

    def log(self, record: dict, step: int, prefix: str = "train") -> None:
        """Write one record; every numeric field also goes to TensorBoard as prefix/field."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)

    def progress(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self._start
        eta = elapsed / max(step, 1) * (self.total_steps - step)
        print(f"[{step}/{self.total_steps} {100 * step / self.total_steps:5.1f}% "
              f"elapsed {elapsed:6.0f}s eta {eta:6.0f}s] {text}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
