"""Intra-op threads per rank. Every rank on a host shares that host's cores, so with OMP_NUM_THREADS
unset each rank takes its share: the cores it may run on (its CPU affinity) divided by the ranks on its
host, at least 1 (torchrun sets 1 per rank for the same reason; DeepSpeed's launcher sets nothing). A
value the user set wins. Without this, N ranks each start one thread per core and oversubscribe the
cores N times: the same run on CPU is several times slower."""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

# The launchers' names for the number of ranks on this host: torchrun's, then DeepSpeed's launcher's.
RANKS_ON_HOST_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int | None  # None: the user's OMP_NUM_THREADS stands, nothing is changed
    line: str


def ranks_on_host(environ: Mapping[str, str]) -> int:
    for name in RANKS_ON_HOST_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def available_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose_threads(environ: Mapping[str, str], cores: int, current_threads: int) -> ThreadChoice:
    """The intra-op threads of one rank and the line that says why; `current_threads` is what torch
    uses now (the user's OMP_NUM_THREADS, where set)."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(None, f"threads: {current_threads} intra-op threads per rank "
                                  f"(OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}, as set)")
    ranks = ranks_on_host(environ)
    threads = max(1, cores // ranks)
    return ThreadChoice(threads, f"threads: {threads} intra-op threads per rank ({cores} cores available / "
                                 f"{ranks} ranks on this host; set OMP_NUM_THREADS to choose)")


def apply_thread_default(environ: MutableMapping[str, str] = os.environ) -> ThreadChoice:
    """Set this rank's intra-op threads by `choose_threads` (also in OMP_NUM_THREADS, so processes it
    starts inherit the share) and return the choice."""
    import torch

    choice = choose_threads(environ, available_cores(), torch.get_num_threads())
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
        environ["OMP_NUM_THREADS"] = str(choice.threads)
    return choice
