"""Asynchronous saves (--async-save, Megatron's flag): training goes on while the rank files are written.

At the save step each rank copies its state to host memory (pinned when it lives on an accelerator,
so the copies are DMA and can overlap) and hands the copy to a background thread, which writes the
rank file exactly as a synchronous save does (temporary name, SHA-256 on the way, fsync, rename). Only
the copy stalls training; the file's bytes are the synchronous save's.

`latest` needs every rank's file. The ranks agree without blocking: after each step while a save is
in flight, every rank adds whether its own writer is still running to a one-number all-reduce over
the world (the step hooks run in the same order on every rank, so the collective matches). When the
sum is zero, every file is durable and the save is finished as a synchronous one is: the ranks
exchange their SHA-256s (or errors), rank 0 writes meta.json, `complete` and `latest`. So a save is
published at the first step boundary after the slowest rank's file is durable, and a crash before
that (kill -9 of any rank mid-write) leaves the previous checkpoint as `latest`.

At most one save is in flight: a save that comes due while the previous one is still being written
waits for it (and publishes it) first. The run's end waits for the last one, also on a clean stop
(preemption, --exit-interval); a run that ends in an error joins its writer thread but publishes
nothing, since the other ranks may not reach the agreement's collectives.

The host copy costs host memory for one more copy of the rank's state while the save is in flight.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class BackgroundWrite:
    """`write()` (returning the file's SHA-256) run by a thread started at construction."""

    def __init__(self, write: Callable[[], str], name: str):
        self._write: Callable[[], str] | None = write
        self._digest, self._error, self._failure = "", None, None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._digest = self._write()
        except OSError as err:  # a full or read-only disk: every rank fails together (Checkpointer._finish)
            self._error = err
        except BaseException as err:  # noqa: BLE001 - a bug, raised again on the training thread
            self._failure = err
        finally:
            self._write = None  # the host copy of the state is freed as soon as it is written

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def result(self) -> tuple[str, OSError | None]:
        """Wait for the write: (SHA-256, None), or ("", the OSError); anything else it raised is raised here."""
        self.join()
        if self._failure is not None:
            raise self._failure
        return self._digest, self._error


@dataclass
class SaveInFlight:
    """A save whose rank file is being written in the background, and what publishing it needs."""
    step: int
    directory: Path
    one_model: bool  # whether the captured weights were the outer loop's global weights
    started: float  # time.perf_counter() when the save began
    write: BackgroundWrite
