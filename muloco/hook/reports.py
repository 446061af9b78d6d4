"""What a user's training loop prints when the outer loop stops it: one line per job, not a
traceback on every rank.

The hook's own errors (a bad setting, a checkpoint it refuses, workers that disagree) are exceptions a
loop may catch. Uncaught, they end each rank's process; `report_uncaught_in_one_line` makes Python print
them as one line (`muloco: <kind>: <message>`) by the first rank that reports that message, found
through torch.distributed's store (any rank whose message differs prints its own). Every other
exception keeps Python's traceback.
"""
from __future__ import annotations

import hashlib
import sys
from datetime import timedelta

import torch.distributed as dist

from muloco.core.errors import CheckpointError, ConfigError, DisagreementError

REPORTED = (ConfigError, CheckpointError, DisagreementError)
_STORE_TIMEOUT = timedelta(seconds=5)  # at exit: a rank whose store is gone prints its line itself


def _first_to_report(message: str) -> bool:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_STORE_TIMEOUT)
        return store.add("muloco/reported/" + hashlib.sha256(message.encode()).hexdigest()[:32], 1) == 1
    except Exception:  # noqa: BLE001 - no store (not initialized, or its host has exited): print
        return True


def _hook(previous):
    def report(kind, error, traceback):
        if not issubclass(kind, REPORTED):
            previous(kind, error, traceback)
            return
        what = {ConfigError: "configuration error", CheckpointError: "checkpoint error",
                DisagreementError: "workers disagree"}
        label = next(label for cls, label in what.items() if issubclass(kind, cls))
        line = f"muloco: {label}: {error}"
        if _first_to_report(line):
            print(line, file=sys.stderr, flush=True)
    report.muloco = True
    return report


def report_uncaught_in_one_line() -> None:
    """Install the report (once per process; Python's own hook stays for every other exception)."""
    if not getattr(sys.excepthook, "muloco", False):
        sys.excepthook = _hook(sys.excepthook)
