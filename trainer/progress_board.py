"""Every rank's progress on the job's store, so that the rank whose hang watchdog fires can name the
rank that stopped, not only itself (the one that waits), and can tell every other rank to stop.

Each rank's watchdog thread writes, every poll, one record: the step and phase the training thread
last reached, when it got there, and a heartbeat (a stopped process, SIGSTOP or a frozen host, stops
beating; a rank waiting in a collective keeps beating). The board talks to the job's rendezvous store
(MASTER_ADDR:MASTER_PORT, where the deepspeed and torchrun launchers host it) through its own client
with a short timeout, so a store that does not answer (its host is the one stopped) costs seconds, not
the hang line. Times are wall clock: across hosts they are as good as the clocks' agreement.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

STORE_TIMEOUT = timedelta(seconds=5)
KEY_PREFIX = "muloco-progress/"
ALARM_KEY = "alarm"
WAITING = "waiting in "  # how trainer.watchdog.describe_wait begins when a rank waits in a collective


@dataclass(frozen=True)
class Progress:
    rank: int
    description: str
    step: int | None  # the last step finished; None before the first
    phase: str  # "start-up", "resume", "training"
    advanced_at: float  # when the step or phase last changed (time.time())
    beat_at: float  # the watchdog thread's last write
    host: str
    pid: int
    parent_pid: int  # the launcher that started it
    doing: str = ""  # where its training thread was at the last beat (trainer.watchdog.describe_wait)

    @property
    def waiting(self) -> bool:
        """Waiting in a collective (for other ranks), rather than busy on its own."""
        return self.doing.startswith(WAITING)

    def where(self) -> str:
        return f"{self.phase} after step {self.step}" if self.step is not None else self.phase


class ProgressBoard:
    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def of_launched_job(cls) -> ProgressBoard | None:
        """The board on the launcher's store; None outside a launcher (a world of one in a test)."""
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ or not dist.is_initialized():
            return None
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=STORE_TIMEOUT, wait_for_workers=False)
        return cls(dist.PrefixStore(KEY_PREFIX, client), dist.get_rank(), dist.get_world_size())

    def publish(self, description: str, step: int | None, phase: str, advanced_at: float, doing: str = "") -> None:
        record = Progress(self.rank, description, step, phase, advanced_at, time.time(), socket.gethostname(),
                          os.getpid(), os.getppid(), doing)
        self.store.set(f"rank/{self.rank}", json.dumps(asdict(record)))

    def read(self) -> list[Progress]:
        """The records of the ranks that have written one (unreadable ones are skipped: a hang line
        must not fail on a peer's half-written record)."""
        keys = [f"rank/{r}" for r in range(self.world_size)]
        records = []
        for key in keys:
            if self.store.check([key]):
                try:
                    records.append(Progress(**json.loads(self.store.get(key))))
                except (ValueError, TypeError):
                    pass
        return records

    def raise_alarm(self, detector: str) -> None:
        self.store.set(ALARM_KEY, detector)

    def alarm(self) -> str | None:
        """The rank that detected a hang (its description), if one has."""
        return self.store.get(ALARM_KEY).decode(errors="replace") if self.store.check([ALARM_KEY]) else None


def stopped_first(records: list[Progress], now: float, silent_after_s: float) -> Progress | None:
    """The rank that stopped advancing first: among those whose heartbeat went silent (a stopped
    process), the one silent longest; else (every rank alive, one stuck) the one furthest behind, and
    of those one that is busy outside a collective (building the data index, say) before the ones
    waiting for it."""
    if not records:
        return None
    silent = [r for r in records if now - r.beat_at > silent_after_s]
    if silent:
        return min(silent, key=lambda r: r.beat_at)
    return min(records, key=lambda r: (-1 if r.step is None else r.step, r.waiting, r.advanced_at))
