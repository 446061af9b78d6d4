"""The transport of the outer exchange: `Wire` is one cross-datacenter group as seen by one rank. It
runs the raw collectives on the group's device (muloco.core.comm.group_device: the host for gloo, the
accelerator for NCCL; only packed payloads and a few statistics ever cross), seals each rank's part
with its tag under the job key (muloco/diloco/auth.py) and opens the parts it receives, counts bytes
and round trips, emulates the slow link, and turns failures into CollectiveErrors that name the
caller's context. What the bytes mean is the averaging protocol's (muloco/diloco/averaging.py).

Byte accounting (CollectiveStats, per rank, what it puts on / takes off the wire; the same for a ring
and for direct sends): an all-gather of n bytes per rank sends and receives (K-1)*n; an all-to-all
sends the blocks addressed to the other K-1 ranks and receives theirs. With a job key every part
sent adds a 32-byte tag. `largest_part` is the most bytes one op of this wire moved to or from one peer
and completed: what the link is known to move within the group's per-op timeout (the elastic catch-up
sizes its pieces by it, muloco/elastic/membership.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from muloco.core import comm
from muloco.diloco.auth import EVERY_RANK, TAG_BYTES, JobKey, Scope
from muloco.diloco.link import SlowLink


@dataclass
class CollectiveStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    link_seconds: float = 0.0  # held by the emulated slow link


class CollectiveError(RuntimeError):
    """A collective of the outer sync failed or timed out; the message names the caller's context."""



class Wire:
    """A cross-datacenter group as seen by one rank. Not thread-safe: one caller at a time.

    With a job key, `begin` names the sync the next messages belong to, and each rank's part of every
    collective is sent with its tag; the collectives return None in place of a part whose tag fails.
    Subclasses provide the two raw collectives on their kind of group (GroupWire: a torch.distributed
    group; muloco/elastic's QuorumWire: torchft's reconfigurable group)."""

    def __init__(self, rank: int, size: int, device: torch.device, link: SlowLink | None,
                 key: JobKey | None = None, channel: str = "outer", lanes: Lanes | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.link, self.lanes = link, lanes
        self.stats = CollectiveStats()
        self.largest_part = 0  # bytes: the largest part an op moved to or from one peer (not reset by take_stats)
        self.key, self.channel = key, channel
        self.begin(outer_step=0, fragment=0)

    # What each kind of group provides: its own two collectives, and one point-to-point send and
    # receive on a lane that return the started work.
    def _group_all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def _group_all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                               input_sizes: list[int]) -> None:
        raise NotImplementedError

    def _send(self, lane, tensor: torch.Tensor, peer: int):
        raise NotImplementedError

    def _receive(self, lane, tensor: torch.Tensor, peer: int):
        raise NotImplementedError

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self.lanes is None:
            self._group_all_gather_into(output, input)
        else:
            self._exchange([input] * self.size, list(output.split(input.numel())))

    def _all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                         input_sizes: list[int]) -> None:
        if self.lanes is None:
            self._group_all_to_all_into(output, input, output_sizes, input_sizes)
        else:
            self._exchange(list(input.split(input_sizes)), list(output.split(output_sizes)))

    def _exchange(self, sends: list[torch.Tensor], receives: list[torch.Tensor]) -> None:
        exchange(self.rank, self.lanes, sends, receives, self._send, self._receive)

    def take_stats(self) -> CollectiveStats:
        """The counts since the last call (one sync's)."""
        stats, self.stats = self.stats, CollectiveStats()
        return stats

    def begin(self, outer_step: int, fragment: int, epoch: int = 0) -> None:
        """The next messages belong to this sync (every rank of the group calls it alike)."""
        self._scope = Scope(self.channel, epoch, outer_step, fragment)
        self._sequence = 0

    @property
    def tag_bytes(self) -> int:
        return TAG_BYTES if self.key is not None else 0

    def _sealed(self, data: torch.Tensor, receiver: int) -> torch.Tensor:
        """`data` (uint8) followed by its tag, on the wire's device."""
        data = data.to(self.device)
        if self.key is None:
            return data
        tag = self.key.tag(self._scope, self._sequence, self.rank, receiver, data)
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(self.device)])

    def _opened(self, part: torch.Tensor, sender: int, receiver: int) -> torch.Tensor | None:
        """A received part without its tag, or None when the tag does not verify. This rank's own
        part never crossed the link (the collective copies it locally), so it is not checked."""
        if self.key is None:
            return part
        if sender == self.rank:
            return part[:-TAG_BYTES]
        data, tag = part[:-TAG_BYTES], part[-TAG_BYTES:]
        tag_bytes = tag.cpu().numpy().tobytes()
        return data if self.key.verify(tag_bytes, self._scope, self._sequence, sender, receiver, data) else None

    def _run(self, op: str, context: str, collective: Callable[[], object], sent: int, received: int,
             largest_part: int) -> None:
        try:
            collective()
        except RuntimeError as exc:
            raise CollectiveError(f"{op} failed on rank {self.rank} of {self.size} in {context}: {exc}") from exc
        self.largest_part = max(self.largest_part, largest_part)
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.round_trips += 1
        if self.link is not None:
            held = time.perf_counter()
            self.link.wait(sent)
            self.stats.link_seconds += time.perf_counter() - held

    def all_gather(self, buffer: torch.Tensor, context: str) -> list[torch.Tensor | None]:
        """All-gather equal-size 1-D uint8 buffers; returns one per rank, in rank order, on the wire's
        device (None: its tag failed)."""
        if self.size == 1:
            return [buffer.to(self.device)]
        sealed = self._sealed(buffer.reshape(-1).view(torch.uint8), EVERY_RANK)
        n = sealed.numel()
        if n == 0:
            return [sealed] * self.size
        gathered = torch.empty(self.size * n, dtype=torch.uint8, device=self.device)
        nbytes = (self.size - 1) * n
        self._run("all_gather", context, lambda: self._all_gather_into(gathered, sealed), nbytes, nbytes, n)
        parts = [self._opened(part, sender, EVERY_RANK) for sender, part in enumerate(gathered.split(n))]
        self._sequence += 1
        return parts

    def all_gather_padded(self, buffer: torch.Tensor, sizes: Sequence[int], context: str
                          ) -> list[torch.Tensor | None]:
        """All-gather byte buffers whose per-rank sizes every rank knows."""
        width = max(sizes)
        buffer = buffer[:sizes[self.rank]]  # more only where every rank refused this rank's sizes
        padded = torch.cat([buffer.to(self.device), buffer.new_zeros(width - buffer.numel(), device=self.device)])
        return [None if part is None else part[:size]
                for part, size in zip(self.all_gather(padded, context), sizes)]

    def all_gather_ints(self, values: Sequence[int], context: str) -> list[list[int] | None]:
        gathered = self.all_gather(torch.tensor(list(values), dtype=torch.int64).view(torch.uint8), context)
        return [None if part is None else part.cpu().clone().view(torch.int64).tolist() for part in gathered]

    def all_gather_floats(self, values: Sequence[float], context: str) -> list[list[float] | None]:
        """Every rank's float64 values (a few statistics), in rank order."""
        gathered = self.all_gather(torch.tensor(list(values), dtype=torch.float64).view(torch.uint8), context)
        return [None if part is None else part.cpu().clone().view(torch.float64).tolist() for part in gathered]

    def all_to_all(self, blocks: Sequence[torch.Tensor], receive_sizes: Sequence[int], context: str
                   ) -> list[torch.Tensor | None]:
        """Send blocks[j] (uint8) to rank j; returns the block from each rank, in rank order (None:
        its tag failed). `receive_sizes` are the blocks' sizes without tags."""
        if self.size == 1:
            return [blocks[0].to(self.device)]
        sealed = [self._sealed(block, receiver) for receiver, block in enumerate(blocks)]
        send_sizes = [block.numel() for block in sealed]
        receive_sizes = [size + self.tag_bytes for size in receive_sizes]
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=self.device)
        send = torch.cat(sealed)
        sent = sum(send_sizes) - send_sizes[self.rank]
        taken = sum(receive_sizes) - receive_sizes[self.rank]
        largest = max(size for peer, sizes in enumerate(zip(send_sizes, receive_sizes)) if peer != self.rank
                      for size in sizes)
        self._run("all_to_all", context, lambda: self._all_to_all_into(received, send, list(receive_sizes), send_sizes),
                  sent, taken, largest)
        parts = [self._opened(part, sender, self.rank)
                 for sender, part in enumerate(received.split(list(receive_sizes)))]
        self._sequence += 1
        return parts

    def sum_per_worker(self, values: Sequence[float], workers: int, context: str) -> list[list[float]]:
        """Each worker's sums of `values` over its ranks (result[k][i]), for a group that spans every
        rank with the worker index slowest: every rank's values gathered, summed in rank order. A
        rank whose tag fails counts as zeros (these are statistics, not weights)."""
        rows = self.all_gather_floats(values, context)
        per_worker = self.size // workers
        sums = [[0.0] * len(values) for _ in range(workers)]
        for rank, row in enumerate(rows):
            if row is not None:
                sums[rank // per_worker] = [a + b for a, b in zip(sums[rank // per_worker], row)]
        return sums


@dataclass(frozen=True)
class Lanes:
    """Two more groups of the same ranks, one per direction: a message from a lower to a higher rank
    travels on `up`, the others on `down`. gloo runs both directions between two ranks on one connection
    whose sends and receives take turns: its all-gather of two ranks, and its all-to-all of any number,
    move a payload at about 0.5-0.6 of a link's rate (benchmarks/link_share.py on rate-limited links),
    where one connection per direction reaches 0.8-0.94. From three ranks on, gloo's ring all-gather
    sends and receives on two connections and the two forms are even (0.85-0.93 each at 50-200 Mbit/s,
    the ring ahead at 50, the lanes at 1000; results/link_share.md): one form for every case."""
    up: object
    down: object

    def toward(self, sender: int, receiver: int):
        return self.up if sender < receiver else self.down


def exchange(rank: int, lanes: Lanes, sends: list[torch.Tensor], receives: list[torch.Tensor],
             send: Callable[[object, torch.Tensor, int], object], receive: Callable[[object, torch.Tensor, int], object]
             ) -> None:
    """Send sends[j] to rank j and receive receives[j] from it, each direction on its lane, in K-1 steps:
    at step s, to rank + s and from rank - s (mod K), so that each rank's link carries one stream out and
    one in at a time, as gloo's ring does (several at once share the link's queue and lose more packets).
    `send(lane, tensor, peer)` and `receive(...)` start one and return its work. Both ends know each
    message's size, so an empty one is skipped on both."""
    receives[rank].copy_(sends[rank])
    size = len(sends)
    for step in range(1, size):
        to, source = (rank + step) % size, (rank - step) % size
        works = []
        if sends[to].numel():
            works.append(send(lanes.toward(rank, to), sends[to], to))
        if receives[source].numel():
            works.append(receive(lanes.toward(source, rank), receives[source], source))
        for work in works:
            work.wait()


class GroupWire(Wire):
    """A Wire over a torch.distributed process group (None: the default group); with `lanes` (gloo),
    its payloads go point to point on them (`exchange`)."""

    def __init__(self, group, link: SlowLink | None, key: JobKey | None = None, channel: str = "outer",
                 lanes: Lanes | None = None):
        super().__init__(dist.get_rank(group), dist.get_world_size(group), comm.group_device(group), link, key, channel,
                         lanes)
        self.group = group

    def _group_all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_gather_into_tensor(output, input, group=self.group)

    def _group_all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                               input_sizes: list[int]) -> None:
        dist.all_to_all_single(output, input, output_sizes, input_sizes, group=self.group)

    def _send(self, lane, tensor: torch.Tensor, peer: int):
        return dist.isend(tensor, group=lane, group_dst=peer)

    def _receive(self, lane, tensor: torch.Tensor, peer: int):
        return dist.irecv(tensor, group=lane, group_src=peer)
