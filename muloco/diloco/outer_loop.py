"""The MuLoCo / DiLoCo outer loop: when syncs run, and what their results do to the local weights.

It is attached to a host, the training loop that runs the inner steps (`Host` below): this
project's trainer (trainer/outer_host.py) or any DeepSpeed engine (muloco/hook/).
The host calls `after_inner_step(step)` after every optimizer step. What is synced is a list of
tensors with their plan (plan.py); the outer state of the ones this rank owns is outer_state.py's; one
sync is sync.py's body, run through a membership (membership.py: the single world's fixed K workers,
or the elastic mode's torchft quorum, muloco/elastic/membership.py).

With D inner-DP replicas holding the same (replicated) tensors, each replica owns 1/D of them: it alone
keeps their outer state and syncs them with its peers in the other workers, then shares the result
inside its worker. Sharded tensors (ZeRO's partitions) are each rank's own: nothing is shared.

A sync applies Nesterov SGD to the global weights, and every worker restarts from them (or, when the
sync overlapped tau inner steps, mixes them into its local weights with weight alpha); inner optimizer
state is kept. With `streaming.overlap_steps` > 0 a sync runs in a background thread while the inner
steps go on, and its result is applied tau steps after it started; `"auto"` picks each sync's tau
from the fragment's previous sync (`_overlap`). At the run's last step (`final_sync`) the syncs in flight
are applied and every fragment whose local weights moved since it last took the global ones syncs once
more, so the run ends with one model on every worker. The background thread runs one
task at a time (syncs and metrics in the order every rank submits them), on the outer loop's own
groups, so it never interleaves with the training loop's collectives. One inner step before a sync
launches, the membership is told (`prepare`): the elastic one asks for its quorum then.

With wall-clock pacing (`pace.mode: "wall_clock"`, pace.py) a worker ends an interval at its deadline
or after H steps, moves to the sync's step (`Host.skip_to`) and syncs with its interval's contribution
in the header; the merge weights contributions by tokens and the outer momentum takes the correction
for unequal step counts. `emulate_slowdown` makes a worker sleep after each inner step (benchmarks).

A member that is behind (the elastic mode) receives a peer's snapshot first (snapshot.py: the same
form a checkpoint has), then goes on from the peers' position (the host's step and lr schedule).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from muloco.core import comm
from muloco.diloco.collectives import Averaged
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.membership import Membership
from muloco.diloco.outer_state import OuterState
from muloco.diloco.pace import Pacer
from muloco.diloco.auth import JobKey
from muloco.diloco.plan import SyncedTensor, owned_by, plan_buckets, plan_signature, sync_offsets
from muloco.diloco.snapshot import (CATCH_UP, CHECKPOINT, Form, Identity, InFlight, Joins, Snapshot, SnapshotError,
                                    identity_problems)
from muloco.diloco.sync import SyncBody, SyncResult, SyncTask
from muloco.core.topology import Topology


class Host(Protocol):
    """What the outer loop asks of the training loop it is attached to."""
    last_step: int | None  # the run's last inner step, when known: no sync is prepared past it

    def inner_step(self) -> int:
        """Optimizer steps taken (the run's position; the data stream follows it)."""

    def schedule_state(self) -> dict | None:
        """The lr schedule's state_dict (None: the host has no schedule)."""

    def go_on_from(self, step: int, schedule: dict | None) -> None:
        """Move the run to a peer's position: its inner step and lr schedule (a member that caught up)."""

    def weights_written(self) -> None:
        """The outer loop wrote the local weights outside an optimizer step's own update: refresh
        whatever the host derives from them (DeepSpeed's bf16 copies of its fp32 master partitions)."""

    # Wall-clock pacing only (pace.py):
    tokens_per_step: float  # what one inner step of this worker consumes (only ratios between workers matter)

    def inner_lr(self) -> float:
        """The lr the coming inner step uses (the first parameter group's: only ratios matter)."""

    def skip_to(self, step: int) -> list[float]:
        """Move the run forward to `step` as if the steps in between were taken (the lr schedule steps,
        the data position follows the step); the lrs those steps would have used."""


AUTO_FIRST_OVERLAP = 1  # `overlap_steps: "auto"`: a fragment's first sync, before any timing is known
AUTO_MARGIN = 1.25  # ... later ones cover the slowest worker's last sync of the fragment with this margin


@dataclass
class _Pending:
    apply_at: int
    task: SyncTask
    deltas: list[torch.Tensor]  # one flat buffer per bucket, kept so a checkpoint can replay the sync
    future: Future  # of a SyncResult


def _done(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


class OuterLoop:
    def __init__(self, config: MuLoCoConfig, tensors: list[SyncedTensor], topology: Topology,
                 log: Callable[[dict, int], None], membership: Membership, replicated: bool = True,
                 key: JobKey | None = None, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        """`tensors` (plan.synced_tensors) are replicated over the worker's inner-DP replicas
        (`replicated`), or each rank's own shard. `key`: the job secret, whose tag the snapshots carry.
        `clock` times the inner steps, the syncs and the pacing's deadlines; `sleep` waits out an emulated
        slowdown."""
        self.config, self.topology, self.log, self.membership, self.key = config, topology, log, membership, key
        self.tensors, self.replicated = tensors, replicated
        F = config.streaming.fragments
        owned = owned_by(tensors, topology.sizes.data, topology.coords.data, replicated)
        self.state = OuterState(tensors, owned, config.outer_state_on_device)
        self.buckets = [plan_buckets(tensors, owned, fragment, config) for fragment in range(F)]
        self.offsets = sync_offsets(config.sync_interval, F)
        device = tensors[0].tensor.device if tensors else comm.compute_device()
        self.clock, self.sleep = clock, sleep
        self.slowdown = config.emulate_slowdown[topology.coords.worker] if config.emulate_slowdown else 1.0
        self.pacer = Pacer(config.pace, config.sync_interval) if config.pace.paced else None
        self.body = SyncBody(config, self.buckets, device, membership, topology.sizes.ranks_per_worker, self._context,
                             clock)
        self.pending: list[_Pending] = []
        self.auto_overlap = config.streaming.overlap_steps == "auto"
        self._step_seconds: deque[float] = deque(maxlen=config.sync_interval)  # recent inner steps' wall time
        self._step_started: float | None = None
        self._timings: dict[int, Future] = {}  # fragment -> the metrics of its last applied sync (auto overlap)
        self.joining = False  # no pseudogradient of its own to contribute (an elastic start, or a state just loaded)
        self._hold_global: set[int] = set()  # fragments whose local weights are the global ones since the last step
        self.host: Host | None = None
        self._background = ThreadPoolExecutor(max_workers=1)  # overlapped syncs and every sync's metrics
        self._statistics: list[Future] = []  # of records whose metrics are being reduced

    # -- attaching ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def attached(self, host: Host):
        """Join the membership; inside the block the host calls `after_inner_step` after each
        optimizer step; on a clean exit the syncs in flight finish; on any exit it leaves."""
        self.host = host
        try:
            self.membership.join(self)
            if self.pacer is not None:
                self.pacer.start(self.clock(), host.inner_lr())
            yield self
            self.finish()  # a failed run skips this: its peers may never finish these syncs
        finally:
            self.membership.leave()
            self.close()

    def close(self) -> None:
        """Stop the background thread: queued tasks are dropped, a running one ends (a failed run's
        peers are gone, so its collective fails) and the thread is joined, so none outlives the run."""
        self._background.shutdown(wait=True, cancel_futures=True)

    def finish(self) -> None:
        """At the end of the run: every sync still in flight (none after a final sync) finishes its
        collectives (every worker launched it; leaving early would strand the others), but lands after
        the last inner step and is not applied; then the metrics of the applied syncs are logged."""
        landing = [entry.future for entry in self.pending]
        for future in landing:
            future.result()
        if landing and self.topology.is_logging_rank:
            print(f"outer loop: {len(landing)} sync(s) still in flight at the last step land after the run and "
                  f"are not applied", flush=True)
        self.pending = []
        self.flush_metrics()

    # -- the step hook -----------------------------------------------------------------------------

    def after_inner_step(self, step: int) -> None:
        if self._step_started is not None:  # the inner step's own time, without the outer loop's
            if self.slowdown != 1.0:  # an emulated slow worker: its step takes `slowdown` times as long
                self.sleep((self.slowdown - 1.0) * (self.clock() - self._step_started))
            self._step_seconds.append(self.clock() - self._step_started)
        if self.pacer is not None:
            step = self._paced(step)
        self._hold_global.clear()  # the inner step moved every fragment's local weights
        self._log_statistics(wait=False)
        with self.state.lock:
            due = [e for e in self.pending if e.apply_at == step]
            self.pending = [e for e in self.pending if e.apply_at != step]
        for entry in due:
            self._apply_pending(entry)
        for fragment, offset in enumerate(self.offsets):
            if step % self.config.sync_interval == offset and not self._moved_from(step):
                self._launch(fragment, step)
        last = self.host.last_step if self.host is not None else None
        if step == last and self.config.final_sync:
            self._final_sync(step)
        elif not self._moved_from(step) and (last is None or step < last):  # (one that caught up: its next
            # syncs are its peers' next ones)
            syncs_next = any((step + 1) % self.config.sync_interval == offset for offset in self.offsets)
            if syncs_next or (step + 1 == last and self.config.final_sync):
                self.membership.prepare(self._background, step + 1)
        self._step_started = self.clock()

    def _paced(self, step: int) -> int:
        """Wall-clock pacing: the step the run is at after inner step `step`, the sync's own step when
        this worker's deadline has come (it moves there: `Host.skip_to`)."""
        self.pacer.stepped(self.host.inner_lr())
        sync_step = self._sync_step_from(step)
        if sync_step is None or sync_step == step or not self.pacer.due(self.clock(), self._recent_step_seconds()):
            return step
        self.pacer.skipped(self.host.skip_to(sync_step))
        return sync_step

    def _sync_step_from(self, step: int) -> int | None:
        """The step of the next sync at or after `step` (F = 1): the next multiple of H, or the run's
        final sync; None when the run ends before another sync."""
        interval, last = self.config.sync_interval, self.host.last_step
        next_sync = -(-step // interval) * interval
        if last is not None and last < next_sync:
            return last if self.config.final_sync else None
        return next_sync

    def _recent_step_seconds(self) -> float:
        return statistics.median(self._step_seconds) if self._step_seconds else 0.0

    def _apply_pending(self, entry: _Pending) -> None:
        waited = time.perf_counter()
        result = entry.future.result()
        result.record["apply_wait_seconds"] = time.perf_counter() - waited  # what overlap did not hide
        if self.auto_overlap:
            result.record["overlap_steps"] = entry.apply_at - entry.task.step
        self.apply(result, overlapped=True)

    def _final_sync(self, step: int) -> None:
        """The run's last step: the syncs in flight land and are applied now, then every fragment whose
        local weights are not the global ones syncs once more, blocking (every worker reaches the same last
        step, so every worker launches the same syncs), so each worker ends holding the global weights:
        the run's last checkpoint and its final validation are of one model."""
        with self.state.lock:
            landing, self.pending = self.pending, []
        for entry in landing:
            self._apply_pending(entry)
        for fragment in range(len(self.buckets)):
            if fragment not in self._hold_global and not self._moved_from(step):
                self._launch(fragment, step, final=True)

    def _moved_from(self, step: int) -> bool:
        """Whether applying a caught-up sync moved this member to its peers' step."""
        return self.host is not None and self.host.inner_step() != step

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
                record = {**record, "weights_sha": self.state.checksum()}
            self.log(record, record["step"])

    # -- one sync ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _launch(self, fragment: int, step: int, final: bool = False) -> None:
        """Start the fragment's sync after inner step `step`; a `final` one is blocking."""
        deltas = [spec.packing.flatten([self.state.delta(i) for i in spec.indices]) for spec in self.buckets[fragment]]
        schedule = self.host.schedule_state() if self.host is not None else None
        step_seconds = self._recent_step_seconds()
        contribution = self.pacer.contribution(self.clock(), self.host.tokens_per_step) if self.pacer else None
        task = SyncTask(fragment, step, self.state.outer_step + 1, schedule, step_seconds, contribution,
                        self.weights_digest(fragment))
        tau = 0 if final else self._overlap(fragment)
        if tau == 0:
            self.flush_metrics()  # their reduction shares the wires with this sync
            result = self.sync(task, deltas)
            if final:
                result.record["final_sync"] = True
            self.apply(result, overlapped=False)
            if self.pacer is not None:  # the next interval starts when this sync has ended
                self.pacer.start(self.clock(), self.host.inner_lr())
        else:
            self.pending.append(_Pending(step + tau, task, deltas, self._background.submit(self.sync, task, deltas)))

    def _overlap(self, fragment: int) -> int:
        """tau for the fragment's next sync. `auto`: the smallest number of inner steps that covers its
        last sync's wall time on the slowest worker (with a margin), from the metrics every worker
        reduced alike, so every worker picks the same tau (and applies the result at the same step)."""
        streaming = self.config.streaming
        if not self.auto_overlap:
            return streaming.overlap_steps
        timing = self._timings.get(fragment)
        needed = timing.result().get("overlap_needed") if timing is not None else None
        if needed is None:  # its first sync (or its metrics were lost: an elastic member left)
            return AUTO_FIRST_OVERLAP
        return max(1, min(streaming.max_overlap_steps, math.ceil(AUTO_MARGIN * needed)))

    def sync(self, task: SyncTask, deltas: list[torch.Tensor]) -> SyncResult:
        """One sync through the membership (sync.py); may run in the background thread."""
        return self.body.sync(task, deltas)

    def zero_deltas(self, fragment: int) -> list[torch.Tensor]:
        return self.body.zero_deltas(fragment)

    def _context(self, outer_step: int) -> str:
        c = self.topology.coords
        return f"outer group of shard (d={c.data}, p={c.pipeline}, t={c.tensor}), outer step {outer_step}"

    @torch.no_grad()
    def apply(self, result: SyncResult, overlapped: bool) -> None:
        specs, state, c = self.buckets[result.fragment], self.state, self.config
        with state.lock:
            if result.averaged is None:
                state.skipped += 1
            else:
                # pace.py's correction: the momentum decays per interval's worth of accumulated inner lr
                mu = c.outer_momentum if result.momentum_exponent == 1.0 else c.outer_momentum ** result.momentum_exponent
                for spec, averaged in zip(specs, result.averaged):
                    if spec.error_feedback:
                        spec.error_feedback.keep(averaged.residual)
                    for i, average in zip(spec.indices, spec.packing.unflatten(averaged.average)):
                        state.take_step(i, average, c.outer_lr, mu, c.nesterov)
                state.outer_step += 1
        if self.pacer is not None:  # (also an elastic member's first sync, which the membership applies)
            self.pacer.synced(result.contributions or [])
        if result.caught_up is not None:
            self._go_on_from(result.caught_up)
        else:
            self._restart_from_global([result.fragment], c.streaming.mix_alpha if overlapped else 0.0)
        if result.statistics is None:
            self._log(result.record)
        else:
            self._statistics.append(self._background.submit(result.statistics))
            self._timings[result.fragment] = self._statistics[-1]

    def _go_on_from(self, task: SyncTask) -> None:
        """After a sync it caught up to, a member goes on as its peers do: every fragment's local weights
        from the global ones (its own inner steps since its last sync are lost: they started from global
        weights it no longer holds), and from their position at `task` (inner step, lr schedule). A
        member that had only missed syncs, on its own step, would launch other fragments than its
        peers: payloads of other sizes in one collective."""
        self._restart_from_global(list(range(len(self.buckets))))
        if self.host is not None:
            self.host.go_on_from(task.step, task.scheduler)

    def _restart_from_global(self, fragments: list[int], alpha: float = 0.0) -> None:
        """The fragments' local weights := their global weights (mixed with weight alpha of the local ones)."""
        if alpha == 0.0:
            self._hold_global.update(fragments)
        for fragment in fragments:
            for spec in self.buckets[fragment]:
                for i in spec.indices:
                    t = self.tensors[i].tensor
                    new = self.state.global_weights[i].to(t.device, t.dtype, non_blocking=True)
                    t.copy_(new if alpha == 0.0 else t.mul(alpha).add_(new, alpha=1 - alpha))
            self._share_inside_worker(fragment)
        if self.host is not None:
            self.host.weights_written()

    def _share_inside_worker(self, fragment: int) -> None:
        """The owning replica's new weights to the other D-1 replicas (non-owners add zeros: exact)."""
        if not self.replicated or self.topology.sizes.data == 1:
            return
        members = [i for i, t in enumerate(self.tensors) if t.fragment == fragment]
        if not members:
            return
        owned = self.state.global_weights
        flat = torch.cat([self.tensors[i].tensor.detach().reshape(-1) if i in owned
                          else torch.zeros_like(self.tensors[i].tensor).reshape(-1) for i in members])
        comm.all_reduce(flat, group=self.topology.inner_dp_group)
        offset = 0
        for i in members:
            t = self.tensors[i].tensor
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def weights_digest(self, fragment: int) -> float:
        """An exact digest of this rank's global weights of one fragment (outer_state.OuterState.digest)."""
        return self.state.digest([i for spec in self.buckets[fragment] for i in spec.indices])

    # -- the snapshot: checkpoints, and a member that is behind -------------------------------------

    def identity(self) -> Identity:
        """Who this rank is, as its snapshots say."""
        sizes, c = self.topology.sizes, self.topology.coords
        return Identity(self.config.auth.job_id if self.config.talks and self.config.auth != "none" else "",
                        self.key.snapshot_tag() if self.key is not None else "", c.worker, self.topology.rank,
                        (self.config.workers, sizes.data, sizes.pipeline, sizes.tensor),
                        plan_signature(self.tensors).hex())

    def form(self) -> Form:
        """What this rank's snapshots look like (checked on load: they are loaded with copy_)."""
        state = self.state
        with_feedback = [i for specs in self.buckets for spec in specs if spec.error_feedback for i in spec.indices]
        schedule = self.host.schedule_state() if self.host is not None else None
        return Form({self.tensors[i].name: (w.dtype, tuple(w.shape)) for i, w in state.global_weights.items()},
                    {self.tensors[i].name: tuple(self.tensors[i].wire_shape) for i in with_feedback},
                    [[spec.numel for spec in specs] for specs in self.buckets],
                    None if schedule is None else frozenset(schedule))

    def snapshot(self, kind: str = CHECKPOINT, joins: SyncTask | None = None) -> Snapshot:
        """This rank's outer state (tensors shared, not copied: save or send it before the next sync
        applies). A checkpoint holds the error feedback and every sync in flight with what this rank sent
        (replayed on load); a catch-up for a member behind (`joins`: the sync it takes part in) the landed
        syncs' results instead; it is taken by the thread running that sync, consistent with the main
        thread's applies."""
        state = self.state
        with state.lock:
            tensors = state.tensors_by_name()
            if kind == CHECKPOINT:
                in_flight = [InFlight(e.task.fragment, e.task.step, e.apply_at, e.task.outer_step, e.deltas)
                             for e in self.pending]
                feedback = self._error_feedback_state()
            else:  # a peer's copy: the tensors are cloned, the main thread applies on
                tensors = {key: {n: t.clone() for n, t in part.items()} for key, part in tensors.items()}
                in_flight = [InFlight(e.task.fragment, e.task.step, e.apply_at, e.task.outer_step, [],
                                      None if e.future.result().averaged is None
                                      else [a.average for a in e.future.result().averaged])
                             for e in self.pending if e.future.done()]
                feedback = {}
            overlap_needed = ({f: float(t.result().get("overlap_needed") or 0.0) for f, t in sorted(self._timings.items())}
                              if self.auto_overlap else {})
            step = self.host.inner_step() if self.host is not None else (joins.step if joins else 0)
            return Snapshot(kind, self.identity(), step, state.outer_step, state.skipped, tensors["global_weights"],
                            tensors["momentum"], feedback, in_flight, overlap_needed,
                            self.pacer.deadline if self.pacer is not None else None,
                            None if joins is None else Joins(joins.fragment, joins.step, joins.outer_step,
                                                             joins.scheduler or (self.host.schedule_state()
                                                                                 if self.host else None)))

    def read_snapshot(self, tree, kind: str, source: str) -> Snapshot:
        """The snapshot in `tree`, checked against this rank's form and identity (SnapshotError naming
        `source` otherwise): a checkpoint must be this rank's own, a catch-up a peer's of this job and plan."""
        snapshot = Snapshot.from_tree(tree, self.form(), source)
        problems = [] if snapshot.kind == kind else [f"it is a {snapshot.kind} snapshot, not a {kind} one"]
        problems += identity_problems(snapshot.identity, self.identity(), kind)
        if kind == CHECKPOINT and self.host is not None and snapshot.step != self.host.inner_step():
            problems.append(f"it was taken at inner step {snapshot.step}, but the run is at step "
                            f"{self.host.inner_step()}: the outer state and the model's checkpoint are of different "
                            f"steps")
        if problems:
            raise SnapshotError(f"{source} is refused: " + "; ".join(problems))
        return snapshot

    @torch.no_grad()
    def load_snapshot(self, snapshot: Snapshot) -> SyncTask | None:
        """Take a checked snapshot (`read_snapshot`). A checkpoint: its error feedback and in-flight syncs
        (replayed, unless the membership catches a restarted worker up from its peers instead); returns
        None. A peer's catch-up: its error feedback restarts from zero (it held what this member's own
        payloads did not carry), the peer's landed syncs replace this member's (its own sync in flight,
        of a member that fell behind mid-run, stays); returns the sync to take part in, whose result
        moves the local weights and the run's position to the peers' (`_go_on_from`)."""
        with self.state.lock:
            self.state.load_tensors(snapshot)
            if snapshot.kind == CATCH_UP:
                self._keep_error_feedback({})
                self.pending = [_Pending(e.apply_at, SyncTask(e.fragment, e.launched_at, e.outer_step, None), [],
                                         _done(SyncResult(e.fragment, None if e.averages is None else
                                                          [Averaged(a, torch.zeros_like(a)) for a in e.averages], {})))
                                for e in snapshot.in_flight] + [e for e in self.pending if not e.future.done()]
                self.joining = True
                j = snapshot.joins
                return SyncTask(j.fragment, j.step, j.outer_step, j.scheduler)
        self._keep_error_feedback(snapshot.error_feedback)
        if self.pacer is not None and snapshot.pace_deadline_s is not None:
            self.pacer.deadline = snapshot.pace_deadline_s
        if self.auto_overlap:
            self._timings = {f: _done({"overlap_needed": needed or None}) for f, needed in snapshot.overlap_needed.items()}
        tasks = [SyncTask(e.fragment, e.launched_at, e.outer_step, None) for e in snapshot.in_flight]
        if tasks and not self.membership.replays_pending:
            if self.topology.is_logging_rank:
                print(f"outer loop: {len(tasks)} syncs in flight in the checkpoint are dropped: this worker catches up "
                      f"from its peers", flush=True)
            self.pending = []
            return None
        self.pending = [_Pending(e.apply_at, task, e.deltas, self._background.submit(self.sync, task, e.deltas))
                        for e, task in zip(snapshot.in_flight, tasks)]
        return None

    def _error_feedback_state(self) -> dict[str, torch.Tensor]:
        """Error-feedback residuals by tensor name, in wire shape (none before the first sync)."""
        state = {}
        for specs in self.buckets:
            for spec in specs:
                if spec.error_feedback and spec.error_feedback.error is not None:
                    residuals = spec.packing.unflatten(spec.error_feedback.error)
                    state.update({self.tensors[i].name: r for i, r in zip(spec.indices, residuals)})
        return state

    def _keep_error_feedback(self, residuals: dict[str, torch.Tensor]) -> None:
        """Every bucket's error feedback from `residuals` by name (empty: restart from zero)."""
        for specs in self.buckets:
            for spec in specs:
                if not spec.error_feedback:
                    continue
                if not residuals:
                    spec.error_feedback.error = None
                    continue
                device = self.tensors[spec.indices[0]].tensor.device
                spec.error_feedback.keep(spec.packing.flatten([residuals[self.tensors[i].name].to(device)
                                                               for i in spec.indices]))

    # The trainer's checkpoints hold the snapshot as one of its extra components (trainer/checkpoint/).
    def state_dict(self) -> dict:
        return self.snapshot(CHECKPOINT).to_tree()

    def state_problems(self, tree) -> list[str]:
        try:
            self.read_snapshot(tree, CHECKPOINT, "the outer loop's state")
        except SnapshotError as err:
            return [str(err)]
        return []

    def load_state_dict(self, tree) -> None:
        self.load_snapshot(self.read_snapshot(tree, CHECKPOINT, "the outer loop's state"))
