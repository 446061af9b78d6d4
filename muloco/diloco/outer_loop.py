"""The MuLoCo / DiLoCo outer loop: when syncs run, and what their results do to the local weights.

It is attached to a host, the training loop that runs the inner steps (host.py): this project's
trainer (trainer/outer_host.py) or any DeepSpeed engine (muloco/hook/).
The host calls `after_inner_step(step)` after every optimizer step. What is synced is a list of
tensors with their plan (plan.py); the outer state of the ones this rank owns is outer_state.py's; one
sync is sync.py's body, run through a membership (membership.py: the single world's fixed K workers,
or the elastic mode's torchft quorum, muloco/elastic/membership.py).

With D inner-DP replicas holding the same (replicated) tensors, each replica owns 1/D of them: it alone
keeps their outer state and syncs them with its peers in the other workers, then shares the result
inside its worker (local_weights.py). Sharded tensors (ZeRO's partitions) are each rank's own.

A sync applies Nesterov SGD to the global weights, and every worker restarts from them (or, when the
sync overlapped tau inner steps, mixes them into its local weights with weight alpha); inner optimizer
state is kept. With `streaming.overlap_steps` > 0 a sync runs in a background thread while the inner
steps go on, and its result is applied tau steps after it started; `"auto"` picks each sync's tau
from the fragment's previous sync (plan.auto_overlap_steps). At the run's last step (`final_sync`) the syncs in flight
are applied and every fragment whose local weights moved since it last took the global ones syncs once
more, so the run ends with one model on every worker. The background thread runs one
task at a time (syncs and metrics in the order every rank submits them), on the outer loop's own
groups, so it never interleaves with the training loop's collectives. One inner step before a sync
launches, the membership is told (`prepare`): the elastic one asks for its quorum then.

With wall-clock pacing (`pace.mode: "wall_clock"`, pace.py) a worker ends an interval at its deadline
or after H steps, moves to the sync's step (`Host.skip_to`) and syncs with its interval's contribution
in the header; the merge weights contributions by tokens and the outer momentum takes the correction
for unequal step counts. `emulate_slowdown` makes a worker sleep after each inner step (benchmarks).

Checkpoints, and a member that is behind (the elastic mode), take the loop's state as one snapshot
(loop_snapshot.py, snapshot.py); a member that caught up goes on from its peers' position.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from muloco.core import comm
from muloco.core.topology import Topology
from muloco.diloco import loop_snapshot
from muloco.diloco.auth import JobKey
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.host import Host
from muloco.diloco.local_weights import LocalWeights
from muloco.diloco.membership import Membership
from muloco.diloco.outer_state import OuterState
from muloco.diloco.pace import Pacer, next_sync_step
from muloco.diloco.plan import SyncedTensor, auto_overlap_steps, owned_by, plan_buckets, sync_offsets
from muloco.diloco.snapshot import CHECKPOINT, Snapshot, SnapshotError
from muloco.diloco.sync import PendingSync, SyncBody, SyncResult, SyncTask


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
        self.local = LocalWeights(tensors, self.state, self.buckets, topology, replicated)
        self.offsets = sync_offsets(config.sync_interval, F)
        device = tensors[0].tensor.device if tensors else comm.compute_device()
        self.clock, self.sleep = clock, sleep
        self.slowdown = config.emulate_slowdown[topology.coords.worker] if config.emulate_slowdown else 1.0
        self.pacer = Pacer(config.pace, config.sync_interval) if config.pace.paced else None
        self.body = SyncBody(config, self.buckets, device, membership, topology.sizes.ranks_per_worker, self._context,
                             clock)
        self.pending: list[PendingSync] = []
        self.auto_overlap = config.streaming.overlap_steps == "auto"
        self._step_seconds: deque[float] = deque(maxlen=config.sync_interval)  # recent inner steps' wall time
        self._step_started: float | None = None
        self.timings: dict[int, Future] = {}  # fragment -> the metrics of its last applied sync (auto overlap)
        self.joining = False  # no pseudogradient of its own to contribute (an elastic start, or a state just loaded)
        self.host: Host | None = None
        self.background = ThreadPoolExecutor(max_workers=1)  # overlapped syncs and every sync's metrics
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
        self.background.shutdown(wait=True, cancel_futures=True)

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
        self.local.hold_global.clear()  # the inner step moved every fragment's local weights
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
                self.membership.prepare(self.background, step + 1)
        self._step_started = self.clock()

    def _paced(self, step: int) -> int:
        """Wall-clock pacing: the step the run is at after inner step `step`, the sync's own step when
        this worker's deadline has come (it moves there: `Host.skip_to`)."""
        self.pacer.stepped(self.host.inner_lr())
        sync_step = next_sync_step(step, self.config.sync_interval, self.host.last_step, self.config.final_sync)
        if sync_step is None or sync_step == step or not self.pacer.due(self.clock(), self._recent_step_seconds()):
            return step
        self.pacer.skipped(self.host.skip_to(sync_step))
        return sync_step

    def _recent_step_seconds(self) -> float:
        return statistics.median(self._step_seconds) if self._step_seconds else 0.0

    def _apply_pending(self, entry: PendingSync) -> None:
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
            if fragment not in self.local.hold_global and not self._moved_from(step):
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
            self.pending.append(PendingSync(step + tau, task, deltas, self.background.submit(self.sync, task, deltas)))

    def _overlap(self, fragment: int) -> int:
        """tau for the fragment's next sync. `auto`: the smallest number of inner steps that covers its
        last sync's wall time on the slowest worker (with a margin), from the metrics every worker
        reduced alike, so every worker picks the same tau (and applies the result at the same step)."""
        streaming = self.config.streaming
        if not self.auto_overlap:
            return streaming.overlap_steps
        timing = self.timings.get(fragment)
        return auto_overlap_steps(timing.result().get("overlap_needed") if timing is not None else None,
                                  streaming.max_overlap_steps)

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
            self._statistics.append(self.background.submit(result.statistics))
            self.timings[result.fragment] = self._statistics[-1]

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
        self.local.restart_from_global(fragments, alpha)
        if self.host is not None:
            self.host.weights_written()

    def weights_digest(self, fragment: int) -> float:
        """An exact digest of this rank's global weights of one fragment (outer_state.OuterState.digest)."""
        return self.state.digest([i for spec in self.buckets[fragment] for i in spec.indices])

    # -- the snapshot: checkpoints, and a member that is behind (loop_snapshot.py) ---------------------

    def snapshot(self, kind: str = CHECKPOINT, joins: SyncTask | None = None) -> Snapshot:
        return loop_snapshot.take(self, kind, joins)

    def read_snapshot(self, tree, kind: str, source: str) -> Snapshot:
        return loop_snapshot.read(self, tree, kind, source)

    def load_snapshot(self, snapshot: Snapshot) -> SyncTask | None:
        return loop_snapshot.restore(self, snapshot)

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
