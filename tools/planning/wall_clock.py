"""The idealised wall-clock of a token budget: DP AdamW and DP Muon against MuLoCo (or DiLoCo) on the same GPUs."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tools.planning.inputs import PlanInputs
from tools.planning.shards import ShardParam
from tools.planning.sync_bytes import SyncBytes


@dataclass
class MethodTime:
    method: str
    steps: int
    compute_s_per_step: float
    communication_s_per_step: float  # cross-datacenter, amortised per inner step
    total_hours: float
    cross_dc_bytes_per_rank: float  # over the whole run


def _link_seconds(busiest_rank_bytes: float, datacenter_bytes: float, inputs: PlanInputs) -> float:
    """A shared datacenter link carries every rank's bytes; per-rank links wait for the busiest rank."""
    nbytes = datacenter_bytes if inputs.bandwidth_scope == "datacenter" else busiest_rank_bytes
    return nbytes * 8 / (inputs.bandwidth_gbit * 1e9)


def wall_clock(params: int, stages: list[list[ShardParam]], sync: SyncBytes, inputs: PlanInputs) -> list[MethodTime]:
    tokens_per_step = inputs.global_batch * inputs.seq_length
    steps = math.ceil(inputs.tokens / tokens_per_step)
    M = inputs.micro_batches
    bubble = (M + inputs.sizes.pipeline - 1) / M
    compute = 6 * params * tokens_per_step / (inputs.sizes.world * inputs.gpu_tflops * 1e12 * inputs.mfu) * bubble
    shard = max(sum(p.numel for p in stage) for stage in stages)
    K = inputs.sizes.workers
    dp_bytes = 2 * (K - 1) / K * shard / inputs.sizes.data * inputs.dp_grad_bytes
    dp_comm = _link_seconds(dp_bytes, dp_bytes * inputs.sizes.ranks_per_worker, inputs)
    times = [MethodTime(name, steps, compute, dp_comm, steps * max(compute, dp_comm) / 3600, steps * dp_bytes)
             for name in ("DP AdamW", "DP Muon")]
    sync_s = _link_seconds(sync.per_rank_max, sync.per_worker, inputs)
    if inputs.codec is not None:
        sync_s += inputs.codec.sync_seconds(shard / inputs.sizes.data, K, inputs.muloco.collective)
    exposed = max(0.0, sync_s - inputs.muloco.streaming.largest_overlap * compute)  # `auto` covers up to its max
    name = f"{'MuLoCo' if inputs.muon else 'DiLoCo'} K={K}"
    syncs = steps // inputs.muloco.sync_interval
    times.append(MethodTime(name, steps, compute, sync_s / inputs.muloco.sync_interval,
                            (steps * compute + syncs * exposed) / 3600, syncs * sync.per_rank_max))
    return times
