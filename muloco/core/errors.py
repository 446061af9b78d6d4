"""The errors a run reports as one line: bad settings and impossible sizes (before any collective),
and checkpoints or received states that cannot be read."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting."""


class TopologyError(ConfigError):
    """An impossible combination of parallel sizes; raised before any collective is entered."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, malformed or does not fit this run; the message says which."""
