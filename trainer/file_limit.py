"""The process's budget of open files (`ulimit -n`) for reading data: raised to the hard limit at start,
and a limit too low for even the fewest data files read at once refused in one line before anything is
built (trainer/open_files.py keeps the maps it holds within `data_file_capacity`)."""
from __future__ import annotations

import resource
from pathlib import Path

from muloco.core.errors import ConfigError

RESERVED_FILES = 128  # descriptors left to the rest of a rank: process groups' sockets, logs, checkpoints, pipes
MIN_OPEN_DATA_FILES = 8  # at least a prefix's .idx and .bin and a split's three sample indices at once
MAX_OPEN_DATA_FILES = 16384  # a quarter of Linux's default vm.max_map_count: the libraries keep maps too
_NR_OPEN = Path("/proc/sys/fs/nr_open")  # the most any limit may be raised to, when the hard one is unlimited


def _limit(value: int) -> int:
    return 1 << 62 if value == resource.RLIM_INFINITY else value


def raise_open_file_limit() -> str | None:
    """Raise the soft limit on open files to the hard one; the line saying so, None when there is none to say."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = int(_NR_OPEN.read_text()) if hard == resource.RLIM_INFINITY and _NR_OPEN.exists() else hard
    if _limit(soft) >= _limit(target):
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as error:
        return f"open files: the soft limit (ulimit -n) stays {soft}: raising it to {target} failed ({error})"
    return f"open files: raised the soft limit (ulimit -n) from {soft} to the hard limit {target}"


def data_file_capacity(limit: int) -> int:
    """How many data files a rank keeps mapped under a descriptor limit of `limit`."""
    return min(MAX_OPEN_DATA_FILES, (_limit(limit) - RESERVED_FILES) // 2)


def check_open_file_limit(prefixes: int) -> None:
    """A ConfigError, before anything is built, where the descriptor limit leaves too few for reading data."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if data_file_capacity(soft) < MIN_OPEN_DATA_FILES:
        needed = RESERVED_FILES + 2 * MIN_OPEN_DATA_FILES
        raise ConfigError(f"a blend of {prefixes} prefixes needs ~{needed} open files per rank; ulimit -n is {soft} "
                          f"(hard limit {hard if hard != resource.RLIM_INFINITY else 'unlimited'}): raise the hard "
                          "limit (ulimit -Hn, /etc/security/limits.conf, or the scheduler's setting)")
