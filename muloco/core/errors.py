"""The errors a run reports as one line: bad settings and impossible sizes (before any collective),
checkpoints or received states that cannot be read, and workers that disagree."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting."""


class TopologyError(ConfigError):
    """An impossible combination of parallel sizes; raised before any collective is entered."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, malformed or does not fit this run; the message says which."""


class DisagreementError(RuntimeError):
    """Workers that must agree do not (their start, their step, their global weights): the run stops
    before they train on apart; the message names the workers."""
