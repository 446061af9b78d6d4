"""A launched rank dies with its launcher.

When DeepSpeed's launch.py or torchrun is killed (SIGKILL, the OOM killer), nothing tells its ranks:
they would train on as orphans, holding the accelerators and writing into the run's folders while the
scheduler restarts the job. So each rank asks the kernel to SIGKILL it when its parent dies
(Linux's PR_SET_PDEATHSIG); where that does not exist a daemon thread polls the parent's pid and
ends the process within `poll_s`. (The kernel signal follows the parent *thread* that started the
rank: both launchers start ranks from their main thread.)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
ORPHAN_EXIT_CODE = 1


def _set_parent_death_signal(signum: int) -> bool:
    """Whether the kernel will send `signum` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


class ParentWatch:
    """`with ParentWatch():` the process ends when its parent does (see the module's doc)."""

    def __init__(self, poll_s: float = 1.0, use_kernel: bool = True):
        self.poll_s, self.use_kernel = poll_s, use_kernel
        self._parent = os.getppid()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ParentWatch:
        if self.use_kernel and _set_parent_death_signal(signal.SIGKILL):
            self._end_if_orphaned()  # the parent may have died before the kernel was asked
            return self
        self._thread = threading.Thread(target=self._poll, name="parent-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _poll(self) -> None:
        while not self._stopped.wait(self.poll_s):
            self._end_if_orphaned()

    def _end_if_orphaned(self) -> None:
        if os.getppid() != self._parent:
            print(f"launcher gone: the parent process {self._parent} of rank pid {os.getpid()} died; stopping",
                  file=sys.stderr, flush=True)
            os._exit(ORPHAN_EXIT_CODE)


def launched() -> bool:
    """Whether a launcher (deepspeed, torchrun) started this process as one rank of a job."""
    return all(key in os.environ for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
