"""The MuLoCo / DiLoCo outer loop, a step hook of the trainer.

Every rank keeps, for the parameters of its own shard, fp32 global weights and outer momentum (on
the host; pinned when an accelerator exists) and error-feedback buffers. With D inner-DP replicas,
each replica owns 1/D of the shard's parameters (balanced by size): it alone keeps their outer state
and syncs them with its peers in the other workers, then shares the result inside its worker.

A sync of one fragment:
1. delta = theta_global - theta_local (fp32), per owned parameter of the fragment;
2. agreement over every rank: any non-finite delta, or a worker whose pseudogradient norm is more
   than `max_norm_ratio` times its peers' median, skips the sync for everyone (the workers restart
   from the unchanged global weights);
3. compressed average over the outer group (all-gather, or reduce-scatter + re-quantize + all-gather),
   bit-identical on every worker;
4. Nesterov SGD on the global weights; every worker restarts from them (or, when the sync overlapped
   tau inner steps, mixes them into its local weights with weight alpha); inner optimizer state is kept.

Compression groups are vectors each rank holds whole, so results do not depend on T: rows of
column-parallel (and vocabulary-parallel) weights, columns of row-parallel ones (sent transposed).

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
from typing import Callable

import torch
import torch.distributed as dist

from trainer.diloco.collectives import all_gather_average_many, reduce_scatter_average_many
from trainer.diloco.compression import Compressor, CompressionConfig, make_codec
from trainer.diloco.config import MuLoCoConfig
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


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    from deepspeed.accelerator import get_accelerator

    host = t.detach().to("cpu", torch.float32, copy=True)
    return get_accelerator().pin_memory(host) if t.device.type != "cpu" else host


@dataclass
class _Pending:
    apply_at: int
    fragment: int
    deltas: list[torch.Tensor]
    future: Future | None


class OuterLoop:
    def __init__(self, config: MuLoCoConfig, named_params: list[tuple[str, torch.nn.Parameter]],
                 canonical: dict[str, str], topology: Topology, tp_rank: int, num_layers: int,
                 log: Callable[[dict, int], None]):
        self.config, self.topology, self.log = config, topology, log
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
        self.global_weights = {i: _host_copy(self.params[i].param) for i in self.owned}
        self.momentum = {i: torch.zeros_like(self.global_weights[i]) for i in self.owned}
        uncompressed = Compressor(CompressionConfig(method="none"))
        self.codecs = {i: uncompressed if self._sent_uncompressed(self.params[i]) else make_codec(config.compression)
                       for i in self.owned}
        self.offsets = sync_offsets(config.sync_interval, F)
        self.outer_step = 0
        self.skipped = 0
        self.pending: list[_Pending] = []
        self._executor = ThreadPoolExecutor(max_workers=1) if config.streaming.overlap_steps else None
        # Used only by the outer loop (possibly from its thread), so its collectives never interleave
        # with the training loop's on the same group.
        self.agreement_group = dist.new_group(list(range(dist.get_world_size())))

    def _sent_uncompressed(self, p: SyncedParam) -> bool:
        return self.config.compression.uncompressed_small and (
            p.param.dim() == 1 or getattr(p.param, "is_embedding_or_output_parameter", False))

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

    def after_inner_step(self, step: int) -> None:
        for entry in [e for e in self.pending if e.apply_at == step]:
            self.pending.remove(entry)
            self._apply(entry.fragment, *entry.future.result(), overlapped=True)
        for fragment, offset in enumerate(self.offsets):
            if step % self.config.sync_interval == offset:
                self._launch(fragment, step)

    # -- one sync ----------------------------------------------------------------------------------

    def _fragment(self, fragment: int) -> list[int]:
        return [i for i in self.owned if self.params[i].fragment == fragment]

    @torch.no_grad()
    def _launch(self, fragment: int, step: int) -> None:
        deltas = [self.global_weights[i] - self.params[i].param.detach().float().cpu() for i in self._fragment(fragment)]
        tau = self.config.streaming.overlap_steps
        if tau == 0:
            self._apply(fragment, *self._communicate(fragment, deltas, step), overlapped=False)
        else:
            self.pending.append(_Pending(step + tau, fragment, deltas,
                                         self._executor.submit(self._communicate, fragment, deltas, step)))

    def _worker_slots(self, values: list[float]) -> torch.Tensor:
        """A vector with this worker's contributions in its slot, for a sum over every rank."""
        K = self.topology.sizes.workers
        t = torch.zeros(len(values) * K, dtype=torch.float64)
        for j, v in enumerate(values):
            t[j * K + self.topology.coords.worker] = v
        return t

    def _communicate(self, fragment: int, deltas: list[torch.Tensor], step: int):
        start = time.perf_counter()
        indices = self._fragment(fragment)
        K = self.topology.sizes.workers
        sq = sum(float(d.double().pow(2).sum()) for i, d in zip(indices, deltas) if self.params[i].counts_once)
        nonfinite = float(any(not torch.isfinite(d).all() for d in deltas))
        agreement = torch.cat([torch.tensor([nonfinite], dtype=torch.float64), self._worker_slots([sq])])
        dist.all_reduce(agreement, group=self.agreement_group)
        norms = [math.sqrt(v) if math.isfinite(v) else math.inf for v in agreement[1:].tolist()]
        reason = self._skip_reason(agreement[0].item() > 0, norms)
        record = {"outer_step": self.outer_step + 1, "fragment": fragment, "step": step,
                  "pseudograd_norm": statistics.fmean(norms) if reason is None else None}
        if reason is not None:
            record.update(skipped=reason, sync_seconds=time.perf_counter() - start)
            return None, record

        context = f"outer group of shard (d={self.topology.coords.data}, p={self.topology.coords.pipeline}, " \
                  f"t={self.topology.coords.tensor}), outer step {self.outer_step + 1}"
        tensors = [d.t().contiguous() if self.params[i].transposed else d for i, d in zip(indices, deltas)]
        codecs = [self.codecs[i] for i in indices]
        error_sq = self._compression_error_sq(tensors, codecs)
        if tensors:
            collective = all_gather_average_many if self.config.collective == "all_gather" else reduce_scatter_average_many
            averaged, stats = collective(tensors, codecs, self.topology.outer_group, context=context,
                                         link=self.config.link)
            averaged = [a.t().contiguous() if self.params[i].transposed else a for i, a in zip(indices, averaged)]
            bytes_sent = stats.bytes_sent
        else:
            averaged, bytes_sent = [], 0
        dot = sum(float((d.double() * a.double()).sum()) for i, d, a in zip(indices, deltas, averaged)
                  if self.params[i].counts_once)
        avg_sq = sum(float(a.double().pow(2).sum()) for i, a in zip(indices, averaged) if self.params[i].counts_once)
        summary = torch.cat([self._worker_slots([dot, avg_sq]),
                             torch.tensor([bytes_sent, *error_sq], dtype=torch.float64)])
        dist.all_reduce(summary, group=self.agreement_group)
        dots, avg_sqs = summary[:K].tolist(), summary[K:2 * K].tolist()
        cosines = [dots[k] / max(norms[k] * math.sqrt(avg_sqs[k]), 1e-30) for k in range(K)]
        world = dist.get_world_size()
        record.update(pseudograd_cosine=statistics.fmean(cosines), averaged_norm=math.sqrt(avg_sqs[0]),
                      bytes_sent_per_rank=summary[2 * K].item() / world,
                      compression_error=math.sqrt(summary[2 * K + 1].item() / max(summary[2 * K + 2].item(), 1e-30)),
                      sync_seconds=time.perf_counter() - start)
        return averaged, record

    def _compression_error_sq(self, tensors, codecs) -> list[float]:
        """(||Q(x) - x||^2, ||x||^2) summed over this rank's compressed tensors."""
        err = ref = 0.0
        for x, codec in zip(tensors, codecs):
            plain = getattr(codec, "compressor", codec)
            if plain.config.method == "none":
                continue
            err += float((plain.decode(plain.encode(x), x.shape) - x).double().pow(2).sum())
            ref += float(x.double().pow(2).sum())
        return [err, ref]

    @torch.no_grad()
    def _apply(self, fragment: int, averaged: list[torch.Tensor] | None, record: dict, overlapped: bool) -> None:
        indices = self._fragment(fragment)
        if averaged is None:
            self.skipped += 1
        else:
            c = self.config
            for i, avg in zip(indices, averaged):
                m = self.momentum[i].mul_(c.outer_momentum).add_(avg)
                update = avg.add(m, alpha=c.outer_momentum) if c.nesterov else m
                self.global_weights[i].add_(update, alpha=-c.outer_lr)
            self.outer_step += 1
        alpha = self.config.streaming.mix_alpha if overlapped else 0.0
        for i in indices:
            p = self.params[i].param
            new = self.global_weights[i].to(p.device, p.dtype)
            p.copy_(new if alpha == 0.0 else p.mul(alpha).add_(new, alpha=1 - alpha))
        self._share_inside_worker(fragment)
        if self.topology.is_logging_rank:
            self.log(record, record["step"])

    def _share_inside_worker(self, fragment: int) -> None:
        """The owning replica's new weights to the other D-1 replicas (non-owners add zeros: exact)."""
        if self.topology.sizes.data == 1:
            return
        members = [i for i, p in enumerate(self.params) if p.fragment == fragment]
        if not members:
            return
        flat = torch.cat([self.params[i].param.detach().reshape(-1) if i in self.global_weights
                          else torch.zeros_like(self.params[i].param).reshape(-1) for i in members])
        dist.all_reduce(flat, group=self.topology.inner_dp_group)
        offset = 0
        for i in members:
            p = self.params[i].param
            p.detach().copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def _skip_reason(self, nonfinite: bool, norms: list[float]) -> str | None:
        if nonfinite:
            return "non-finite pseudogradient"
        for k, norm in enumerate(norms):
            others = [n for j, n in enumerate(norms) if j != k]
            if others and norm > self.config.max_norm_ratio * max(statistics.median(others), 1e-12):
                return f"worker {k} pseudogradient norm {norm:.3g} is over {self.config.max_norm_ratio}x its peers'"
        return None

    # -- checkpointing -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "outer_step": self.outer_step, "skipped": self.skipped,
            "global_weights": {self.params[i].name: w for i, w in self.global_weights.items()},
            "momentum": {self.params[i].name: m for i, m in self.momentum.items()},
            "error_feedback": {self.params[i].name: c.state_dict() for i, c in self.codecs.items()
                               if hasattr(c, "state_dict")},
            # In-flight overlapped syncs are replayed on load: the communication is deterministic.
            "pending": [{"apply_at": e.apply_at, "fragment": e.fragment, "deltas": e.deltas} for e in self.pending],
        }

    def load_state_dict(self, state: dict) -> None:
        by_name = {self.params[i].name: i for i in self.owned}
        for key in ("global_weights", "momentum", "error_feedback"):
            if set(state[key]) != ({n for n in by_name if key != "error_feedback" or hasattr(self.codecs[by_name[n]], "state_dict")}):
                raise ValueError(f"outer-loop checkpoint holds different parameters under {key!r} than this rank owns")
        for name, i in by_name.items():
            self.global_weights[i].copy_(state["global_weights"][name])
            self.momentum[i].copy_(state["momentum"][name])
            if name in state["error_feedback"]:
                self.codecs[i].load_state_dict(state["error_feedback"][name])
        self.outer_step, self.skipped = state["outer_step"], state["skipped"]
        tau = self.config.streaming.overlap_steps
        self.pending = [_Pending(e["apply_at"], e["fragment"], e["deltas"],
                                 self._executor.submit(self._communicate, e["fragment"], e["deltas"], e["apply_at"] - tau))
                        for e in state["pending"]]
