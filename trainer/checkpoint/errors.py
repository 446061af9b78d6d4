"""The one error of reading or writing a checkpoint: its message names the file and the field."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, malformed or does not fit this run; the message says which."""
