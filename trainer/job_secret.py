"""The job secret as every process of a job reads it: hex digits, long enough (trainer.diloco.auth), and
private to its owner. A secret others on the machine can read is no secret: anyone who copies it can join
the quorum and send weights, so the run and the lighthouse refuse it rather than warn."""
from __future__ import annotations

import stat
from pathlib import Path

from trainer.diloco.auth import JobKey, key_file_is_private, read_job_key
from trainer.errors import ConfigError


def read_private_job_key(path: Path, job_id: str) -> JobKey:
    """The secret in `path`; one ConfigError line for a bad one, or one that group or others may access."""
    key = read_job_key(path, job_id)
    if not key_file_is_private(path):
        mode = stat.S_IMODE(path.stat().st_mode)
        raise ConfigError(f"the job secret {path} has mode {mode:04o}, so other users may read it: chmod 600 {path}")
    return key
