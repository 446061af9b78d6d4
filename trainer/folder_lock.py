"""The run's folders belong to one live job at a time.

Two jobs writing one checkpoint folder destroy each other's saves (one removes the other's temporary
files as leftovers), and an orphan of a killed job or a second submission is easy to get. So rank 0
holds a lock on the run directory and on the checkpoint folder for the job's whole life: an
exclusive flock(2) on FOLDER/.muloco.lock, which the kernel releases however the process ends (a
kill -9 included), and which says who holds it (host, pid, start time). A second job stops at
start-up naming the holder; a lock file left by a job that is gone is taken over with a line
saying so. On a shared file system the lock is as good as its flock support (NFSv4 and Lustre
mounted with -o flock honour it across hosts).
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".muloco.lock"


class FolderLock:
    def __init__(self, folder: str | Path, flag: str):
        self.folder, self.flag = Path(folder), flag
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None when taken, else the line saying who holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                return (f"{self.flag} {self.folder} is in use by another live job ({holder}): stop it, or give "
                        f"this job another folder")
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:  # its holder removed it as we opened it
                same_file = False
            if same_file:
                break
            os.close(fd)
        previous = _holder(fd)
        if previous:
            print(f"{self.flag} {self.folder}: taking over the lock of a job that is gone ({previous})", flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                      .encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return None

    def release(self) -> None:
        """Remove the lock file, then let go (a job waiting on it sees a new file next time)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _holder(fd: int) -> str:
    return os.pread(fd, 512, 0).decode(errors="replace").strip()


class JobLocks:
    """The locks of a run's folders (--run-dir and --save; one when they are the same folder)."""

    def __init__(self, folders: list[tuple[str, str | None]]):
        seen, self.locks = set(), []
        for flag, folder in folders:
            if folder and Path(folder).resolve() not in seen:
                seen.add(Path(folder).resolve())
                self.locks.append(FolderLock(folder, flag))

    def acquire(self) -> str | None:
        """All of them, or none (and the line saying which folder is in use)."""
        for i, lock in enumerate(self.locks):
            problem = lock.acquire()
            if problem is not None:
                for taken in self.locks[:i]:
                    taken.release()
                return problem
        return None

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
