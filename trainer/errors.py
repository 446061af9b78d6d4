"""The errors a run reports as one line before any collective: bad settings and impossible sizes."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting."""


class TopologyError(ConfigError):
    """An impossible combination of parallel sizes; raised before any collective is entered."""
