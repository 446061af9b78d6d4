"""Who takes part in an outer sync: the one seam between the outer loop's sync body
(muloco/diloco/sync.py) and the groups it runs on.

A membership runs each sync as one or more attempts; each attempt is a `Session`, which gives the
sync body the wire to exchange on, the header this rank sends with its payload (it rides in the
exchange's first collective, so deciding who contributes costs no round trip of its own), how the
headers choose the senders to average, what a rejected sender means, and the per-worker sums of the
sync's statistics (gathered off the critical path).

- `StaticMembership` (here): the single-world mode. The K workers are one torch.distributed world;
  the header is the skip vote's ballot (muloco/diloco/vote.py); a non-finite or outlier worker, or a
  payload that fails its checks, skips the sync for everyone. One attempt: a failed collective is
  fatal (the job restarts from its checkpoint).
- `QuorumMembership` (muloco/elastic/membership.py): one job per datacenter on torchft. The header
  is the member's row; left-out members receive the average; a failed attempt is retried with a fresh
  quorum; a member that is behind receives the state before the exchange.
"""
from __future__ import annotations

import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Protocol

import torch

from muloco.core import comm
from muloco.diloco import vote
from muloco.diloco.auth import JobKey
from muloco.diloco.averaging import Exchanged, everyone
from muloco.diloco.payload_checks import AUTHENTICATION
from muloco.diloco.wire import GroupWire, Lanes, Wire
from muloco.diloco.config import MuLoCoConfig
from muloco.core.errors import ConfigError, DisagreementError
from muloco.core.topology import Topology, outer_ranks, worker_ranks


@dataclass
class Decision:
    """What one exchange decided, the same on every rank of its outer group."""
    contributors: list[int]  # group ranks whose payloads the average holds
    norms: list[float]  # their pseudogradient norms (worker totals), in contributor order
    skipped: str | None = None  # why nothing is applied
    record: dict = field(default_factory=dict)  # membership's fields of the sync's record


class Session(Protocol):
    wire: Wire
    leave_out: bool  # a rejected sender is left out (the others average), else the sync is skipped
    joining: bool  # this rank has no pseudogradient to contribute in this sync

    def header(self, ballot: torch.Tensor, task) -> torch.Tensor:
        """What this rank sends ahead of its payload (uint8) in the sync `task` (sync.SyncTask); `ballot`
        is its worker's (non-finite count, squared norm), summed over the worker's ranks."""

    def choose(self, headers: list[torch.Tensor | None]) -> tuple[list[int], dict[int, str]]:
        """The senders to average, and why each other group rank is not one."""

    def decide(self, exchanged: Exchanged) -> Decision: ...

    def sums(self, values: list[float], outer_step: int, fragment: int, context: str) -> list[list[float]] | None:
        """`values` summed over each member's ranks, one row per group rank (runs in the background,
        after the exchange); None when the round could not complete (an elastic member left)."""


class Membership(Protocol):
    ballot_group: object  # the in-worker group the ballots and statistics are summed on (None: one rank)
    records_checksum: bool  # whether each sync's record carries the global weights' checksum

    def join(self, loop) -> None:
        """Enter the outer group before the first inner step (`loop.host` is set)."""

    def leave(self) -> None: ...

    def prepare(self, background: Executor, step: int) -> None:
        """The sync launched after inner step `step` comes after the coming inner step: begin what it
        needs from the other workers now. Work goes to `background`, the loop's thread that runs one
        task at a time in submission order, so it runs after every earlier sync has finished."""

    def run(self, task, sync: Callable[[Session], object]) -> object:
        """sync(session) for each attempt of the sync `task`, until one commits; returns its result."""


def disagreement(positions: list[tuple[int, int, float]]) -> str | None:
    """Why K workers that must agree do not, from each one's (outer step, inner step, digest of its
    global weights) (NaN digests are not compared); None when they agree."""
    places = [(outer, inner) for outer, inner, _ in positions]
    if len(set(places)) > 1:
        return ("the workers are at different steps: " + ", ".join(
            f"worker {k} at outer step {outer} (inner step {inner})" for k, (outer, inner) in enumerate(places))
            + ": every worker must resume from the same step's checkpoint and take the same steps")
    digests = [digest for *_, digest in positions if not math.isnan(digest)]
    if len(set(digests)) > 1:
        usual = max(digests, key=lambda d: (digests.count(d), -digests.index(d)))  # the most common, then the first
        odd = [k for k, (*_, digest) in enumerate(positions) if digest != usual]
        return (f"worker{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} hold{'' if len(odd) > 1 else 's'} other "
                f"global weights than worker {[d for *_, d in positions].index(usual)} at outer step {places[0][0]}: "
                f"changed outside the outer loop (a different start, a damaged or unverified checkpoint)")
    return None


# A tag that fails in the single world: its ranks hold one secret, so the message is not this sync's.
_NOT_THIS_SYNC = (" (a message that is not this sync's: a process without the job secret, or a worker at another "
                  "outer step, resumed from another checkpoint)")

# A rank's header in the single-world mode, float64: its worker's ballot (vote.py), then where it stands
# (outer step, inner step) and the digest of its global weights of the fragment synced, taken at launch.
POSITION_VALUES = 3
STATIC_HEADER_BYTES = vote.BALLOT_BYTES + 8 * POSITION_VALUES


class _StaticSession:
    leave_out = False
    joining = False

    def __init__(self, wire: Wire, metrics: Wire, workers: int, max_norm_ratio: float):
        self.wire, self.metrics_wire, self.workers, self.max_norm_ratio = wire, metrics, workers, max_norm_ratio

    def header(self, ballot: torch.Tensor, task) -> torch.Tensor:
        digest = math.nan if task.weights_digest is None else task.weights_digest  # a replayed sync's is not known
        position = torch.tensor([float(task.outer_step), float(task.step), digest], dtype=torch.float64)
        return torch.cat([ballot, position]).view(torch.uint8)

    choose = staticmethod(everyone)

    def decide(self, exchanged: Exchanged) -> Decision:
        everybody = list(range(self.wire.size))
        if exchanged.rejected:  # every rank of the outer group rejects the same workers
            return Decision(everybody, [], "; ".join(f"worker {k}: {why}" + (_NOT_THIS_SYNC if why == AUTHENTICATION
                                                                                else "")
                                                     for k, why in sorted(exchanged.rejected.items())))
        rows = [h.cpu().clone().view(torch.float64).tolist() for h in exchanged.headers]  # clone: aligned
        disagree = disagreement([(int(r[-3]), int(r[-2]), r[-1]) for r in rows])
        if disagree:  # every rank of the outer group sees the same headers, so all stop here
            raise DisagreementError(disagree)
        norms, reason = vote.count([h[:vote.BALLOT_BYTES] for h in exchanged.headers], self.max_norm_ratio)
        return Decision(everybody, norms, reason)

    def sums(self, values: list[float], outer_step: int, fragment: int, context: str) -> list[list[float]]:
        self.metrics_wire.begin(outer_step, fragment)
        return self.metrics_wire.sum_per_worker(values, self.workers, context)


OUTSIDE_SYNCS = -1  # the outer step the tags of the exchanges outside any sync name (agreement.py)


class StaticMembership:
    """The K workers of one world. Every rank creates every group, in the same order, on
    `outer_backend`: the outer groups (one per shard position) and, on gloo, their lanes, the metrics
    group (every rank) and,
    with several ranks per worker, a group per worker for the ballots (the training loop's worker
    group stays the training loop's)."""
    records_checksum = False

    def __init__(self, config: MuLoCoConfig, topology: Topology, key: JobKey | None,
                 timeout: timedelta = comm.COLLECTIVE_TIMEOUT):
        backend, sizes = config.outer_backend, topology.sizes
        if backend == "nccl" and comm.compute_device().type == "cpu":
            raise ConfigError("muloco.outer_backend 'nccl' needs an accelerator; use 'gloo' on the host")
        mine = comm.new_subgroups(outer_ranks(sizes), timeout, backend=backend)
        # gloo's payloads travel point to point, one connection per direction (wire.Lanes says why).
        lanes = (Lanes(comm.new_subgroups(outer_ranks(sizes), timeout, backend=backend),
                       comm.new_subgroups(outer_ranks(sizes), timeout, backend=backend)) if backend == "gloo" else None)
        every_rank = comm.new_group(list(range(sizes.world)), timeout, backend=backend)
        self.ballot_group = (comm.new_subgroups(worker_ranks(sizes), timeout, backend=backend)
                             if sizes.ranks_per_worker > 1 else None)
        self._session = _StaticSession(GroupWire(mine, config.link, key, "outer", lanes),
                                       GroupWire(every_rank, config.link, key, "metrics"), sizes.workers,
                                       config.max_norm_ratio)

    def join(self, loop) -> None:
        pass

    def leave(self) -> None:
        pass

    def prepare(self, background: Executor, step: int) -> None:
        pass  # the K workers' groups stand for the whole run

    replays_pending = True  # a checkpoint's in-flight syncs are replayed on load (every worker resumes together)

    def gather(self, data: bytes, context: str) -> list[bytes | None]:
        """Every rank's `data` (the same size on every rank), by global rank (None: its tag failed), over
        the group of every rank: so every rank decides alike; outside any sync."""
        wire = self._session.metrics_wire
        wire.begin(outer_step=OUTSIDE_SYNCS, fragment=0)
        parts = wire.all_gather(torch.frombuffer(bytearray(data), dtype=torch.uint8), context)
        wire.take_stats()  # not a sync's: its bytes and round trip are no sync's record
        return [None if part is None else part.cpu().numpy().tobytes() for part in parts]

    def from_worker_zero(self, flat: torch.Tensor, context: str) -> torch.Tensor:
        """Worker 0's `flat` (uint8, the same size on every rank of an outer group) on every worker, over
        this rank's outer group; outside any sync."""
        wire = self._session.wire
        wire.begin(outer_step=OUTSIDE_SYNCS, fragment=0)
        mine = flat.reshape(-1).view(torch.uint8)
        blocks = [mine if wire.rank == 0 and receiver != 0 else mine[:0] for receiver in range(wire.size)]
        received = wire.all_to_all(blocks, [mine.numel() if wire.rank != 0 and src == 0 else 0
                                            for src in range(wire.size)], context)[0]
        wire.take_stats()  # not a sync's
        if received is None:
            raise DisagreementError(f"{context}: worker 0's weights failed their tag")
        return flat if wire.rank == 0 else received.to(flat.device)

    def run(self, task, sync):
        return sync(self._session)
