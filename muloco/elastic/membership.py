"""The elastic membership: one job per worker (datacenter), meeting at each outer sync in a torchft
quorum (muloco/elastic/quorum.py). The outer loop's sync body (muloco/diloco/sync.py) runs
once per attempt:

1. quorum: the workers that are alive and at the sync (torchft lighthouse, through the tunnel); the
   first attempt's is asked for one inner step ahead (`prepare`), so its round trip overlaps that step.
   The lighthouse forms it once every live worker has asked, or its join timeout (the grace window)
   after the first request. A request that gets no quorum (the lighthouse unreachable, its transport
   failing), or one of fewer than `elastic.min_workers` workers, is no failed attempt: it is asked
   again with exponential backoff, one line each, until `elastic.quorum_timeout_s` after the first
   (`_Asking`), then the job stops with one line naming the lighthouse and the time it asked;
2. catch-up, only when torchft counts fewer members at the highest number of committed syncs than in
   the quorum: every member publishes (worker id, committed syncs, the largest part its link has moved),
   tagged; a member that has them all sends its state and the sync's task to the members behind, over
   the quorum's group, tagged, as safetensors (nothing received is unpickled), each checked against its
   own shapes before it is loaded (muloco/diloco/snapshot.py, the form a checkpoint has too); in pieces
   no larger than a sync's parts, so that each op fits in sync_timeout_s on any link that can sync
   (`_catch_up` says how);
3. the exchange: every member's row rides in its payload's header (worker id, inner step, joining,
   non-finite, squared norm, committed syncs), so who contributes (`left_out` below) is decided in the
   same collective: one round trip. Left out: a row that fails its tag, a member that is joining (it
   has just loaded the state, or the run is starting), a non-finite or outlier pseudogradient, a
   payload that fails its checks. Members left out receive the same average, so every member leaves
   the sync with the same global weights;
4. commit: every rank of the worker agrees the sync finished (torchft's should_commit); a failed
   attempt (a peer died, or stalled past `muloco.sync_timeout_s`) is retried with a fresh quorum on
   the same pseudogradient, so the survivors apply every outer step exactly once; after
   `elastic.max_attempts` failures the job stops.

A worker that restarts joins at its peers' next sync, whichever fragment it is: it catches up first
(state, inner step, engine counters, lr schedule, the peers' syncs still in flight), takes that sync's
outer step with them as a member that does not contribute, and goes on from their inner step. Its
inner optimizer state is its own (fresh, or from its --load checkpoint); its error feedback restarts
from zero. A fresh run waits (up to `quorum_timeout_s`) until all K workers are in the first quorum,
then starts with the quorum it has if that holds `min_workers`, else stops.
A live member that is behind (it missed a whole sync: its peers' quorum formed without it, because it
came later than the lighthouse's join timeout) catches up the same way at its next sync and goes on
from its peers' step, losing its own inner steps since its last sync: a contribution that comes after
its sync closed is dropped, not folded into a later sync (docs/unequal_workers.md says why). The
first quorum with fewer than K workers, and every change of the quorum after it, is one line; each
record says whether the worker synced alone (`alone`). One known gap: when a peer dies
in the middle of the last collective, one survivor may commit a sync another one retries; the one
left behind catches up at its next attempt.
"""
from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from muloco.core import comm
from muloco.core.rank_file import RankFileError, state_from_bytes, state_to_bytes
from muloco.diloco.auth import JobKey
from muloco.diloco.averaging import Exchanged
from muloco.diloco.wire import CollectiveError, Wire
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.membership import Decision
from muloco.diloco.snapshot import CATCH_UP
from muloco.diloco.sync import SyncTask
from muloco.elastic.quorum import NoQuorum, QuorumGroup
from muloco.core.topology import Topology, worker_ranks

# One member's header, float64, in order; `weights` digests its global weights of the fragment synced.
ROW = ("worker", "step", "joining", "nonfinite", "sq_norm", "committed", "weights")
# What a failed attempt raises: our collectives (CollectiveError), a state that fails its checks
# (RankFileError), torchft's group of a quorum that formed (RuntimeError, TimeoutError). A request that
# got no quorum at all raises NoQuorum instead: asked again, no attempt.
_ATTEMPT_FAILURES = (CollectiveError, RankFileError, RuntimeError, TimeoutError)
_START_POLL_S = 1.0
# The wait before asking a lighthouse that gave no quorum again: doubled after each request, up to the cap.
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 1.0, 15.0
# Bytes a peer's serialized state may hold beyond the tensors this rank owns (its JSON tree, its
# in-flight averages are counted separately).
MAX_CATCH_UP_PIECES = 1024  # a bound on a catch-up's round trips (_piece_bytes)
_STATE_SLACK_BYTES = 16 << 20


DIVERGED = "global weights differ from its peers'"


@dataclass(frozen=True)
class Member:
    worker: int  # the worker id (--worker-id)
    step: int  # inner steps done (the data stream position)
    joining: bool
    nonfinite: bool
    norm: float
    committed: int = 0  # outer syncs this worker has committed
    weights: float = 0.0  # a digest of its global weights of the fragment synced
    authentic: bool = True  # False: its row failed its tag (it is in the quorum, but not one of us)

    @classmethod
    def from_row(cls, row: list[float]) -> Member:
        worker, step, joining, nonfinite, sq, committed, weights = row
        return cls(int(worker), int(step), joining > 0, nonfinite > 0, math.sqrt(sq) if math.isfinite(sq) else math.inf,
                   int(committed), weights)

    @classmethod
    def unauthenticated(cls) -> Member:
        return cls(worker=-1, step=0, joining=False, nonfinite=False, norm=0.0, committed=-1, authentic=False)


def left_out(members: list[Member], max_norm_ratio: float) -> dict[int, str]:
    """Quorum index -> why that member does not contribute to this sync (from the rows alone). A
    member whose global weights differ from most members' (it committed a sync alone that the others
    retried, say) is left out too; it catches up at its next sync."""
    reasons = {i: "failed authentication" for i, m in enumerate(members) if not m.authentic}
    reasons.update({i: "joining" for i, m in enumerate(members) if m.joining and i not in reasons})
    settled = [m.weights for i, m in enumerate(members) if i not in reasons]
    if settled:
        usual = max(settled, key=lambda w: (settled.count(w), -settled.index(w)))  # the most common, then the first
        reasons.update({i: DIVERGED for i, m in enumerate(members)
                        if i not in reasons and m.weights != usual})
    reasons.update({i: "non-finite pseudogradient" for i, m in enumerate(members) if m.nonfinite and i not in reasons})
    candidates = [i for i in range(len(members)) if i not in reasons]
    for i in candidates:
        others = [members[j].norm for j in candidates if j != i]
        if others and members[i].norm > max_norm_ratio * max(statistics.median(others), 1e-12):
            reasons[i] = f"pseudogradient norm {members[i].norm:.3g} is over {max_norm_ratio}x its peers'"
    return reasons


def _first_line(exc: BaseException) -> str:
    """What a log line says of a failure: its message's first line, or its type when it has none."""
    lines = str(exc).splitlines()
    return lines[0][:300] if lines and lines[0] else type(exc).__name__


class _NotReady(Exception):
    """No sync in this quorum, and no attempt counted: it holds fewer than min_workers workers, or it is a
    fresh run's first quorum without every worker (before the start deadline)."""


class _NoQuorumInTime(CollectiveError):
    """The lighthouse gave no quorum to sync in for quorum_timeout_s of asking: the job stops, no attempt
    is retried."""


class _Asking:
    """The quorum requests of one sync that gave none to sync in (none at all, or one of fewer than
    min_workers): each is asked again after a backoff (doubled after each, up to its cap), with one
    line, until quorum_timeout_s after the first of them (a fresh run's first sync: after it joined).
    Every rank of the worker gets the same answers (torchft's manager server asks the lighthouse once for
    them all), so they retry, and stop, together."""

    def __init__(self, membership: QuorumMembership, since: float | None):
        self.membership, self.first, self.backoff = membership, since, _FIRST_BACKOFF_S
        self.requests, self.asked = 0, 0.0

    def request(self) -> None:
        self.asked = self.membership.clock()
        self.requests += 1

    def again(self, why: Exception) -> None:
        m = self.membership
        now, lighthouse = m.clock(), m.elastic.lighthouse_address()
        self.first = self.asked if self.first is None else self.first
        left = self.first + m.elastic.quorum_timeout_s - now
        if left <= 0:
            raise _NoQuorumInTime(f"worker {m.worker}: no quorum from the lighthouse at {lighthouse} in "
                                  f"{now - self.first:.0f} s of asking ({self.requests} requests): {why}") from why
        pause = min(self.backoff, left)
        if m.topology.is_logging_rank:
            print(f"worker {m.worker}: no quorum from the lighthouse at {lighthouse}: {why}; asking again "
                  f"in {pause:.0f} s (gives up in {left:.0f} s)", flush=True)
        m.sleep(pause)
        self.backoff = min(2 * self.backoff, _MAX_BACKOFF_S)


def _members(headers: list[torch.Tensor | None]) -> list[Member]:
    return [Member.unauthenticated() if h is None or h.numel() != 8 * len(ROW)
            else Member.from_row(h.cpu().clone().view(torch.float64).tolist()) for h in headers]


class _QuorumSession:
    """One attempt of one sync on the current quorum."""
    leave_out = True

    def __init__(self, membership: QuorumMembership, wire: Wire, attempt: int):
        self.membership, self.wire, self.metrics_wire, self.attempt = membership, wire, wire, attempt
        self.epoch = membership.quorum.epoch
        self.joining = membership.loop.joining
        self.caught_up = None  # the sync this member takes part in after catching up (else the one it launched)
        self.members: list[Member] = []

    def header(self, ballot: torch.Tensor, task) -> torch.Tensor:
        nonfinite, sq = ballot.tolist() if not self.joining else (0.0, 0.0)
        row = [float(self.membership.worker), float(task.step), float(self.joining), nonfinite, sq,
               float(self.membership.quorum.committed_syncs), self.membership.loop.weights_digest(task.fragment)]
        return torch.tensor(row, dtype=torch.float64).view(torch.uint8)

    def choose(self, headers: list[torch.Tensor | None]) -> tuple[list[int], dict[int, str]]:
        self.members = _members(headers)
        reasons = left_out(self.members, self.membership.config.max_norm_ratio)
        if reasons.get(self.wire.rank) == DIVERGED:  # count one sync fewer: the next one catches this member up
            self.membership.quorum.set_committed_syncs(self.membership.quorum.committed_syncs - 1)
        return [i for i in range(len(self.members)) if i not in reasons], reasons

    def decide(self, exchanged: Exchanged) -> Decision:
        members, membership, config = self.members, self.membership, self.membership.config
        ours = [m for m in members if m.authentic]
        in_quorum = [m.worker for m in ours]
        if all(m.joining for m in ours) and len(ours) < config.workers and membership.starting():
            raise _NotReady(f"{len(ours)} of {config.workers} workers in the first quorum")
        contributors = [i for i in range(len(members)) if i not in exchanged.rejected]
        record = {"workers_in_sync": len(contributors), "quorum": in_quorum, "alone": len(ours) == 1,
                  "missing": sorted(set(range(config.workers)) - set(in_quorum)),
                  "left_out": {str(members[i].worker): why for i, why in sorted(exchanged.rejected.items())
                               if members[i].authentic},
                  "attempts": self.attempt, "rejoined": self.membership.rejoined}
        if len(ours) < len(members):  # quorum members whose row failed its tag: not ours
            record["unauthenticated"] = len(members) - len(ours)
        if not contributors:
            record["start"] = all(m.joining for m in ours)
            return Decision([], [], "no member has a pseudogradient to contribute", record)
        return Decision(contributors, [members[i].norm for i in contributors], None, record)

    def sums(self, values: list[float], outer_step: int, fragment: int, context: str) -> list[list[float]] | None:
        """None when a member left the quorum after the sync committed: the sync stands, its metrics
        (and the comparison of verdicts) are lost, and the next sync's quorum goes on without it."""
        local = torch.tensor(values, dtype=torch.float64)
        if self.membership.ballot_group is not None:
            comm.all_reduce(local, group=self.membership.ballot_group)
        try:
            rows = self.wire.all_gather_floats(local.tolist(), context)
        except _ATTEMPT_FAILURES as exc:
            if self.membership.topology.is_logging_rank:
                print(f"worker {self.membership.worker}: metrics of {context} lost: {_first_line(exc)}",
                      flush=True)
            return None
        return [row or [0.0] * len(values) for row in rows]


class QuorumMembership:
    records_checksum = True  # every record carries weights_sha: equal on two members iff bit-identical
    replays_pending = False  # a restarted worker catches up from its peers instead

    def __init__(self, config: MuLoCoConfig, topology: Topology, key: JobKey | None, worker: int,
                 timeout: timedelta = comm.COLLECTIVE_TIMEOUT, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.config, self.elastic, self.topology, self.key, self.worker = config, config.elastic, topology, key, worker
        self.clock, self.sleep = clock, sleep
        sizes = topology.sizes
        # The loop's own group for in-worker sums (the ballots, the statistics): safe from its background thread.
        self.ballot_group = comm.new_subgroups(worker_ranks(sizes), timeout) if sizes.ranks_per_worker > 1 else None
        self.quorum: QuorumGroup | None = None
        self.loop = None
        self.rejoined = False  # the state came from a peer in this sync
        self.smallest_quorum = config.elastic.smallest_quorum(config.workers)
        self.started_at: float | None = None  # when a fresh run joined, until its first sync commits
        self.last_quorum: list[int] | None = None  # the worker ids of the last committed sync's quorum
        self._prepared: dict[int, Future] = {}  # launch step -> its first attempt's quorum request
        # The most bytes this rank's link has moved to or from one peer in one op of a quorum's group (each op
        # within sync_timeout_s): the size of the pieces of a catch-up it sends.
        self.largest_part = 0

    # -- joining and leaving ---------------------------------------------------------------------

    def join(self, loop) -> None:
        """Enter the outer group before the first inner step. A fresh run waits (up to
        quorum_timeout_s) until all K workers are in the first quorum; a restarted worker waits for
        its peers' next sync, catches up, takes that sync's outer step with them and goes on from
        their inner step."""
        self.loop = loop
        self.quorum = self._connect()
        if self.topology.is_logging_rank:
            alone = " (1: it may train alone)" if self.smallest_quorum == 1 else ""
            print(f"worker {self.worker}: elastic, lighthouse {self.elastic.lighthouse_address()}: waits up to "
                  f"{self.elastic.quorum_timeout_s:g} s for all {self.config.workers} workers at the start, and syncs "
                  f"only in quorums of at least {self.min_workers_setting()}{alone}", flush=True)
        loop.joining = True
        self.started_at = self.clock()
        task = SyncTask(0, loop.host.inner_step(), loop.state.outer_step + 1, loop.host.schedule_state())
        result = loop.sync(task, loop.zero_deltas(0))
        if not result.record.get("start"):  # a fresh run has nothing to average: every worker holds the seed's weights
            loop.apply(result, overlapped=False)

    def _connect(self) -> QuorumGroup:
        sizes = self.topology.sizes
        return QuorumGroup(
            self.worker, self.topology.rank, sizes.ranks_per_worker, self.elastic.lighthouse_address(),
            self.elastic.manager_host, self.key, self.config.outer_backend,
            timedelta(seconds=self.config.sync_timeout_s),
            timedelta(seconds=min(self.elastic.quorum_request_timeout_s, self.elastic.quorum_timeout_s)),
            workers=self.config.workers)

    def leave(self) -> None:
        if self.quorum is not None:
            self.quorum.shutdown()

    def min_workers_setting(self) -> str:
        default = " (its default, min(2, K))" if self.elastic.min_workers is None else ""
        return f"muloco.elastic.min_workers = {self.smallest_quorum}{default}"

    def starting(self) -> bool:
        """Whether this is a fresh run's first sync, still waiting for every worker (until quorum_timeout_s)."""
        return self.started_at is not None and self.clock() < self.started_at + self.elastic.quorum_timeout_s

    # -- one sync ---------------------------------------------------------------------------------

    def prepare(self, background: Executor, step: int) -> None:
        """Ask for the quorum of the sync launched after inner step `step` one inner step early: the
        lighthouse's round trip, and the wait for a member still in its inner step, overlap that step.
        A member that dies in it fails the exchange, which is retried with a fresh quorum."""
        self._prepared[step] = background.submit(self.quorum.start)

    def run(self, task, sync):
        prepared = self._prepared.pop(task.step, None)
        asking = _Asking(self, self.started_at)
        attempt = 0
        while True:
            attempt += 1
            result, error, session = None, None, None
            early, prepared = prepared, None
            try:
                self._quorum(early, asking)
                session = _QuorumSession(self, self.quorum.wire(self.config.link), attempt)
                if session.wire.size < self.smallest_quorum:  # before a catch-up: none in a quorum not used
                    raise _NotReady(f"its last quorum held {session.wire.size} of {self.config.workers} workers, "
                                    f"fewer than {self.min_workers_setting()}")
                self._catch_up(session, task)
                result = sync(session)
            except _NoQuorumInTime:
                raise
            except (_NotReady, *_ATTEMPT_FAILURES) as exc:
                error = exc
                self.quorum.report_error(exc)
            if session is not None:  # the ops that completed, in an attempt that failed too
                self.largest_part = max(self.largest_part, session.wire.largest_part)
            if self.quorum.commit():
                self.loop.joining = self.rejoined = False
                self._say_if_the_group_changed(result.record["quorum"])
                self.started_at = None
                return result
            if isinstance(error, _NotReady):
                attempt -= 1
                if self.starting():  # peers starting up: asked again soon, silently
                    self.sleep(_START_POLL_S)
                else:
                    asking.again(error)
                continue
            if self.topology.is_logging_rank:
                print(f"worker {self.worker}: outer sync attempt {attempt} failed: {_first_line(error)}",
                      flush=True)
            if attempt >= self.elastic.max_attempts:
                raise CollectiveError(f"worker {self.worker}: outer sync failed {attempt} times in a row") from error

    def _quorum(self, early: Future | None, asking: _Asking) -> None:
        """Be in a quorum: the one asked for ahead (`early`), else a fresh one; a request that got none
        is asked again (`asking`)."""
        while True:
            asking.request()
            try:
                if early is not None:
                    early.result()  # raises what the early request raised
                else:
                    self.quorum.start()
                return
            except NoQuorum as exc:
                early = None
                asking.again(exc)

    def _say_if_the_group_changed(self, quorum: list[int]) -> None:
        """One line when a sync's quorum is not every worker, and at each change of it after that: a
        worker that goes on without some of its peers (or alone) says so where its log is read."""
        previous, workers = self.last_quorum, self.config.workers
        self.last_quorum = sorted(quorum)
        if self.last_quorum == previous or (len(quorum) == workers and previous is None) or not self.topology.is_logging_rank:
            return
        missing = sorted(set(range(workers)) - set(quorum))
        line = (f"worker {self.worker}: starting with {len(quorum)} of {workers} workers {self.last_quorum} after "
                f"{self.clock() - self.started_at:.0f} s of waiting" if self.started_at is not None else
                f"worker {self.worker}: syncing with {len(quorum)} of {workers} workers {self.last_quorum}")
        if missing:
            line += f" (missing {missing})"
        if len(quorum) == 1:
            line += f": training alone, as {self.min_workers_setting()} allows"
        print(line, flush=True)

    def _catch_up(self, session: _QuorumSession, task) -> None:
        """When some members are behind (torchft counts fewer at the highest committed syncs than in the
        quorum), a member with every sync sends its state and `task` to them, in pieces. Each piece is an
        op of the quorum's group, which times out after sync_timeout_s, and is no larger than the largest
        part the sender's link has moved to or from one peer in one op (a sync's payload, `_piece_bytes`);
        after each piece every member all-gathers how much it has received, so that no member waits in one
        op for more than a piece. A link that moves a sync within sync_timeout_s so moves a state of any
        size, and a peer that dies is still found within sync_timeout_s. Tagged for this quorum alone: a
        member behind does not know the outer step yet."""
        wire, loop = session.wire, self.loop
        if self.quorum.everyone_current(wire.size):
            return
        wire.begin(outer_step=0, fragment=0, epoch=session.epoch)
        context = f"catch-up in quorum {session.epoch}"
        rows = wire.all_gather_ints([self.worker, self.quorum.committed_syncs, self.largest_part], context)
        rows = [row if row is not None else [-1, -1, 0] for row in rows]  # failed its tag: neither sends nor receives
        committed = [row[1] for row in rows]
        top = max(committed)
        behind = [i for i, c in enumerate(committed) if 0 <= c < top]
        # The member with every sync whose link has moved the largest part sends (the first of them on a tie).
        source = max((i for i, c in enumerate(committed) if c == top), key=lambda i: (rows[i][2], -i))
        me = wire.rank
        blob = (torch.frombuffer(bytearray(state_to_bytes(loop.snapshot(CATCH_UP, joins=task).to_tree())),
                                 dtype=torch.uint8) if me == source else torch.empty(0, dtype=torch.uint8))
        announced = wire.all_gather_ints([blob.numel()], context)[source]
        own = sum(t.numel() * t.element_size() for t in (*loop.state.global_weights.values(), *loop.state.momentum.values()))
        limit = 2 * own + _STATE_SLACK_BYTES  # the weights and momentum, and at most as much in flight
        if announced is None or not 0 < announced[0] <= limit:  # every member counts the pieces from it
            raise RankFileError(f"the state size announced by quorum member {source} "
                                + ("failed authentication" if announced is None else f"is not within {limit} bytes"))
        total, piece = announced[0], _piece_bytes(rows[source][2], len(behind), announced[0])
        if self.topology.is_logging_rank and (me == source or me in behind):
            print(f"worker {self.worker}: catch-up in quorum {session.epoch}: worker {rows[source][0]} sends its state "
                  f"({total} bytes) to worker(s) {[rows[i][0] for i in behind]} in {-(-total // piece)} piece(s) of at "
                  f"most {piece} bytes", flush=True)
        what = f"the state from quorum member {source}"
        received = torch.empty(total if me in behind else 0, dtype=torch.uint8)
        for begin in range(0, total, piece):
            end = min(begin + piece, total)
            blocks = [blob[begin:end] if me == source and j in behind else blob[:0] for j in range(wire.size)]
            parts = wire.all_to_all(blocks, [end - begin if me in behind and j == source else 0
                                             for j in range(wire.size)], context)
            arrived = me not in behind or parts[source] is not None
            if me in behind and arrived:
                received[begin:end].copy_(parts[source])
            # Every member learns whether each member behind has the piece: a piece that failed its tag fails
            # the attempt on every member at once, not through their timeouts.
            progress = wire.all_gather_ints([end if arrived else -1], context)
            short = [i for i in behind if progress[i] != [end]]
            if short:
                raise RankFileError(f"{what} failed authentication at quorum member(s) {short} (bytes {begin}-{end})")
        if me not in behind:
            return
        session.caught_up = loop.load_snapshot(loop.read_snapshot(state_from_bytes(received.numpy().tobytes(), what),
                                                                  CATCH_UP, what))
        session.joining = self.rejoined = True
        self.quorum.set_committed_syncs(top)


def _piece_bytes(largest_part: int, receivers: int, total: int) -> int:
    """The bytes of each piece of a catch-up: the sender's link moved `largest_part` to one peer in one op,
    and its pieces of one round go to the `receivers` one after another (the last of them waits for them
    all). A sender that has only ever synced alone has moved nothing: it sends the state in one piece.
    At most MAX_CATCH_UP_PIECES pieces: a sender that has moved only a few header bytes would otherwise
    take millions of round trips."""
    fewest = -(-total // MAX_CATCH_UP_PIECES)
    return max(largest_part // receivers, fewest, 1) if largest_part > 0 else total
