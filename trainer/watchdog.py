"""Hang detection: a rank that makes no progress for --hang-timeout-s says where it waits and exits.

A frozen peer (stopped, wedged in a driver, lost to the network) leaves the other ranks blocked in a
collective that may never time out (a gloo or NCCL timeout fires only where that backend checks, and
a process stopped with SIGSTOP keeps its sockets open). So each rank runs a watchdog thread that the
training loop pets after every step (a step hook). When no pet arrives for the timeout, the thread
looks at the training thread's stack, prints one line

    hang detected: rank 1 (worker 0, data 1, pipeline 0, tensor 0) made no progress for 60 s after
    step 12: waiting in torch.distributed all_reduce on ranks [0, 1], called from trainer/training.py:83

and ends the process with HANG_EXIT_CODE, so the launcher stops the job and the scheduler can restart
it from the last checkpoint. Blocked collectives release the GIL, so the thread can run; as a
backstop for a hang that holds the GIL, Python's faulthandler dumps every thread's stack and exits a
little later.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

HANG_EXIT_CODE = 3
BACKSTOP_GRACE_S = 30.0  # faulthandler fires this long after the watchdog should have
REPO_ROOT = Path(__file__).resolve().parents[1]
COLLECTIVE_MODULES = (os.path.join("torch", "distributed"), os.path.join("deepspeed", "comm"),
                      str(REPO_ROOT / "trainer" / "comm.py"))


def _is_collective_frame(frame: FrameType) -> bool:
    return any(part in frame.f_code.co_filename for part in COLLECTIVE_MODULES)


def _describe_group(frames: list[FrameType]) -> str:
    """The ranks of the process group the collective runs on (from the innermost frame that names one)."""
    named = [f.f_locals["group"] for f in frames if "group" in f.f_locals]
    if not named:
        return ""
    group = named[0]
    try:
        import torch.distributed as dist

        return f" on ranks {dist.get_process_group_ranks(group) if group is not None else 'of the world'}"
    except Exception:  # noqa: BLE001 - the group may be gone; the rest of the line still helps
        return ""


def _where(frame: FrameType) -> str:
    path = Path(frame.f_code.co_filename)
    if path.is_relative_to(REPO_ROOT):
        path = path.relative_to(REPO_ROOT)
    elif "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1:])
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def _is_wrapper(frame: FrameType) -> bool:
    return frame.f_code.co_name.startswith("_") or "wrapper" in frame.f_code.co_name


def describe_wait(frame: FrameType | None) -> str:
    """Where a thread with innermost frame `frame` is: the collective it waits in (the torch.distributed
    function, past logging decorators), its group, and the first caller outside the communication layers."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    if not stack:
        return "not running"
    torch_frames = [i for i, f in enumerate(stack) if "torch" + os.sep + "distributed" in f.f_code.co_filename]
    if not torch_frames:
        return f"in {_where(stack[0])}"
    named = [i for i in torch_frames if not _is_wrapper(stack[i])]
    api = stack[named[0] if named else torch_frames[0]]
    outer = torch_frames[0]
    while outer + 1 < len(stack) and _is_collective_frame(stack[outer + 1]):
        outer += 1  # past trainer.comm, deepspeed.comm and torch's own wrappers
    caller = stack[outer + 1] if outer + 1 < len(stack) else stack[outer]
    return f"waiting in {api.f_code.co_name}{_describe_group(stack[torch_frames[0]:outer + 1])}, called from {_where(caller)}"


class Watchdog:
    def __init__(self, timeout_s: float, rank_description: str, poll_s: float | None = None):
        self.timeout_s, self.rank_description = timeout_s, rank_description
        self.poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 10)
        self._last_pet, self._step = time.monotonic(), None
        self._stopped = threading.Event()
        self._watched: int | None = None
        self._thread: threading.Thread | None = None

    def pet(self, step: int | None = None) -> None:
        self._last_pet, self._step = time.monotonic(), step
        faulthandler.dump_traceback_later(self.timeout_s + BACKSTOP_GRACE_S, exit=True)

    def after_step(self, step: int) -> None:  # a trainer step hook
        self.pet(step)

    def start(self) -> None:
        """Watch the calling thread."""
        self._watched = threading.get_ident()
        self.pet(None)
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            idle = time.monotonic() - self._last_pet
            if idle > self.timeout_s:
                self._expire(idle)

    def _expire(self, idle: float) -> None:
        after = "before the first step" if self._step is None else f"after step {self._step}"
        where = describe_wait(sys._current_frames().get(self._watched))
        print(f"hang detected: {self.rank_description} made no progress for {idle:.0f} s {after}: {where}",
              file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)

    @contextmanager
    def attached_to(self, trainer) -> Iterator[Watchdog]:
        """Pet after every step of `trainer` while inside the block (a no-op with timeout 0)."""
        if not self.timeout_s:
            yield self
            return
        handle = trainer.register_step_hook(self.after_step)
        self.start()
        try:
            yield self
        finally:
            self.stop()
            handle.remove()
