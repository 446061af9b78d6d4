"""The processes a device run starts: each in a process group of its own (killed whole at its stage's timeout) that
dies with the run however the run dies, launched as the deepspeed launcher would on one node."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from device_runner import REPO, StageFailed


_PR_SET_PDEATHSIG = 1


def _child_setup(parent: int) -> None:
    """Runs in the child before exec: a process group of its own (killed whole on a timeout), and
    SIGKILL when the check dies, however it dies (a SIGKILL from outside included)."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the check died before the line above
        os._exit(1)


def run_processes(commands: list[tuple[list[str], dict]], log: Path, timeout_s: float) -> list[int | None]:
    """Start every (argv, env) at once, wait up to `timeout_s` for all; return their exit codes (None
    for one killed at the timeout). Whatever ends the wait (a timeout, CheckKilled), none survives."""
    procs, killed = [], set()
    with open(log, "w") as out:
        try:
            for argv, env in commands:
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                              preexec_fn=lambda parent=os.getpid(): _child_setup(parent)))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in procs:
                if proc.poll() is None:
                    killed.add(proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return [None if p.pid in killed else p.returncode for p in procs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environments(ranks: int, threads: int | None) -> list[dict]:
    """What the deepspeed launcher sets for `ranks` processes on one node."""
    port = str(free_port())
    envs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        envs.append(env)
    return envs


def launch(argv: list[str], ranks: int, log: Path, timeout_s: float, threads: int | None = None) -> None:
    """`argv` (after the interpreter) in `ranks` processes; StageFailed with the log's end unless all exit 0."""
    codes = run_processes([([sys.executable, *argv], env) for env in rank_environments(ranks, threads)],
                          log, timeout_s)
    if any(code != 0 for code in codes):
        raise StageFailed(f"{argv[0]} exited with {codes} (None: killed at the stage's timeout of "
                          f"{timeout_s:.0f} s); its output ends:\n" + log.read_text()[-6000:])
