"""The MuLoCo outer loop on a fault-tolerant outer group: one job per worker (datacenter).

Each outer sync (every H inner steps, as in trainer.diloco.outer_loop) on every rank:
1. quorum: the workers that are alive and at the sync (torchft lighthouse);
2. membership: every member publishes (worker id, inner step, joining, non-finite, squared norm,
   committed syncs), tagged under the job secret; a member whose row fails its tag is left out;
3. state transfer: a member that has committed fewer syncs than the others (it restarted) receives
   the outer state from the first member that has them all, over the quorum's group, tagged, as
   safetensors (nothing received is unpickled), and is checked against its own shapes before it is
   loaded;
4. all ranks agree who contributes (trainer.elastic.membership): K_eff members; the compressed
   average over them (the others send zeros nobody decodes, and receive the average), whose payloads
   are checked as trainer/diloco/collectives.py says (a payload that fails is left out, on every
   member alike), bit-identical on every member, and the sync's metrics over them;
4. commit: every rank of the worker agrees the sync finished; then the Nesterov outer step as in
   the static loop. A failed attempt (a peer died, or stalled past `muloco.sync_timeout_s`) is
   retried with a fresh quorum on the same pseudogradient, so the survivors apply every outer step
   exactly once; after `elastic.max_attempts` failures the job stops.

State transfer to a (re)joining worker, from a live peer over the quorum's group: global
weights and outer momentum of the rank's shard, the outer step and skip counts, the inner step (so
it reads exactly the samples its worker id reads at that step), the engine's step counters and the
lr schedule. Its inner optimizer state stays its own (fresh, or from its --load checkpoint). Its
error-feedback buffers restart from zero: they held what its own earlier payloads did not carry,
which the peers' state already moved past. A member left out of a sync restarts its error feedback
from zero as well (its pseudogradient is dropped, residual included).

Restrictions (checked in trainer.elastic.config): one fragment, no overlap, the all_gather
collective, the gloo outer backend. One known gap: when a peer dies in the middle of the last
collective, one survivor may commit a sync another one retries; the one left behind then heals
from the other at the next quorum (torchft compares their committed-sync counts), losing its inner
steps since.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import statistics
import time
from datetime import timedelta

import torch

from trainer import comm
from trainer.checkpoint.rank_file import RankFileError, state_from_bytes, state_to_bytes
from trainer.diloco.collectives import Averaged, Bucket, CollectiveError, Wire, average_buckets
from trainer.diloco.outer_loop import OuterLoop, SyncResult
from trainer.diloco.sync_metrics import sync_record, verdict_digest
from trainer.elastic.membership import Member, left_out
from trainer.elastic.quorum import QuorumGroup

# What a failed attempt raises: our collectives (CollectiveError), a state that fails its checks
# (RankFileError), torchft's quorum (RuntimeError, TimeoutError).
_ATTEMPT_FAILURES = (CollectiveError, RankFileError, RuntimeError, TimeoutError)
# Bytes a peer's serialized state may hold beyond the tensors this rank owns (its JSON tree and header).
_STATE_SLACK_BYTES = 16 << 20
_START_POLL_S = 1.0


class _WaitingForPeers(Exception):
    """A fresh run's first quorum does not yet hold every worker."""


class _ContributorSums:
    """trainer.diloco.sync_metrics' view of a quorum: each contributor's sums over its worker's ranks
    (a sum inside the worker, then an all-gather over the quorum)."""

    def __init__(self, wire: Wire, worker_group, ranks_per_worker: int, contributors: list[int]):
        self.wire, self.worker_group, self.contributors = wire, worker_group, contributors
        self.ranks_per_worker = ranks_per_worker
        self.size = len(contributors) * ranks_per_worker  # ranks whose bytes are averaged

    def per_member(self, values: list[float], context: str) -> list[list[float] | None]:
        """Every quorum member's values summed over its ranks (None: its tag failed)."""
        local = torch.tensor(values, dtype=torch.float64)
        if self.ranks_per_worker > 1:
            comm.all_reduce(local, group=self.worker_group)
        return self.wire.all_gather_floats(local.tolist(), context)

    def sum_per_worker(self, values, workers, context) -> list[list[float]]:
        rows = self.per_member(list(values), context)
        return [rows[i] or [0.0] * len(values) for i in self.contributors]


class ElasticOuterLoop(OuterLoop):
    """`with outer.attached_to(trainer): trainer.train()` joins the outer group before the first inner
    step, syncs after every H steps, and leaves the group on exit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.elastic = self.config.elastic
        self.worker = self.topology.coords.worker
        self.quorum: QuorumGroup | None = None
        self._trainer = None
        self._joining = False  # no pseudogradient of its own to contribute (start, or state just loaded)
        self._rejoined = False  # the state came from a peer in this sync
        self._start_deadline = 0.0
        log = self.log
        self.log = lambda record, step: log({**record, "weights_sha": self.weights_checksum()}, step)

    def _build_groups(self, timeout):
        return None, None, None  # the quorum's group is configured per sync (QuorumGroup)

    # -- joining and leaving ---------------------------------------------------------------------

    @contextlib.contextmanager
    def attached_to(self, trainer):
        self.join(trainer)
        try:
            with super().attached_to(trainer):
                yield self
        finally:
            self.leave()

    @torch.no_grad()
    def join(self, trainer) -> None:
        """Enter the outer group before the first inner step. A fresh run waits (up to
        quorum_timeout_s) until all K workers are in the first quorum; a restarted worker waits for
        its peers' next sync, loads their state, takes that sync's outer step with them and goes on
        from their inner step."""
        self._trainer = trainer
        sizes = self.topology.sizes
        self.quorum = QuorumGroup(
            self.worker, self.topology.rank, sizes.ranks_per_worker, self.elastic.lighthouse_address(),
            self.elastic.manager_host, self.key, timedelta(seconds=self.config.sync_timeout_s),
            timedelta(seconds=self.elastic.quorum_timeout_s))
        self._joining, self._start_deadline = True, time.monotonic() + self.elastic.quorum_timeout_s
        deltas = [torch.zeros(sum(rows * cols for rows, cols in spec.layout.shapes),
                              device=self.params[spec.indices[0]].param.device) for spec in self.buckets[0]]
        result = self._sync(0, deltas, trainer.step, self.outer_step + 1)
        if result.record.get("start"):
            return  # a fresh run: nothing to average yet, every worker holds the seed's weights
        self._apply(0, result, overlapped=False)

    def leave(self) -> None:
        if self.quorum is not None:
            self.quorum.shutdown()

    # -- state transfer ---------------------------------------------------------------------------

    def _peer_state(self) -> dict:
        return {
            "outer_step": self.outer_step, "skipped": self.skipped,
            "global_weights": {self.params[i].name: w for i, w in self.global_weights.items()},
            "momentum": {self.params[i].name: m for i, m in self.momentum.items()},
            "step": self._trainer.step,
            "scheduler": self._trainer.engine.lr_scheduler.state_dict(),
        }

    def _transfer_state(self, wire: Wire, source: int, behind: list[int], committed: int, context: str) -> None:
        """Quorum member `source` sends its state to the members `behind` (every member takes part in
        the two collectives); a member behind checks what it receives and loads it."""
        me = wire.rank
        if me == source:
            blob = torch.frombuffer(bytearray(state_to_bytes(self._peer_state())), dtype=torch.uint8)
        else:
            blob = torch.empty(0, dtype=torch.uint8)
        sizes = wire.all_gather_ints([blob.numel()], f"state size, {context}")
        if me not in behind:
            wire.all_to_all([blob if j in behind else blob[:0] for j in range(wire.size)], [0] * wire.size,
                            f"state transfer, {context}")
            return
        own = self._peer_state()
        limit = sum(t.numel() * t.element_size() for key in ("global_weights", "momentum")
                    for t in own[key].values()) + _STATE_SLACK_BYTES
        if sizes[source] is None or not 0 < sizes[source][0] <= limit:
            raise RankFileError(f"the state size announced by quorum member {source} "
                                + ("failed authentication" if sizes[source] is None else f"is not within {limit} bytes"))
        received = wire.all_to_all([blob[:0]] * wire.size,
                                   [sizes[source][0] if src == source else 0 for src in range(wire.size)],
                                   f"state transfer, {context}")[source]
        if received is None:
            raise RankFileError(f"the state from quorum member {source} failed authentication")
        self._load_peer_state(state_from_bytes(received.numpy().tobytes(), f"the state from quorum member {source}"))
        self.quorum.caught_up_to(committed)

    def _check_peer_state(self, state: dict) -> None:
        """What a peer sent must be this rank's own state's form exactly (keys, names, shapes, dtypes,
        counters): it is loaded with copy_, which would broadcast a smaller tensor."""
        own = self._peer_state()
        problems = []
        if set(state) != set(own):
            problems.append(f"keys {sorted(state)} instead of {sorted(own)}")
        else:
            for key in ("outer_step", "skipped", "step"):
                if not isinstance(state[key], int) or isinstance(state[key], bool) or state[key] < 0:
                    problems.append(f"{key} {state[key]!r} is not a count")
            for key in ("global_weights", "momentum"):
                theirs, mine = state[key], own[key]
                if not isinstance(theirs, dict) or set(theirs) != set(mine):
                    problems.append(f"{key} holds other parameters than this rank owns")
                    continue
                for name, tensor in mine.items():
                    t = theirs[name]
                    if not isinstance(t, torch.Tensor) or t.dtype != tensor.dtype or t.shape != tensor.shape:
                        problems.append(f"{key}[{name}] is not a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
            if not isinstance(state["scheduler"], dict) or set(state["scheduler"]) != set(own["scheduler"]):
                problems.append("the lr schedule's state has other keys than this run's")
        if problems:
            raise RankFileError("the state from a peer is refused: " + "; ".join(problems[:5]))

    @torch.no_grad()
    def _load_peer_state(self, state: dict) -> None:
        self._check_peer_state(state)
        self.load_state_dict({**state, "error_feedback": {}, "pending": []})
        for specs in self.buckets:
            for spec in specs:
                if spec.error_feedback:
                    spec.error_feedback.error = None
        engine = self._trainer.engine
        engine.lr_scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
        # The trainer's step is the run's one counter (step hooks see it already counting their step);
        # the engine's counters follow it, and the data position is the step.
        self._trainer.step = state["step"]
        engine.set_step(state["step"])
        self._joining = self._rejoined = True

    # -- one sync -------------------------------------------------------------------------------------

    @torch.no_grad()
    def _sync(self, fragment: int, deltas: list[torch.Tensor], step: int, outer_step: int) -> SyncResult:
        start, attempt = time.perf_counter(), 0
        own = self._vote_share(self.buckets[fragment], deltas)
        while True:
            attempt += 1
            result, error = None, None
            try:
                result = self._attempt(fragment, deltas, own, attempt, start)
            except (_WaitingForPeers, *_ATTEMPT_FAILURES) as exc:
                error = exc
                self.quorum.report_error(exc)
            if self.quorum.commit():
                self._joining = self._rejoined = False
                self._start_deadline = 0.0
                return result
            if isinstance(error, _WaitingForPeers):
                attempt -= 1
                time.sleep(_START_POLL_S)
                continue
            if self.topology.is_logging_rank:
                print(f"worker {self.worker}: outer sync attempt {attempt} failed: {str(error).splitlines()[0][:300]}",
                      flush=True)
            if attempt >= self.elastic.max_attempts:
                raise CollectiveError(f"worker {self.worker}: outer sync failed {attempt} times in a row") from error

    def _attempt(self, fragment: int, deltas: list[torch.Tensor], own: tuple[bool, float], attempt: int,
                 start: float) -> SyncResult:
        self.quorum.start()
        wire = self.quorum.wire(self.config.link)
        # Membership and state transfer are tagged for this quorum alone: a worker that is behind does
        # not know the outer step until it has the state.
        wire.begin(outer_step=0, fragment=fragment, epoch=self.quorum.epoch)
        context = f"elastic {self._context(self.outer_step + 1)}"
        specs, step = self.buckets[fragment], self._trainer.step
        nonfinite, sq = (False, 0.0) if self._joining else own
        sums = _ContributorSums(wire, self.topology.worker_group, self.topology.sizes.ranks_per_worker, [])
        per_worker = sums.ranks_per_worker
        rows = sums.per_member([float(self.worker), float(step), float(self._joining), float(nonfinite), sq,
                                float(self.quorum.committed_syncs)], f"membership, {context}")
        # Worker id, step, joining and committed syncs are the same on every rank of a worker: undo the
        # in-worker sum.
        members = [Member.unauthenticated() if r is None else
                   Member.from_row([r[0] / per_worker, r[1] / per_worker, r[2], r[3], r[4], r[5] / per_worker])
                   for r in rows]
        committed = max(m.committed for m in members)
        behind = [i for i, m in enumerate(members) if m.authentic and m.committed < committed]
        if behind:
            source = next(i for i, m in enumerate(members) if m.authentic and m.committed == committed)
            self._transfer_state(wire, source, behind, committed, context)
            step = self._trainer.step
            members = [dataclasses.replace(m, joining=True, step=members[source].step) if i in behind else m
                       for i, m in enumerate(members)]
        wire.begin(self.outer_step + 1, fragment, epoch=self.quorum.epoch)
        ours = [m for m in members if m.authentic]
        if all(m.joining for m in ours) and len(ours) < self.config.workers and time.monotonic() < self._start_deadline:
            raise _WaitingForPeers(f"{len(ours)} of {self.config.workers} workers in the first quorum")
        reasons = left_out(members, self.config.max_norm_ratio)
        contributors = [i for i in range(len(members)) if i not in reasons]
        in_quorum = [m.worker for m in members if m.authentic]
        record = {"outer_step": self.outer_step + 1, "fragment": fragment, "step": step,
                  "quorum": in_quorum, "missing": sorted(set(range(self.config.workers)) - set(in_quorum)),
                  "attempts": attempt, "rejoined": self._rejoined}
        if not all(m.authentic for m in members):  # quorum members whose row failed its tag: not ours
            record["unauthenticated"] = sum(not m.authentic for m in members)
        exchanged = None
        if contributors:
            contributing = wire.rank in contributors
            if not contributing:  # send zeros nobody decodes; the error feedback restarts from zero
                deltas = [torch.zeros_like(d) for d in deltas]
            buckets = [Bucket(spec.compressor, spec.layout,
                              spec.error_feedback.accumulate(d) if spec.error_feedback and contributing else d)
                       for spec, d in zip(specs, deltas)]
            exchanged = average_buckets(buckets, wire, "all_gather", context, members=contributors,
                                        max_norm_ratio=self.config.max_norm_ratio, leave_out=True)
            reasons.update(exchanged.rejected)
            contributors = [i for i in contributors if i not in exchanged.rejected]
        record.update(workers_in_sync=len(contributors),
                      left_out={str(members[i].worker): reason for i, reason in sorted(reasons.items())
                                if members[i].authentic})
        if not contributors:
            record.update(start=all(m.joining for m in ours), skipped="no member has a pseudogradient to contribute",
                          round_trips=wire.take_stats().round_trips, sync_seconds=time.perf_counter() - start)
            return SyncResult(None, record)

        averaged = exchanged.averaged
        if wire.rank not in contributors:  # its error feedback restarts from zero
            averaged = [Averaged(a.average, torch.zeros_like(a.average)) for a in averaged]
        exchange = wire.take_stats()
        local = self._local_sums(specs, deltas, buckets, averaged, exchange.bytes_sent,
                                 verdict_digest(exchanged.rejected))
        norms = [members[i].norm for i in contributors]
        metrics = _ContributorSums(wire, self.topology.worker_group, per_worker, contributors)
        record.update(pseudograd_norm=statistics.fmean(norms),
                      **sync_record(metrics, len(contributors), norms, local, context))
        record.update(round_trips=exchange.round_trips + wire.take_stats().round_trips,
                      sync_seconds=time.perf_counter() - start)
        return SyncResult(averaged, record)

    def weights_checksum(self) -> str:
        """sha256 of this rank's global weights (fp32 bytes, in parameter order): equal on two
        workers iff their shards are bit-identical."""
        digest = hashlib.sha256()
        for i in sorted(self.global_weights):
            digest.update(self.global_weights[i].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]
