"""The MuLoCo / DiLoCo outer loop, a step hook of the trainer.

Every rank keeps, for the parameters of its own shard, fp32 global weights and outer momentum (on
the host, pinned, or on the device with `outer_state_on_device`) and error-feedback buffers (on the
device). With D inner-DP replicas, each replica owns 1/D of the shard's parameters (balanced by size): it alone keeps their outer state
and syncs them with its peers in the other workers, then shares the result inside its worker.

A sync of one fragment:
1. delta = theta_global - theta_local (fp32), per owned parameter of the fragment, flattened into one
   buffer per bucket (parameters of the same compression group, see compression.py);
2. this rank's ballot (non-finite count, squared norm), summed over its worker's ranks (inside the
   datacenter);
3. compressed average of each bucket over the outer group (collectives.py: all-gather, or
   reduce-scatter + re-quantize + all-gather), bit-identical on every worker, the membership's header
   (the ballot; in the elastic mode the member's whole row) riding in its first collective: the
   membership (membership.py) decides from the headers who contributes and whether the sync is
   applied, so with the all-gather collective the whole decision costs one cross-datacenter round
   trip. The encoder's residual is the new error-feedback buffer;
4. Nesterov SGD on the global weights; every worker restarts from them (or, when the sync overlapped
   tau inner steps, mixes them into its local weights with weight alpha); inner optimizer state is kept;
5. the sync's metrics (sync_metrics.py), one all-gather over every rank, in a background thread
   after the result is applied, so their round trip is off the critical path; logged when they land.
   It also checks that every worker rejected the same payloads (a skipped sync runs it too).

Compression groups are vectors each rank holds whole, so results do not depend on T: rows of
column-parallel (and vocabulary-parallel) weights, columns of row-parallel ones (sent transposed).

The pseudogradients, error feedback and codec run where the parameters are; only packed payloads
and a few statistics cross to the outer groups' device (the host with `outer_backend: gloo`). With
`streaming.overlap_steps` > 0 a sync (its exchange, which carries the vote) runs in a background
thread while the inner steps go on; its result is applied tau steps after it started. The
background thread runs one task at a time (syncs and metrics in the order every rank submits them),
on the outer loop's own groups, so it never interleaves with the training loop's collectives.

One sync body serves every membership: the single world's fixed K workers (StaticMembership) and
the elastic mode's torchft quorum (trainer/elastic/membership.py), which may retry an attempt with a
fresh quorum and hands a member that is behind the state of a peer first (`peer_state`,
`load_peer_state`). One inner step before a sync launches, the membership is told (`prepare`): the
elastic one asks for its quorum then, on the background thread, so that the lighthouse's round trip
overlaps that inner step instead of waiting on the sync's critical path. The outer state is read for
a peer by the background thread while the main thread may apply a sync: one lock guards it.

`with outer.attached_to(trainer): trainer.train()` joins the membership, runs `after_inner_step`
after every optimizer step of the block (a trainer step hook), and detaches and leaves on exit.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple, dataclass
from typing import Callable

import torch

from trainer import comm
from trainer.diloco import vote
from trainer.diloco.collectives import Averaged, Bucket, BucketLayout, average_buckets, squared_norm
from trainer.diloco.compression import Compressor, ErrorFeedback, compression_group, rows_shape
from trainer.diloco.config import MuLoCoConfig
from trainer.diloco.membership import Membership, Session
from trainer.diloco.sync_metrics import LocalSums, sync_record, verdict_digest
from trainer.model.layout import layout_of
from trainer.optim.ownership import assign_owners
from trainer.topology import Topology


@dataclass
class SyncedParam:
    name: str  # canonical name
    param: torch.nn.Parameter
    fragment: int
    transposed: bool  # row-parallel weights are compressed by columns
    counts_once: bool  # whether this rank's copy counts in worker-wide sums (TP-replicated: TP rank 0 only)


def fragment_of(name: str, num_layers: int, fragments: int) -> int:
    """Contiguous layer ranges; the embedding rides with the first fragment, the head with the last."""
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return layer * fragments // num_layers
    return 0 if "embedding" in name else fragments - 1


def sync_offsets(sync_interval: int, fragments: int) -> list[int]:
    """Fragment i syncs when step % H == floor(H/F*(i+1)) mod H (the streaming DiLoCo schedule)."""
    return [math.floor(sync_interval / fragments * (i + 1)) % sync_interval for i in range(fragments)]


def outer_sgd_direction(average: torch.Tensor, momentum: torch.Tensor, mu: float, nesterov: bool) -> torch.Tensor:
    """The outer SGD step's direction for the averaged pseudogradient (torch.optim.SGD's momentum,
    dampening 0), updating `momentum` in place; the weights move by -outer_lr times it."""
    m = momentum.mul_(mu).add_(average)
    return average.add(m, alpha=mu) if nesterov else m


def _state_copy(t: torch.Tensor, on_device: bool) -> torch.Tensor:
    """An fp32 copy for the outer state: on the parameter's device, or on the host (pinned when the
    parameter lives on an accelerator, so the per-sync copies are fast)."""
    if on_device or t.device.type == "cpu":
        return t.detach().to(torch.float32, copy=True)
    return t.detach().to("cpu", torch.float32).pin_memory()


@dataclass
class _BucketSpec:
    """Owned parameters of one fragment that travel together: the same compression group (so the same
    codec) and whether they count in worker-wide sums. Ordered by row width (see compression.py)."""
    indices: list[int]
    compressor: Compressor
    layout: BucketLayout
    counts_once: bool
    error_feedback: ErrorFeedback | None

    @property
    def compressed(self) -> bool:
        return self.compressor.config.method != "none"


@dataclass(frozen=True)
class SyncTask:
    """One sync as every member agrees on it: what is synced, and the run's position when it started
    (what a member that is behind receives along with the state)."""
    fragment: int
    step: int  # the inner step it was launched after
    outer_step: int
    scheduler: dict | None  # the lr schedule's state at `step` (None: a replay from a checkpoint)


@dataclass
class SyncResult:
    fragment: int
    averaged: list[Averaged] | None  # one per bucket; None when nothing is applied
    record: dict  # what the sync logs
    statistics: Callable[[], dict] | None = None  # the rest of the record, reduced off the critical path
    caught_up: SyncTask | None = None  # the peers' sync this member received their state for


@dataclass
class _Pending:
    apply_at: int
    task: SyncTask
    deltas: list[torch.Tensor]  # one flat buffer per bucket, kept so a checkpoint can replay the sync
    future: Future  # of a SyncResult


def _relayout(flat: torch.Tensor, source: BucketLayout, target: BucketLayout) -> torch.Tensor:
    return flat if source == target else target.flatten(source.unflatten(flat))


def _recut(bucket: Bucket, parts: int) -> Bucket:
    """The bucket in `parts` row chunks (the reduce-scatter's), when its layout has another count."""
    if bucket.layout.parts in (1, parts):
        return bucket
    layout = BucketLayout(bucket.layout.shapes, parts)
    return Bucket(bucket.compressor, layout, _relayout(bucket.flat, bucket.layout, layout))


def _done(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


class OuterLoop:
    def __init__(self, config: MuLoCoConfig, named_params: list[tuple[str, torch.nn.Parameter]],
                 canonical: dict[str, str], topology: Topology, tp_rank: int, num_layers: int,
                 log: Callable[[dict, int], None], membership: Membership):
        self.config, self.topology, self.log, self.membership = config, topology, log, membership
        F = config.streaming.fragments
        self.params: list[SyncedParam] = []
        for local_name, p in named_params:
            name = canonical[local_name]
            layout = layout_of(name)
            self.params.append(SyncedParam(name, p, fragment_of(name, num_layers, F),
                                           transposed=layout.partition_dim == 1,
                                           counts_once=layout.partition_dim is not None or tp_rank == 0))
        D = topology.sizes.data
        self.owner = assign_owners([p.param.numel() for p in self.params], D)
        self.owned = [i for i, o in enumerate(self.owner) if o == topology.coords.data]
        on_device = config.outer_state_on_device
        self.global_weights = {i: _state_copy(self.params[i].param, on_device) for i in self.owned}
        self.momentum = {i: torch.zeros_like(self.global_weights[i]) for i in self.owned}
        self.buckets = [self._buckets(fragment) for fragment in range(F)]
        self.offsets = sync_offsets(config.sync_interval, F)
        self.outer_step = 0
        self.skipped = 0
        self.pending: list[_Pending] = []
        self.joining = False  # no pseudogradient of its own to contribute (an elastic start, or a state just loaded)
        self.trainer = None
        self.last_step: int | None = None  # the trainer's last inner step: no sync is prepared past it
        self._state_lock = threading.Lock()  # the outer state: applied by the main thread, read for a peer
        self._background = ThreadPoolExecutor(max_workers=1)  # overlapped syncs and every sync's metrics
        self._statistics: list[Future] = []  # of records whose metrics are being reduced

    def _wire_shape(self, i: int) -> tuple[int, int]:
        shape = self.params[i].param.shape
        return rows_shape(tuple(reversed(shape)) if self.params[i].transposed else shape)

    def _buckets(self, fragment: int) -> list[_BucketSpec]:
        compression = self.config.compression
        parts = self.config.workers if self.config.collective == "reduce_scatter" else 1
        keyed: dict[tuple[str, bool], list[int]] = {}
        for i in self.owned:
            p = self.params[i]
            if p.fragment == fragment:
                group = compression_group(p.param.shape, getattr(p.param, "is_embedding_or_output_parameter", False))
                keyed.setdefault((group, p.counts_once), []).append(i)
        specs = []
        for (group, counts_once), indices in sorted(keyed.items()):
            indices.sort(key=lambda i: self._wire_shape(i)[1])
            config = compression.for_group(group)
            specs.append(_BucketSpec(indices, Compressor(config),
                                     BucketLayout(tuple(self._wire_shape(i) for i in indices), parts), counts_once,
                                     ErrorFeedback.from_config(config, self.config.outer_lr)
                                     if config.error_feedback else None))
        return specs

    # -- step hook --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def attached_to(self, trainer):
        """Join the membership, sync after each of `trainer`'s optimizer steps inside the block
        (`after_inner_step` is looked up at every step, so a wrapper installed later still runs)."""
        self.trainer, self.last_step = trainer, trainer.config.schedule.train_iters
        try:
            self.membership.join(self, trainer)
            handle = trainer.register_step_hook(lambda step: self.after_inner_step(step))
            try:
                yield self
            finally:
                handle.remove()
            self.finish()  # a failed run skips this: its peers may never finish these syncs
        finally:
            self.membership.leave()
            self.close()

    def close(self) -> None:
        """Stop the background thread: queued tasks are dropped, a running one ends (a failed run's
        peers are gone, so its collective fails) and the thread is joined, so none outlives the run."""
        self._background.shutdown(wait=True, cancel_futures=True)

    def finish(self) -> None:
        """At the end of the run: every sync still in flight finishes its collectives (every worker
        launched it; leaving early would strand the others), but lands after the last inner step and
        is not applied; then the metrics of the applied syncs are logged."""
        landing = [entry.future for entry in self.pending]
        for future in landing:
            future.result()
        if landing and self.topology.is_logging_rank:
            print(f"outer loop: {len(landing)} sync(s) launched in the last {self.config.streaming.overlap_steps} "
                  f"step(s) land after the run and are not applied", flush=True)
        self.pending = []
        self.flush_metrics()

    def after_inner_step(self, step: int) -> None:
        self._log_statistics(wait=False)
        with self._state_lock:
            due = [e for e in self.pending if e.apply_at == step]
            self.pending = [e for e in self.pending if e.apply_at != step]
        for entry in due:
            waited = time.perf_counter()
            result = entry.future.result()
            result.record["apply_wait_seconds"] = time.perf_counter() - waited  # what overlap did not hide
            self.apply(result, overlapped=True)
        for fragment, offset in enumerate(self.offsets):
            if step % self.config.sync_interval == offset and not self._moved_from(step):
                self._launch(fragment, step)
        if self._moved_from(step):  # it caught up: its next syncs are its peers' next ones, from their step
            return
        if self.last_step is None or step < self.last_step:
            for offset in self.offsets:
                if (step + 1) % self.config.sync_interval == offset:
                    self.membership.prepare(self._background, step + 1)

    def _moved_from(self, step: int) -> bool:
        """Whether applying a caught-up sync moved this member to its peers' step."""
        return self.trainer is not None and self.trainer.step != step

    def flush_metrics(self) -> None:
        """Wait for the metrics of the applied syncs and log them (every rank, together)."""
        self._log_statistics(wait=True)

    def _log_statistics(self, wait: bool) -> None:
        """Log the records whose metrics have landed (all of them, waiting, with `wait`)."""
        for future in list(self._statistics):
            if wait or future.done():
                self._statistics.remove(future)
                self._log(future.result())

    def _log(self, record: dict) -> None:
        if self.topology.is_logging_rank:
            if self.membership.records_checksum:
                record = {**record, "weights_sha": self.weights_checksum()}
            self.log(record, record["step"])

    # -- one sync ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _launch(self, fragment: int, step: int) -> None:
        deltas = [spec.layout.flatten([self._delta(i) for i in spec.indices]) for spec in self.buckets[fragment]]
        schedule = self.trainer.engine.lr_scheduler.state_dict() if self.trainer is not None else None
        task = SyncTask(fragment, step, self.outer_step + 1, schedule)
        tau = self.config.streaming.overlap_steps
        if tau == 0:
            self.flush_metrics()  # their reduction shares the wires with this sync
            self.apply(self.sync(task, deltas), overlapped=False)
        else:
            self.pending.append(_Pending(step + tau, task, deltas, self._background.submit(self.sync, task, deltas)))

    def _delta(self, i: int) -> torch.Tensor:
        """theta_global - theta_local in fp32 on the parameter's device, as the wire sees it."""
        p = self.params[i].param.detach()
        delta = self.global_weights[i].to(p.device, non_blocking=True) - p.float()
        return (delta.t() if self.params[i].transposed else delta).reshape(self._wire_shape(i))

    def zero_deltas(self, fragment: int) -> list[torch.Tensor]:
        """A fragment's buckets of zeros: what a member with nothing to contribute sends."""
        return [torch.zeros(sum(rows * cols for rows, cols in spec.layout.shapes),
                            device=self.params[spec.indices[0]].param.device) for spec in self.buckets[fragment]]

    def _context(self, outer_step: int) -> str:
        c = self.topology.coords
        return f"outer group of shard (d={c.data}, p={c.pipeline}, t={c.tensor}), outer step {outer_step}"

    @torch.no_grad()
    def sync(self, task: SyncTask, deltas: list[torch.Tensor]) -> SyncResult:
        """One sync through the membership; may run in the background thread, so it reads the outer
        state but changes none of it (the caller applies the result)."""
        start = time.perf_counter(), time.thread_time()
        ballot = vote.ballot(*self._vote_share(self.buckets[task.fragment], deltas))
        if self.membership.ballot_group is not None:
            comm.all_reduce(ballot, group=self.membership.ballot_group)  # the worker's totals, inside the datacenter
        return self.membership.run(self, task, lambda session: self._exchange(session, task, deltas, ballot, start))

    def _exchange(self, session: Session, task: SyncTask, deltas: list[torch.Tensor], ballot: torch.Tensor,
                  start: tuple[float, float]) -> SyncResult:
        caught_up = getattr(session, "caught_up", None)  # this member just received a peer's state and sync
        if caught_up is not None:
            task, deltas, ballot = caught_up, self.zero_deltas(caught_up.fragment), torch.zeros_like(ballot)
        specs, context = self.buckets[task.fragment], self._context(task.outer_step)
        contributing = not session.joining
        if not contributing:  # zeros nobody decodes; its error feedback restarts from zero
            deltas = [torch.zeros_like(d) for d in deltas]
        buckets = [Bucket(spec.compressor, spec.layout,
                          spec.error_feedback.accumulate(d) if spec.error_feedback and contributing else d)
                   for spec, d in zip(specs, deltas)]
        session.wire.begin(task.outer_step, task.fragment, epoch=getattr(session, "epoch", 0))
        # Reduce-scatter cuts each bucket into one chunk per member: a quorum of fewer than K members
        # (elastic) exchanges the buckets re-cut for its size, and the results come back in K chunks.
        cut = [_recut(b, session.wire.size) for b in buckets]
        exchanged = average_buckets(cut, session.wire, self.config.collective, context,
                                    header=session.header(ballot, task.step, task.fragment), choose=session.choose,
                                    max_norm_ratio=self.config.max_norm_ratio, leave_out=session.leave_out)
        exchanged.averaged = [Averaged(_relayout(a.average, c.layout, b.layout), _relayout(a.residual, c.layout, b.layout))
                              for a, c, b in zip(exchanged.averaged, cut, buckets)]
        exchange = session.wire.take_stats()
        decision = session.decide(exchanged)
        record = {"outer_step": task.outer_step, "fragment": task.fragment, "step": task.step, **decision.record,
                  "pseudograd_norm": statistics.fmean(decision.norms) if decision.skipped is None else None,
                  "round_trips": exchange.round_trips, "sync_seconds": time.perf_counter() - start[0],
                  # what the sync's time went to: the (emulated) link, and this thread's own work
                  "link_seconds": exchange.link_seconds, "sync_cpu_seconds": time.thread_time() - start[1]}
        averaged = None
        if decision.skipped is not None:
            record["skipped"] = decision.skipped
        else:
            averaged = exchanged.averaged
            if session.wire.rank not in decision.contributors:  # its error feedback restarts from zero
                averaged = [Averaged(a.average, torch.zeros_like(a.average)) for a in averaged]
        verdict = verdict_digest(exchanged.rejected, decision.skipped)
        per_worker = self.topology.sizes.ranks_per_worker

        def reduce_metrics() -> dict:  # reads the sync's buffers, which nothing changes after the exchange
            local = (LocalSums(verdict=verdict) if averaged is None else
                     self._local_sums(specs, deltas, buckets, averaged, exchange.bytes_sent, verdict))
            rows = session.sums(list(astuple(local)), task.outer_step, task.fragment, context)
            background = {"background_round_trips": session.metrics_wire.take_stats().round_trips}
            if rows is None:
                return {**record, "metrics_lost": True, **background}
            reduced = sync_record(rows, decision.contributors, per_worker,
                                  decision.norms if averaged is not None else [], context)
            return {**record, **reduced, **background}
        # A skipped sync's metrics round runs too: it checks that every worker skipped it.
        return SyncResult(task.fragment, averaged, record, reduce_metrics, caught_up)

    @staticmethod
    def _vote_share(specs: list[_BucketSpec], deltas: list[torch.Tensor]) -> tuple[bool, float]:
        """(any non-finite entry, squared norm) of this rank's share of a fragment's pseudogradient."""
        sq = sum(squared_norm(d) for spec, d in zip(specs, deltas) if spec.counts_once)
        return any(not bool(torch.isfinite(d).all()) for d in deltas), sq

    @staticmethod
    def _local_sums(specs: list[_BucketSpec], deltas: list[torch.Tensor], buckets: list[Bucket],
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

    @torch.no_grad()
    def apply(self, result: SyncResult, overlapped: bool) -> None:
        specs = self.buckets[result.fragment]
        with self._state_lock:
            if result.averaged is None:
                self.skipped += 1
            else:
                c = self.config
                for spec, averaged in zip(specs, result.averaged):
                    if spec.error_feedback:
                        spec.error_feedback.keep(averaged.residual)
                    for i, avg in zip(spec.indices, spec.layout.unflatten(averaged.average)):
                        g = self.global_weights[i]
                        avg = (avg.t() if self.params[i].transposed else avg).reshape(g.shape).to(g.device)
                        g.add_(outer_sgd_direction(avg, self.momentum[i], c.outer_momentum, c.nesterov), alpha=-c.outer_lr)
                self.outer_step += 1
        if result.caught_up is not None:
            self._go_on_from(result.caught_up)
        else:
            self._restart_from_global(result.fragment, self.config.streaming.mix_alpha if overlapped else 0.0)
        if result.statistics is None:
            self._log(result.record)
        else:
            self._statistics.append(self._background.submit(result.statistics))

    def _go_on_from(self, task: SyncTask) -> None:
        """After a sync it caught up to, a member goes on as its peers do: every fragment's local weights
        from the global ones (its own inner steps since its last sync are lost: they started from global
        weights it no longer holds), and from their position at `task` (inner step, engine counters, lr
        schedule). A member that had only missed syncs, on its own step, would launch other fragments
        than its peers: payloads of other sizes in one collective."""
        for fragment in range(len(self.buckets)):
            self._restart_from_global(fragment)
        if self.trainer is None:
            return
        engine = self.trainer.engine
        engine.lr_scheduler.load_state_dict(task.scheduler)
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
        # The trainer's step is the run's one counter (step hooks see it already counting their step);
        # the engine's counters follow it, and the data position is the step.
        self.trainer.step = task.step
        engine.set_step(task.step)

    def _restart_from_global(self, fragment: int, alpha: float = 0.0) -> None:
        """The fragment's local weights := its global weights (mixed with weight alpha of the local ones)."""
        for spec in self.buckets[fragment]:
            for i in spec.indices:
                p = self.params[i].param
                new = self.global_weights[i].to(p.device, p.dtype, non_blocking=True)
                p.copy_(new if alpha == 0.0 else p.mul(alpha).add_(new, alpha=1 - alpha))
        self._share_inside_worker(fragment)

    def _share_inside_worker(self, fragment: int) -> None:
        """The owning replica's new weights to the other D-1 replicas (non-owners add zeros: exact)."""
        if self.topology.sizes.data == 1:
            return
        members = [i for i, p in enumerate(self.params) if p.fragment == fragment]
        if not members:
            return
        flat = torch.cat([self.params[i].param.detach().reshape(-1) if i in self.global_weights
                          else torch.zeros_like(self.params[i].param).reshape(-1) for i in members])
        comm.all_reduce(flat, group=self.topology.inner_dp_group)
        offset = 0
        for i in members:
            p = self.params[i].param
            p.detach().copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def weights_digest(self, fragment: int) -> float:
        """An exact digest of this rank's global weights of one fragment (the sum of their fp32 bit
        patterns as integers, mod 2**52): equal wherever they are bit-identical, on any device."""
        with self._state_lock:
            total = sum(int(self.global_weights[i].view(torch.int32).sum(dtype=torch.int64))
                        for spec in self.buckets[fragment] for i in spec.indices)
        return float(total % (1 << 52))

    def weights_checksum(self) -> str:
        """sha256 of this rank's global weights (fp32 bytes, in parameter order): equal on two
        workers iff their shards are bit-identical."""
        digest = hashlib.sha256()
        for i in sorted(self.global_weights):
            digest.update(self.global_weights[i].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    # -- a peer's state (a member that is behind receives it) ---------------------------------------

    def peer_state(self, task: SyncTask) -> dict:
        """The outer state and the sync `task` for a member that is behind: global weights and outer
        momentum, counters, the results of syncs still in flight (done, not yet applied), and where the
        run stands. Called by the thread running the sync; consistent with the main thread's applies."""
        with self._state_lock:
            return {
                "outer_step": self.outer_step, "skipped": self.skipped,
                "global_weights": {self.params[i].name: w.clone() for i, w in self.global_weights.items()},
                "momentum": {self.params[i].name: m.clone() for i, m in self.momentum.items()},
                "pending": [{"apply_at": e.apply_at, "fragment": e.task.fragment,
                             "averages": [a.average for a in e.future.result().averaged or []],
                             "skipped": e.future.result().averaged is None}
                            for e in self.pending if e.future.done()],
                "sync": {"fragment": task.fragment, "step": task.step, "outer_step": task.outer_step,
                         "scheduler": task.scheduler or self.trainer.engine.lr_scheduler.state_dict()},
            }

    def check_peer_state(self, state: dict) -> list[str]:
        """How a peer's state differs in form from this rank's own (keys, names, shapes, dtypes, counts):
        it is loaded with copy_, which would broadcast a smaller tensor."""
        keys = {"outer_step", "skipped", "global_weights", "momentum", "pending", "sync"}
        if set(state) != keys:
            return [f"keys {sorted(state)} instead of {sorted(keys)}"]
        problems, counts, sync = [], [("outer_step", state["outer_step"]), ("skipped", state["skipped"])], state["sync"]
        if not isinstance(sync, dict) or set(sync) != {"fragment", "step", "outer_step", "scheduler"}:
            problems.append("its sync is not a (fragment, step, outer_step, scheduler) record")
        else:
            counts += [(f"sync.{k}", sync[k]) for k in ("step", "outer_step", "fragment")]
            if isinstance(sync["fragment"], int) and not 0 <= sync["fragment"] < len(self.buckets):
                problems.append(f"sync.fragment {sync['fragment']} is not a fragment of this run")
            schedule = self.trainer.engine.lr_scheduler.state_dict()
            if not isinstance(sync["scheduler"], dict) or set(sync["scheduler"]) != set(schedule):
                problems.append("the lr schedule's state has other keys than this run's")
        problems += [f"{key} {value!r} is not a count" for key, value in counts
                     if not isinstance(value, int) or isinstance(value, bool) or value < 0]
        for key, mine in (("global_weights", self.global_weights), ("momentum", self.momentum)):
            theirs = state[key]
            if not isinstance(theirs, dict) or set(theirs) != {self.params[i].name for i in mine}:
                problems.append(f"{key} holds other parameters than this rank owns")
                continue
            for i, tensor in mine.items():
                t = theirs[self.params[i].name]
                if not isinstance(t, torch.Tensor) or t.dtype != tensor.dtype or t.shape != tensor.shape:
                    problems.append(f"{key}[{self.params[i].name}] is not a {tensor.dtype} tensor of shape "
                                    f"{tuple(tensor.shape)}")
        if not isinstance(state["pending"], list) or not all(self._pending_form(e) for e in state["pending"]):
            problems.append("its in-flight syncs are not (apply_at, fragment, averages, skipped) of this run's buckets")
        return problems

    def _pending_form(self, entry) -> bool:
        if not isinstance(entry, dict) or set(entry) != {"apply_at", "fragment", "averages", "skipped"}:
            return False
        fragment = entry["fragment"]
        if not isinstance(fragment, int) or not 0 <= fragment < len(self.buckets) or not isinstance(entry["apply_at"], int):
            return False
        sizes = [sum(r * c for r, c in spec.layout.shapes) for spec in self.buckets[fragment]]
        averages = entry["averages"]
        return entry["skipped"] is True and averages == [] or entry["skipped"] is False and len(averages) == len(sizes) \
            and all(isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.shape == (n,)
                    for a, n in zip(averages, sizes))

    @torch.no_grad()
    def load_peer_state(self, state: dict) -> SyncTask:
        """Take a peer's outer state (checked by check_peer_state first); its error feedback restarts
        from zero (it held what this member's own payloads did not carry). Returns the sync to take part
        in; applying its result moves the local weights and the run's position to the peers'
        (`_go_on_from`), on the main thread."""
        tau = self.config.streaming.overlap_steps
        sync = state["sync"]
        task = SyncTask(sync["fragment"], sync["step"], sync["outer_step"], sync["scheduler"])
        with self._state_lock:
            names = {self.params[i].name: i for i in self.owned}
            for name, i in names.items():
                self.global_weights[i].copy_(state["global_weights"][name])
                self.momentum[i].copy_(state["momentum"][name])
            self.outer_step, self.skipped = state["outer_step"], state["skipped"]
            for specs in self.buckets:
                for spec in specs:
                    if spec.error_feedback:
                        spec.error_feedback.error = None
            # The peer's syncs that are done but not yet applied replace this member's; its own sync in
            # flight (a member that fell behind mid-run) stays.
            self.pending = [_Pending(e["apply_at"], SyncTask(e["fragment"], e["apply_at"] - tau, 0, None), [],
                                     _done(SyncResult(e["fragment"], None if e["skipped"] else
                                                      [Averaged(a, torch.zeros_like(a)) for a in e["averages"]], {})))
                            for e in state["pending"]] + [e for e in self.pending if not e.future.done()]
        self.joining = True
        return task

    # -- checkpointing -----------------------------------------------------------------------------

    def _error_feedback_state(self) -> dict[str, torch.Tensor]:
        """Error-feedback residuals by parameter name, in wire shape (none before the first sync)."""
        state = {}
        for specs in self.buckets:
            for spec in specs:
                if spec.error_feedback and spec.error_feedback.error is not None:
                    residuals = spec.layout.unflatten(spec.error_feedback.error)
                    state.update({self.params[i].name: r for i, r in zip(spec.indices, residuals)})
        return state

    def state_dict(self) -> dict:
        return {
            "outer_step": self.outer_step, "skipped": self.skipped,
            "global_weights": {self.params[i].name: w for i, w in self.global_weights.items()},
            "momentum": {self.params[i].name: m for i, m in self.momentum.items()},
            "error_feedback": self._error_feedback_state(),
            # In-flight overlapped syncs are replayed on load: the communication is deterministic, and
            # their results (error feedback included) are only applied at apply_at.
            "pending": [{"apply_at": e.apply_at, "fragment": e.task.fragment, "outer_step": e.task.outer_step,
                         "deltas": e.deltas} for e in self.pending],
        }

    def load_state_dict(self, state: dict) -> None:
        owned = {self.params[i].name: i for i in self.owned}
        with_feedback = {self.params[i].name for specs in self.buckets for spec in specs if spec.error_feedback
                         for i in spec.indices}
        feedback = state["error_feedback"]
        if set(state["global_weights"]) != set(owned) or set(state["momentum"]) != set(owned) or (
                feedback and set(feedback) != with_feedback):
            raise ValueError("outer-loop checkpoint holds different parameters than this rank owns")
        for name, i in owned.items():
            self.global_weights[i].copy_(state["global_weights"][name])
            self.momentum[i].copy_(state["momentum"][name])
        for specs in self.buckets:
            for spec in specs:
                if spec.error_feedback and feedback:
                    device = self.params[spec.indices[0]].param.device
                    spec.error_feedback.keep(
                        spec.layout.flatten([feedback[self.params[i].name].to(device) for i in spec.indices]))
        self.outer_step, self.skipped = state["outer_step"], state["skipped"]
        tau = self.config.streaming.overlap_steps
        tasks = [SyncTask(e["fragment"], e["apply_at"] - tau, e["outer_step"], None) for e in state["pending"]]
        if tasks and not self.membership.replays_pending:
            if self.topology.is_logging_rank:
                print(f"outer loop: {len(tasks)} syncs in flight in the checkpoint are dropped: this worker catches up "
                      f"from its peers", flush=True)
            self.pending = []
            return
        self.pending = [_Pending(e["apply_at"], task, e["deltas"], self._background.submit(self.sync, task, e["deltas"]))
                        for e, task in zip(state["pending"], tasks)]
