"""A fake outer link for in-process tests: K ranks as K threads of this process, meeting on a shared
board, so the outer exchange (muloco/diloco/averaging.py over a Wire) runs with its real code and no launch.

`run_ranks(K, fn)` runs fn(rank) in K threads and returns their results in rank order (re-raising
the first failure). A FakeWire's `tamper(op, sequence, data) -> data` sees every buffer its rank puts
on the link and may replace it: the attacker's seat. A board can also record what crossed it, so a
test can replay an earlier sync's messages."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from muloco.diloco.auth import JobKey
from muloco.diloco.link import SlowLink
from muloco.diloco.wire import Wire

TIMEOUT_S = 30


class Board:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list = [None] * size

    def exchange(self, rank: int, item) -> list:
        """Every rank's item, once all ranks have put theirs."""
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return items


class FakeWire(Wire):
    def __init__(self, board: Board, rank: int, key: JobKey | None = None, channel: str = "outer",
                 tamper: Callable[[str, int, torch.Tensor], torch.Tensor] | None = None):
        super().__init__(rank, board.size, torch.device("cpu"), link=None, key=key, channel=channel)
        self.board, self.tamper = board, tamper

    def _put(self, op: str, data: torch.Tensor) -> torch.Tensor:
        data = data.clone()
        return self.tamper(op, self._sequence, data) if self.tamper is not None else data

    def _group_all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        parts = self.board.exchange(self.rank, self._put("all_gather", input))
        if any(part.numel() != input.numel() for part in parts):
            raise RuntimeError(f"all_gather: ranks sent buffers of different sizes {[p.numel() for p in parts]}")
        self._crossed(input.numel())
        parts[self.rank] = input  # as in gloo: a rank's own part is copied locally, never over the link
        output.copy_(torch.cat(parts))

    def _group_all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                               input_sizes: list[int]) -> None:
        blocks = list(self._put("all_to_all", input).split(input_sizes))
        everyone = self.board.exchange(self.rank, blocks)
        self._crossed(max(block.numel() for src, row in enumerate(everyone)
                          for dst, block in enumerate(row) if dst != src))
        received = [everyone[src][self.rank] for src in range(self.size)]
        received[self.rank] = input.split(input_sizes)[self.rank]  # its own block stays local
        if [block.numel() for block in received] != list(output_sizes):
            raise RuntimeError("all_to_all: a block of an unexpected size")
        output.copy_(torch.cat(received))

    def _crossed(self, largest: int) -> None:
        """The op's largest part from one rank to another (every rank sees the same): a link's limit goes here."""


class RateLimitedWire(FakeWire):
    """A FakeWire on links of `link`'s rate whose every op times out after `timeout_s`, as gloo's do (torchft's
    group is made with muloco.sync_timeout_s): an op whose largest part takes longer than that at the link's
    rate fails on every member (on a real group the members it does not involve fail at their next op,
    waiting for those it does). No time passes: the rate decides, not a sleep."""

    def __init__(self, board: Board, rank: int, key: JobKey | None = None, channel: str = "outer", *,
                 link: SlowLink, timeout_s: float):
        super().__init__(board, rank, key, channel)
        self.rate_limit, self.timeout_s = link, timeout_s

    def _crossed(self, largest: int) -> None:
        if self.rate_limit.delay(largest) > self.timeout_s:
            raise RuntimeError(f"timed out after {self.timeout_s:g} s: a part of {largest} bytes takes "
                               f"{self.rate_limit.delay(largest):.3g} s at the link's rate")


def run_ranks(size: int, fn: Callable[[int], object]) -> list:
    with ThreadPoolExecutor(max_workers=size) as pool:
        futures = [pool.submit(fn, rank) for rank in range(size)]
        return [future.result(timeout=TIMEOUT_S * 4) for future in futures]


class FakeStatic:
    """The single-world membership on fake wires: the K ranks of `boards` (outer, metrics)."""
    ballot_group = None
    records_checksum = False
    replays_pending = True

    def __init__(self, boards: tuple[Board, Board], rank: int, key: JobKey | None, max_norm_ratio: float = 10.0):
        from muloco.diloco.membership import _StaticSession
        outer, metrics = boards
        self.key = key
        self.session = _StaticSession(FakeWire(outer, rank, key), FakeWire(metrics, rank, key, "metrics"),
                                      outer.size, max_norm_ratio)

    def join(self, loop) -> None:
        pass

    def leave(self) -> None:
        pass

    def prepare(self, background, step: int) -> None:
        pass

    def run(self, task, sync):
        return sync(self.session)


class FakeQuorum:
    """muloco/elastic/quorum.py's QuorumGroup with the quorum fixed to the board's ranks: each attempt
    a fresh epoch, torchft's commit counting and its count of members at the highest committed syncs."""

    def __init__(self, board: Board, rank: int, key: JobKey | None, committed: int = 0, wire=None):
        self.board, self.rank, self.key, self.committed_syncs = board, rank, key, committed
        self.wire_class = wire or FakeWire
        self.epoch, self._errored, self._at_top = 0, None, board.size

    def start(self) -> None:
        seen = self.board.exchange(self.rank, (self.committed_syncs, self.epoch))
        counts = [committed for committed, _ in seen]
        # torchft's quorum ids are the lighthouse's, the same for every member of a quorum
        self._at_top, self.epoch, self._errored = counts.count(max(counts)), max(e for _, e in seen) + 1, None

    def everyone_current(self, size: int) -> bool:
        return self._at_top >= size

    def wire(self, link) -> FakeWire:
        return self.wire_class(self.board, self.rank, self.key, channel="quorum")

    def set_committed_syncs(self, committed: int) -> None:
        self.committed_syncs = committed

    def report_error(self, exc: Exception) -> None:
        self._errored = exc

    def commit(self) -> bool:
        if self._errored is None:
            self.committed_syncs += 1
        return self._errored is None

    def shutdown(self) -> None:
        pass
