"""The process topology: world = K workers x D inner data-parallel x P pipeline x T tensor-parallel.

A worker is one datacenter, so its ranks are contiguous and the worker index varies slowest:
    rank = ((k * D + d) * P + p) * T + t
Megatron's tensor and pipeline groups live inside one worker; Megatron's "data parallel" is the
inner DP group (the D replicas of one worker); the outer group joins the K ranks that hold the same
shard in different workers and is used only at outer syncs.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from muloco.core import comm
from muloco.core.errors import TopologyError


@dataclass(frozen=True)
class ParallelSizes:
    workers: int  # K
    data: int  # D, inner data-parallel replicas per worker
    pipeline: int  # P
    tensor: int  # T

    @property
    def world(self) -> int:
        return self.workers * self.data * self.pipeline * self.tensor

    @property
    def ranks_per_worker(self) -> int:
        return self.data * self.pipeline * self.tensor

    @classmethod
    def from_world(cls, world_size: int, workers: int, pipeline: int, tensor: int) -> "ParallelSizes":
        """Derive D from the world size; every bad size is reported at once."""
        problems = []
        for name, value in (("workers (K)", workers), ("pipeline-model-parallel-size", pipeline),
                            ("tensor-model-parallel-size", tensor)):
            if value < 1:
                problems.append(f"{name} must be >= 1, got {value}")
        if problems:
            raise TopologyError("; ".join(problems))
        per_data_replica = workers * pipeline * tensor
        if world_size % per_data_replica:
            raise TopologyError(
                f"world size {world_size} is not divisible by workers x pipeline x tensor = "
                f"{workers} x {pipeline} x {tensor} = {per_data_replica}")
        return cls(workers, world_size // per_data_replica, pipeline, tensor)


@dataclass(frozen=True)
class RankCoordinates:
    worker: int
    data: int
    pipeline: int
    tensor: int


def coordinates(rank: int, sizes: ParallelSizes) -> RankCoordinates:
    t = rank % sizes.tensor
    p = (rank // sizes.tensor) % sizes.pipeline
    d = (rank // (sizes.tensor * sizes.pipeline)) % sizes.data
    k = rank // sizes.ranks_per_worker
    return RankCoordinates(k, d, p, t)


def rank_of(c: RankCoordinates, sizes: ParallelSizes) -> int:
    return ((c.worker * sizes.data + c.data) * sizes.pipeline + c.pipeline) * sizes.tensor + c.tensor


def inner_data_parallel_ranks(sizes: ParallelSizes) -> list[list[int]]:
    """One group per (worker, pipeline stage, tensor rank): the D replicas that all-reduce gradients."""
    return [[rank_of(RankCoordinates(k, d, p, t), sizes) for d in range(sizes.data)]
            for k in range(sizes.workers) for p in range(sizes.pipeline) for t in range(sizes.tensor)]


def outer_ranks(sizes: ParallelSizes) -> list[list[int]]:
    """One group per shard position (d, p, t): the K ranks holding that shard in different workers."""
    return [[rank_of(RankCoordinates(k, d, p, t), sizes) for k in range(sizes.workers)]
            for d in range(sizes.data) for p in range(sizes.pipeline) for t in range(sizes.tensor)]


def worker_ranks(sizes: ParallelSizes) -> list[list[int]]:
    per = sizes.ranks_per_worker
    return [list(range(k * per, (k + 1) * per)) for k in range(sizes.workers)]


@dataclass
class Topology:
    """This rank's place in the topology and its process groups (Megatron's TP/PP are set up
    by megatron_patches.parallel_state, which makes the inner DP group Megatron's DP group)."""

    sizes: ParallelSizes
    rank: int
    coords: RankCoordinates
    inner_dp_group: object
    worker_group: object

    @property
    def is_logging_rank(self) -> bool:
        """Global rank 0 logs; it is worker 0's first stage, but the loss lives on the last stage."""
        return self.rank == 0

    def describe(self) -> str:
        s = self.sizes
        return (f"world {s.world} = K {s.workers} workers x D {s.data} inner-DP x "
                f"P {s.pipeline} pipeline x T {s.tensor} tensor")


def build_topology(sizes: ParallelSizes, timeout: timedelta = comm.COLLECTIVE_TIMEOUT) -> Topology:
    """The groups on the default backend (NCCL on GPUs): they carry every-step traffic inside one
    worker. The cross-worker outer groups belong to the outer loop, on its own backend."""
    rank = dist.get_rank()
    return Topology(
        sizes=sizes,
        rank=rank,
        coords=coordinates(rank, sizes),
        inner_dp_group=comm.new_subgroups(inner_data_parallel_ranks(sizes), timeout),
        worker_group=comm.new_subgroups(worker_ranks(sizes), timeout),
    )
