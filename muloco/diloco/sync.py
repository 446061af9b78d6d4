"""The body of one outer sync of one fragment, the same for every host and every membership:

1. (the caller) delta = theta_global - theta_local (fp32), per owned tensor of the fragment, flattened
   into one buffer per bucket (plan.py);
2. this rank's ballot (non-finite count, squared norm), summed over its worker's ranks (inside the
   datacenter);
3. compressed average of each bucket over the outer group (averaging.py: all-gather, or
   reduce-scatter + re-quantize + all-gather), bit-identical on every worker, the membership's header
   (the ballot; in the elastic mode the member's whole row) riding in its first collective: the
   membership (membership.py) decides from the headers who contributes and whether the sync is
   applied, so with the all-gather collective the whole decision costs one cross-datacenter round
   trip. With wall-clock pacing each header also carries the worker's contribution (its inner steps,
   tokens and lr sums: pace.py; an empty one from a member with nothing to contribute, so that every
   header has one size), and the senders' contributions weight the merge and correct the outer
   momentum. The encoder's residual is the new error-feedback buffer;
4. the result (applied by the outer loop) and its metrics (sync_metrics.py), reduced by a function
   the loop runs in its background thread after the result is applied, so their round trip is off
   the critical path. It also checks that every worker rejected the same payloads (a skipped sync
   runs it too).

It may run in the background thread: it reads the plan and the error feedback's past residuals and
changes nothing (the caller applies the result).
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from dataclasses import astuple, dataclass
from typing import Callable

import torch

from muloco.core import comm
from muloco.diloco import vote
from muloco.diloco.averaging import Averaged, Bucket, average_buckets
from muloco.diloco.packing import BucketPacking
from muloco.diloco.payload_checks import squared_norm
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.membership import Decision, Membership, Session
from muloco.diloco.pace import CONTRIBUTION_BYTES, NO_CONTRIBUTION, Contribution, merge_weights, momentum_exponent
from muloco.diloco.plan import BucketSpec
from muloco.diloco.sync_metrics import LocalSums, sync_record, verdict_digest


@dataclass(frozen=True)
class SyncTask:
    """One sync as every member agrees on it: what is synced, and the run's position when it started
    (what a member that is behind receives along with the state)."""
    fragment: int
    step: int  # the inner step it was launched after
    outer_step: int
    scheduler: dict | None  # the lr schedule's state at `step` (None: a replay from a checkpoint, or no schedule)
    step_seconds: float = 0.0  # this rank's recent inner step time (0: not measured)
    contribution: Contribution | None = None  # this worker's interval (wall-clock pacing; None: fixed H)
    weights_digest: float | None = None  # of this rank's global weights of the fragment at launch (None: a replay)


@dataclass
class SyncResult:
    fragment: int
    averaged: list[Averaged] | None  # one per bucket; None when nothing is applied
    record: dict  # what the sync logs
    statistics: Callable[[], dict] | None = None  # the rest of the record, reduced off the critical path
    caught_up: SyncTask | None = None  # the peers' sync this member received their state for
    contributions: list[Contribution] | None = None  # every worker's interval, in rank order (pacing)
    momentum_exponent: float = 1.0  # the outer momentum decays as mu ** this (pace.py's correction)


@dataclass
class PendingSync:
    """A sync launched and not yet applied (an overlapped one runs in the loop's background thread)."""
    apply_at: int
    task: SyncTask
    deltas: list[torch.Tensor]  # one flat buffer per bucket, kept so a checkpoint can replay the sync
    future: Future  # of a SyncResult


def done_future(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _repack(flat: torch.Tensor, source: BucketPacking, target: BucketPacking) -> torch.Tensor:
    return flat if source == target else target.flatten(source.unflatten(flat))


def _recut(bucket: Bucket, parts: int) -> Bucket:
    """The bucket in `parts` row chunks (the reduce-scatter's), when its packing has another count."""
    if bucket.packing.parts in (1, parts):
        return bucket
    packing = BucketPacking(bucket.packing.shapes, parts)
    return Bucket(bucket.compressor, packing, _repack(bucket.flat, bucket.packing, packing))


class SyncBody:
    def __init__(self, config: MuLoCoConfig, buckets: list[list[BucketSpec]], device: torch.device,
                 membership: Membership, ranks_per_worker: int, context: Callable[[int], str],
                 clock: Callable[[], float] = time.perf_counter):
        self.config, self.buckets, self.device, self.membership = config, buckets, device, membership
        self.ranks_per_worker, self.context, self.clock = ranks_per_worker, context, clock

    def zero_deltas(self, fragment: int) -> list[torch.Tensor]:
        """A fragment's buckets of zeros: what a member with nothing to contribute sends."""
        return [torch.zeros(spec.numel, device=self.device) for spec in self.buckets[fragment]]

    @torch.no_grad()
    def sync(self, task: SyncTask, deltas: list[torch.Tensor]) -> SyncResult:
        """One sync through the membership."""
        start = self.clock(), time.thread_time()
        ballot = vote.ballot(*_vote_share(self.buckets[task.fragment], deltas))
        if self.membership.ballot_group is not None:
            comm.all_reduce(ballot, group=self.membership.ballot_group)  # the worker's totals, inside the datacenter
        return self.membership.run(task, lambda session: self._exchange(session, task, deltas, ballot, start))

    def _exchange(self, session: Session, task: SyncTask, deltas: list[torch.Tensor], ballot: torch.Tensor,
                  start: tuple[float, float]) -> SyncResult:
        caught_up = getattr(session, "caught_up", None)  # this member just received a peer's state and sync
        if caught_up is not None:
            task, deltas, ballot = caught_up, self.zero_deltas(caught_up.fragment), torch.zeros_like(ballot)
        specs, context = self.buckets[task.fragment], self.context(task.outer_step)
        contributing = not session.joining
        if not contributing:  # zeros nobody decodes; its error feedback restarts from zero
            deltas = [torch.zeros_like(d) for d in deltas]
        buckets = [Bucket(spec.compressor, spec.packing,
                          spec.error_feedback.accumulate(d) if spec.error_feedback and contributing else d)
                   for spec, d in zip(specs, deltas)]
        session.wire.begin(task.outer_step, task.fragment, epoch=getattr(session, "epoch", 0))
        # Reduce-scatter cuts each bucket into one chunk per member: a quorum of fewer than K members
        # (elastic) exchanges the buckets re-cut for its size, and the results come back in K chunks.
        cut = [_recut(b, session.wire.size) for b in buckets]
        header, choose, weigh = session.header(ballot, task), session.choose, None
        paced = self.config.pace.paced
        if paced:  # the contribution rides after the membership's header
            contribution = task.contribution if contributing and task.contribution is not None else NO_CONTRIBUTION
            header = torch.cat([header, contribution.encode()])
            choose = lambda headers: session.choose(_membership_part(headers))  # noqa: E731
            weigh = _merge_weights
        exchanged = average_buckets(cut, session.wire, self.config.collective, context, header=header, choose=choose,
                                    max_norm_ratio=self.config.max_norm_ratio, leave_out=session.leave_out, weigh=weigh)
        exchanged.averaged = [Averaged(_repack(a.average, c.packing, b.packing), _repack(a.residual, c.packing, b.packing))
                              for a, c, b in zip(exchanged.averaged, cut, buckets)]
        exchange = session.wire.take_stats()
        contributions = None
        if paced:
            contributions = _contributions(exchanged.headers)
            exchanged.headers = _membership_part(exchanged.headers)
        decision = session.decide(exchanged)
        exponent = 1.0 if contributions is None else _judge_contributions(decision, contributions)
        record = {"outer_step": task.outer_step, "fragment": task.fragment, "step": task.step, **decision.record,
                  "pseudograd_norm": statistics.fmean(decision.norms) if decision.skipped is None else None,
                  "round_trips": exchange.round_trips, "sync_seconds": self.clock() - start[0],
                  # what the sync's time went to: the (emulated) link, and this thread's own work
                  "link_seconds": exchange.link_seconds, "sync_cpu_seconds": time.thread_time() - start[1]}
        if contributions is not None:
            record.update(inner_steps=[c.steps for c in contributions.values()], momentum_exponent=exponent)
        averaged = None
        if decision.skipped is not None:
            record["skipped"] = decision.skipped
        else:
            averaged = exchanged.averaged
            if session.wire.rank not in decision.contributors:  # its error feedback restarts from zero
                averaged = [Averaged(a.average, torch.zeros_like(a.average)) for a in averaged]
        verdict = verdict_digest(exchanged.rejected, decision.skipped)
        per_worker = self.ranks_per_worker
        if task.step_seconds > 0:
            record["step_seconds"] = task.step_seconds
        needed = record["sync_seconds"] / task.step_seconds / per_worker if task.step_seconds > 0 else 0.0

        def reduce_metrics() -> dict:  # reads the sync's buffers, which nothing changes after the exchange
            local = (LocalSums(verdict=verdict) if averaged is None else
                     _local_sums(specs, deltas, buckets, averaged, exchange.bytes_sent, verdict))
            local.overlap_needed = needed
            rows = session.sums(list(astuple(local)), task.outer_step, task.fragment, context)
            background = {"background_round_trips": session.metrics_wire.take_stats().round_trips}
            if rows is None:
                return {**record, "metrics_lost": True, **background}
            reduced = sync_record(rows, decision.contributors, per_worker,
                                  decision.norms if averaged is not None else [], context)
            return {**record, **reduced, **background}
        # A skipped sync's metrics round runs too: it checks that every worker skipped it.
        return SyncResult(task.fragment, averaged, record, reduce_metrics, caught_up,
                          None if contributions is None else list(contributions.values()), exponent)


def _membership_part(headers: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The headers without the contributions that ride after them."""
    return [h if h is None else h[:-CONTRIBUTION_BYTES] for h in headers]


def _contributions(headers: list[torch.Tensor | None]) -> dict[int, Contribution]:
    return {r: Contribution.decode(h[-CONTRIBUTION_BYTES:]) for r, h in enumerate(headers) if h is not None}


def _merge_weights(headers: list[torch.Tensor | None], senders: list[int]):
    """The merge's weights from the senders' contributions, not those of members left out by their
    header (a joining member's is empty). None: the plain average, also when one is malformed (the sync
    is then skipped by `_judge_contributions`)."""
    contributions = {k: c for k, c in _contributions(headers).items() if k in senders}
    if any(c.problem() for c in contributions.values()):
        return None
    return merge_weights(contributions)


def _judge_contributions(decision: Decision, contributions: dict[int, Contribution]) -> float:
    """The momentum exponent of the contributors; a malformed contribution skips the sync for everyone."""
    if decision.skipped is None:
        problems = [f"worker {k}: " + (contributions[k].problem() if k in contributions else "no contribution")
                    for k in decision.contributors if k not in contributions or contributions[k].problem()]
        if problems:
            decision.skipped = "; ".join(problems)
    if decision.skipped is not None:
        return 1.0
    return momentum_exponent([contributions[k] for k in decision.contributors])


def _vote_share(specs: list[BucketSpec], deltas: list[torch.Tensor]) -> tuple[bool, float]:
    """(any non-finite entry, squared norm) of this rank's share of a fragment's pseudogradient."""
    sq = sum(squared_norm(d) for spec, d in zip(specs, deltas) if spec.counts_once)
    return any(not bool(torch.isfinite(d).all()) for d in deltas), sq


def _local_sums(specs: list[BucketSpec], deltas: list[torch.Tensor], buckets: list[Bucket],
                averaged: list[Averaged], bytes_sent: int, verdict: float) -> LocalSums:
    local = LocalSums(bytes_sent=bytes_sent, verdict=verdict)
    for spec, delta, bucket, result in zip(specs, deltas, buckets, averaged):
        if spec.counts_once:
            local.dot += float((delta * result.average).sum(dtype=torch.float64))
            local.average_sq += squared_norm(result.average)
            if spec.compressed:
                local.residual_sq += squared_norm(result.residual)
                local.sent_sq += squared_norm(bucket.flat)
    return local
