"""Hang detection: a rank that makes no progress for --hang-timeout-s says where it waits and exits.

A frozen peer (stopped, wedged in a driver, lost to the network) leaves the other ranks blocked in a
collective that may never time out (a gloo or NCCL timeout fires only where that backend checks, and
a process stopped with SIGSTOP keeps its sockets open). So each rank runs a watchdog thread that the
training loop pets after every step (a step hook); start-up and resume are watched too, with their
own, longer --startup-timeout-s. Every rank's progress is on the job's store (progress_board.py).
When no pet arrives for the timeout, the thread looks at the training thread's stack and the board,
prints one line naming the rank that stopped first and where this one waits

    hang detected: rank 1 (worker 0, data 1, pipeline 0, tensor 0) stopped first (training after step
    12, silent for 58 s); rank 0 (worker 0, data 0, pipeline 0, tensor 0) made no progress for 60 s after
    step 12: waiting in all_reduce on ranks [0, 1], called from trainer/training.py:83 (_mean_over_loss_ranks)

(with every rank alive, the one still busy outside a collective is named instead, with what it
does: "rank 0 (...) is still busy (start-up for 300 s: in megatron/core/datasets/gpt_dataset.py:N
(_get_num_epochs))"), raises the alarm on the board (every other rank's watchdog then exits within a
poll), kills a stopped sibling rank of its own launcher (a stopped process cannot act on the launcher's SIGTERM), and ends
the process with HANG_EXIT_CODE, so the launcher stops the job and the scheduler can restart it from
the last checkpoint. Blocked collectives release the GIL, so the thread can run; as a backstop for a
hang that holds the GIL, Python's faulthandler dumps every thread's stack and exits a little later.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from trainer.progress_board import WAITING, Progress, ProgressBoard, stopped_first

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


def _in_project(frame: FrameType) -> bool:
    path = Path(frame.f_code.co_filename)
    return path.is_relative_to(REPO_ROOT) and "site-packages" not in path.parts


def _is_wrapper(frame: FrameType) -> bool:
    return frame.f_code.co_name.startswith("_") or "wrapper" in frame.f_code.co_name


def describe_wait(frame: FrameType | None, with_group: bool = True) -> str:
    """Where a thread with innermost frame `frame` is: the collective it waits in (the torch.distributed
    function, past logging decorators), its group (`with_group`: read from the frames' locals, so only
    once, in the hang line, not at every poll), and the first caller in the project outside the
    communication layers."""
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
        outer += 1  # past muloco.core.comm, deepspeed.comm and torch's own wrappers
    callers = stack[outer + 1:]
    # The project's own frame: decorators of other packages (typing_extensions' wrapper) say nothing.
    caller = next((f for f in callers if _in_project(f)), callers[0] if callers else stack[outer])
    group = _describe_group(stack[torch_frames[0]:outer + 1]) if with_group else ""
    return f"{WAITING}{api.f_code.co_name}{group}, called from {_where(caller)}"


class Watchdog:
    """Watches the thread that calls `start`; `enter` names each phase (start-up, resume, training)
    with its own timeout. With a `board` every rank's progress is published, the line names the rank
    that stopped first, and every rank exits within a poll of the first detection."""

    def __init__(self, timeout_s: float, rank_description: str, poll_s: float | None = None,
                 board: ProgressBoard | None = None):
        self.timeout_s, self.rank_description, self.board = timeout_s, rank_description, board
        self.enabled = timeout_s > 0  # --hang-timeout-s 0: no watchdog at all, in any phase
        self.poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 10)
        self._last_pet, self._advanced_at, self._step, self._phase = time.monotonic(), time.time(), None, "training"
        self._stopped = threading.Event()
        self._advanced = threading.Event()  # wakes the thread to publish a step as soon as it is done
        self._watched: int | None = None
        self._thread: threading.Thread | None = None

    def pet(self, step: int | None = None) -> None:
        self._last_pet, self._advanced_at, self._step = time.monotonic(), time.time(), step
        if self.enabled:
            faulthandler.dump_traceback_later(self.timeout_s + BACKSTOP_GRACE_S, exit=True)
            self._advanced.set()

    def enter(self, phase: str, timeout_s: float) -> None:
        """From now on the watched thread is in `phase`, allowed `timeout_s` without progress."""
        self._phase, self.timeout_s = phase, timeout_s
        self.pet(self._step)

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
        self._advanced.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while True:
            self._advanced.wait(self.poll_s)
            self._advanced.clear()
            if self._stopped.is_set():
                return
            self._share()
            idle = time.monotonic() - self._last_pet
            if idle > self.timeout_s:
                self._expire(idle)

    def _share(self) -> None:
        """Publish this rank's progress; stop at once when another rank has detected a hang."""
        if self.board is None:
            return
        try:
            self.board.publish(self.rank_description, self._step, self._phase, self._advanced_at,
                               describe_wait(sys._current_frames().get(self._watched), with_group=False))
            alarm = self.board.alarm()
        except RuntimeError:  # the store did not answer in time: this rank's own watch goes on
            return
        if alarm is not None:
            print(f"stopping: {alarm} detected a hang (see its line); every rank exits", file=sys.stderr, flush=True)
            os._exit(HANG_EXIT_CODE)

    def hang_line(self, idle: float, culprit: Progress | None) -> str:
        """The line naming this rank, where it waits, and first the rank it waits for (`culprit`): one
        that stopped (silent), or one still busy on its own (what it is doing)."""
        after = "before the first step" if self._step is None else f"after step {self._step}"
        during = f" during {self._phase}" if self._phase != "training" else ""
        where = describe_wait(sys._current_frames().get(self._watched))
        line = f"{self.rank_description} made no progress for {idle:.0f} s{during} {after}: {where}"
        if culprit is None:
            return f"hang detected: {line}"
        now = time.time()
        if now - culprit.beat_at > self._silent_after_s or not culprit.doing or culprit.waiting:
            return (f"hang detected: {culprit.description} stopped first ({culprit.where()}, silent for "
                    f"{now - culprit.beat_at:.0f} s); {line}")
        return (f"hang detected: {culprit.description} is still busy ({culprit.where()} for "
                f"{now - culprit.advanced_at:.0f} s: {culprit.doing}); {line}")

    @property
    def _silent_after_s(self) -> float:
        return 3 * self.poll_s + 1

    def _expire(self, idle: float) -> None:
        culprit = self._stopped_first()
        print(self.hang_line(idle, culprit), file=sys.stderr, flush=True)
        if self.board is not None:
            try:
                self.board.raise_alarm(self.rank_description)
            except RuntimeError:
                pass
            if culprit is not None:
                _end_stopped_sibling(culprit)
        os._exit(HANG_EXIT_CODE)

    def _stopped_first(self) -> Progress | None:
        """Another rank that stopped advancing before this one (None: none known, or this one)."""
        if self.board is None:
            return None
        try:
            records = self.board.read()
        except RuntimeError:
            return None
        culprit = stopped_first(records, time.time(), silent_after_s=self._silent_after_s)
        return culprit if culprit is not None and culprit.rank != self.board.rank else None

    @contextmanager
    def attached_to(self, trainer) -> Iterator[Watchdog]:
        """Pet after every step of `trainer` while inside the block."""
        if not self.enabled:
            yield self
            return
        handle = trainer.register_step_hook(self.after_step)
        try:
            yield self
        finally:
            handle.remove()

    @contextmanager
    def watching(self, phase: str, timeout_s: float) -> Iterator[Watchdog]:
        """Watch the calling thread inside the block, starting in `phase` (a no-op with timeout 0)."""
        if not self.enabled:
            yield self
            return
        self.start()
        self.enter(phase, timeout_s)
        try:
            yield self
        finally:
            self.stop()


def _end_stopped_sibling(culprit: Progress) -> None:
    """SIGKILL a stopped rank that this rank's own launcher started on this host: a stopped process
    cannot act on the launcher's SIGTERM, which would wait out its grace period (30 s) before killing
    it. A rank elsewhere is left to its own launcher."""
    if culprit.host != socket.gethostname() or culprit.parent_pid != os.getppid() or culprit.pid == os.getpid():
        return
    try:
        if int(Path(f"/proc/{culprit.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getppid():
            return  # not (or no longer) a child of the same launcher
        os.kill(culprit.pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        pass
