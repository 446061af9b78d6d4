"""The MuLoCo / DiLoCo outer loop, a step hook of the trainer.

Every rank keeps, for the parameters of its own shard, fp32 global weights and outer momentum (on
the host, pinned, or on the device with `outer_state_on_device`) and error-feedback buffers (on the
device). With D inner-DP replicas, each replica owns 1/D of the shard's parameters (balanced by size): it alone keeps their outer state
and syncs them with its peers in the other workers, then shares the result inside its worker.

A sync of one fragment:
1. delta = theta_global - theta_local (fp32), per owned parameter of the fragment, flattened into one
   buffer per bucket (parameters of the same compression group, see compression.py);
2. this rank's ballot for the skip vote (vote.py), summed over its worker's ranks (inside the
   datacenter);
3. compressed average of each bucket over the outer group (collectives.py: all-gather, or
   reduce-scatter + re-quantize + all-gather), bit-identical on every worker, the ballots riding in
   the header of its first collective; every rank counts the K ballots alike. The encoder's residual
   is the new error-feedback buffer. With the all-gather collective the whole decision costs one
   cross-datacenter round trip;
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

`with outer.attached_to(trainer): trainer.train()` runs `after_inner_step` after every optimizer
step of the block (a trainer step hook) and detaches on exit.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from trainer import comm
from trainer.diloco import vote
from trainer.diloco.auth import JobKey
from trainer.diloco.collectives import (Averaged, Bucket, BucketLayout, GroupWire, Wire, average_buckets,
                                        squared_norm)
from trainer.diloco.compression import Compressor, ErrorFeedback, compression_group, rows_shape
from trainer.diloco.config import MuLoCoConfig
from trainer.diloco.sync_metrics import LocalSums, sync_record, verdict_digest
from trainer.errors import ConfigError
from trainer.model.layout import layout_of
from trainer.optim.ownership import assign_owners
from trainer.topology import Topology, outer_ranks, worker_ranks


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


@dataclass
class SyncResult:
    averaged: list[Averaged] | None  # one per bucket; None when the vote skipped the sync
    record: dict  # what the sync logs
    statistics: Callable[[], dict] | None = None  # the rest of the record, reduced off the critical path


@dataclass
class _Pending:
    apply_at: int
    fragment: int
    outer_step: int
    deltas: list[torch.Tensor]  # one flat buffer per bucket, kept so a checkpoint can replay the sync
    future: Future  # of a SyncResult


class OuterLoop:
    def __init__(self, config: MuLoCoConfig, named_params: list[tuple[str, torch.nn.Parameter]],
                 canonical: dict[str, str], topology: Topology, tp_rank: int, num_layers: int,
                 log: Callable[[dict, int], None], timeout: timedelta = comm.COLLECTIVE_TIMEOUT,
                 key: JobKey | None = None):
        self.config, self.topology, self.log, self.key = config, topology, log, key
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
        self._background = ThreadPoolExecutor(max_workers=1)  # overlapped syncs and every sync's metrics
        self._statistics: list[Future] = []  # of records whose metrics are being reduced
        self.outer_wire, self.metrics_wire, self.ballot_group = self._build_groups(timeout)

    def _build_groups(self, timeout: timedelta) -> tuple[Wire, Wire, object]:
        """On `outer_backend`: the outer groups (one per shard position), the metrics group (every
        rank) and, with several ranks per worker, a group per worker that sums the vote's ballots
        (the training loop's worker group stays the training loop's). Every rank creates every group,
        in the same order."""
        backend, sizes = self.config.outer_backend, self.topology.sizes
        if backend == "nccl" and comm.compute_device().type == "cpu":
            raise ConfigError("muloco.outer_backend 'nccl' needs an accelerator; use 'gloo' on the host")
        mine = comm.new_subgroups(outer_ranks(sizes), timeout, backend=backend)
        every_rank = comm.new_group(list(range(sizes.world)), timeout, backend=backend)
        worker = comm.new_subgroups(worker_ranks(sizes), timeout, backend=backend) if sizes.ranks_per_worker > 1 else None
        return (GroupWire(mine, self.config.link, self.key, "outer"),
                GroupWire(every_rank, self.config.link, self.key, "metrics"), worker)

    def _wire_shape(self, i: int) -> tuple[int, int]:
        shape = self.params[i].param.shape
        return rows_shape(tuple(reversed(shape)) if self.params[i].transposed else shape)

    def _buckets(self, fragment: int) -> list[_BucketSpec]:
        compression = self.config.compression
        parts = self.topology.sizes.workers if self.config.collective == "reduce_scatter" else 1
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
        """Sync after each of `trainer`'s optimizer steps inside the block (`after_inner_step` is looked
        up at every step, so a wrapper installed later still runs)."""
        handle = trainer.register_step_hook(lambda step: self.after_inner_step(step))
        try:
            yield self
        finally:
            handle.remove()
        self.flush_metrics()  # a failed run skips this: its peers may never reduce them

    def after_inner_step(self, step: int) -> None:
        self._log_statistics(wait=False)
        for entry in [e for e in self.pending if e.apply_at == step]:
            self.pending.remove(entry)
            self._apply(entry.fragment, entry.future.result(), overlapped=True)
        for fragment, offset in enumerate(self.offsets):
            if step % self.config.sync_interval == offset:
                self._launch(fragment, step)

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
            self.log(record, record["step"])

    # -- one sync ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _launch(self, fragment: int, step: int) -> None:
        deltas = [spec.layout.flatten([self._delta(i) for i in spec.indices]) for spec in self.buckets[fragment]]
        tau = self.config.streaming.overlap_steps
        if tau == 0:
            self.flush_metrics()  # their reduction shares the wires with this sync
            self._apply(fragment, self._sync(fragment, deltas, step, self.outer_step + 1), overlapped=False)
        else:
            future = self._background.submit(self._sync, fragment, deltas, step, self.outer_step + 1)
            self.pending.append(_Pending(step + tau, fragment, self.outer_step + 1, deltas, future))

    def _delta(self, i: int) -> torch.Tensor:
        """theta_global - theta_local in fp32 on the parameter's device, as the wire sees it."""
        p = self.params[i].param.detach()
        delta = self.global_weights[i].to(p.device, non_blocking=True) - p.float()
        return (delta.t() if self.params[i].transposed else delta).reshape(self._wire_shape(i))

    def _context(self, outer_step: int) -> str:
        c = self.topology.coords
        return f"outer group of shard (d={c.data}, p={c.pipeline}, t={c.tensor}), outer step {outer_step}"

    @torch.no_grad()
    def _sync(self, fragment: int, deltas: list[torch.Tensor], step: int, outer_step: int) -> SyncResult:
        """Vote and exchange of one fragment; may run in the background thread, so it reads the outer
        state but changes none of it (the caller applies the result)."""
        start = time.perf_counter()
        specs, context = self.buckets[fragment], self._context(outer_step)
        ballot = vote.ballot(*self._vote_share(specs, deltas))
        if self.ballot_group is not None:
            comm.all_reduce(ballot, group=self.ballot_group)  # the worker's totals, inside the datacenter
        buckets = [Bucket(spec.compressor, spec.layout,
                          spec.error_feedback.accumulate(d) if spec.error_feedback else d)
                   for spec, d in zip(specs, deltas)]
        self.outer_wire.begin(outer_step, fragment)
        exchanged = average_buckets(buckets, self.outer_wire, self.config.collective, context,
                                    header=ballot.view(torch.uint8), max_norm_ratio=self.config.max_norm_ratio)
        exchange = self.outer_wire.take_stats()
        if exchanged.rejected:  # every rank of the outer group rejects the same workers
            norms, reason = [], "; ".join(f"worker {k}: {why}" for k, why in sorted(exchanged.rejected.items()))
        else:
            norms, reason = vote.count(exchanged.headers, self.config.max_norm_ratio)
        record = {"outer_step": outer_step, "fragment": fragment, "step": step,
                  "pseudograd_norm": statistics.fmean(norms) if reason is None else None,
                  "round_trips": exchange.round_trips, "sync_seconds": time.perf_counter() - start}
        if reason is not None:
            record["skipped"] = reason
        verdict = verdict_digest(exchanged.rejected)

        def reduce_metrics() -> dict:  # reads the sync's buffers, which nothing changes after the exchange
            local = (LocalSums(verdict=verdict) if reason is not None else
                     self._local_sums(specs, deltas, buckets, exchanged.averaged, exchange.bytes_sent, verdict))
            self.metrics_wire.begin(outer_step, fragment)
            reduced = sync_record(self.metrics_wire, self.topology.sizes.workers, norms if reason is None else [],
                                  local, context)
            return {**record, **reduced, "background_round_trips": self.metrics_wire.take_stats().round_trips}
        # A skipped sync's metrics round runs too: it checks that every worker skipped it.
        return SyncResult(None if reason is not None else exchanged.averaged, record, reduce_metrics)

    @staticmethod
    def _vote_share(specs: list[_BucketSpec], deltas: list[torch.Tensor]) -> tuple[bool, float]:
        """(any non-finite entry, squared norm) of this rank's share of a fragment's pseudogradient."""
        sq = sum(squared_norm(d) for spec, d in zip(specs, deltas) if spec.counts_once)
        return any(not bool(torch.isfinite(d).all()) for d in deltas), sq

    @staticmethod
    def _local_sums(specs: list[_BucketSpec], deltas: list[torch.Tensor], buckets: list[Bucket],
                    averaged: list[Averaged], bytes_sent: int, verdict: float = 0.0) -> LocalSums:
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
    def _apply(self, fragment: int, result: SyncResult, overlapped: bool) -> None:
        specs = self.buckets[fragment]
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
        alpha = self.config.streaming.mix_alpha if overlapped else 0.0
        for spec in specs:
            for i in spec.indices:
                p = self.params[i].param
                new = self.global_weights[i].to(p.device, p.dtype, non_blocking=True)
                p.copy_(new if alpha == 0.0 else p.mul(alpha).add_(new, alpha=1 - alpha))
        self._share_inside_worker(fragment)
        if result.statistics is None:
            self._log(result.record)
        else:
            self._statistics.append(self._background.submit(result.statistics))

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
            "pending": [{"apply_at": e.apply_at, "fragment": e.fragment, "outer_step": e.outer_step,
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
        self.pending = [_Pending(e["apply_at"], e["fragment"], e["outer_step"], e["deltas"], self._background.submit(
            self._sync, e["fragment"], e["deltas"], e["apply_at"] - tau, e["outer_step"])) for e in state["pending"]]
