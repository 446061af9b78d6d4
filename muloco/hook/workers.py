"""The world as K workers, and DeepSpeed's `mpu` for one of them.

The world is K workers of D ranks each, the worker index slowest (ranks k*D .. k*D+D-1 are worker
k). `Workers.mpu` narrows DeepSpeed's data parallelism (its gradient all-reduce, ZeRO's partitions)
to the D ranks of one worker; the outer groups join the ranks that hold the same shard in different
workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from muloco.core import comm
from muloco.core.errors import ConfigError
from muloco.core.topology import ParallelSizes, Topology, build_topology
from muloco.hook.reports import report_uncaught_in_one_line


class WorkerMpu:
    """The `mpu` DeepSpeed asks for, answered for one worker: "data parallel" is the worker's D
    ranks (so DeepSpeed never reduces across workers), "model parallel" each rank alone."""

    def __init__(self, topology: Topology, alone):
        self._topology, self._alone = topology, alone

    def get_data_parallel_group(self):
        return self._topology.inner_dp_group

    def get_data_parallel_rank(self) -> int:
        return self._topology.coords.data

    def get_data_parallel_world_size(self) -> int:
        return self._topology.sizes.data

    def get_model_parallel_group(self):
        return self._alone

    get_tensor_model_parallel_group = get_pipeline_model_parallel_group = get_model_parallel_group

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_pipeline_model_parallel_rank = get_model_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_pipeline_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._topology.rank


@dataclass
class Workers:
    """The world as K workers of D data-parallel ranks, and DeepSpeed's `mpu` for one worker."""
    topology: Topology
    mpu: WorkerMpu

    @property
    def worker(self) -> int:
        """This rank's worker (its datacenter), 0..K-1."""
        return self.topology.coords.worker

    @property
    def data_size(self) -> int:
        """How many ranks read different data: K workers x D ranks (a sampler's `num_replicas`)."""
        return self.topology.sizes.workers * self.topology.sizes.data

    @property
    def data_rank(self) -> int:
        """This rank's reader among them (a sampler's `rank`): worker k's rank d reads k*D + d."""
        return self.topology.coords.worker * self.topology.sizes.data + self.topology.coords.data


def data_parallel_workers(workers: int, timeout: timedelta = comm.COLLECTIVE_TIMEOUT) -> Workers:
    """Every rank calls it, after torch.distributed is initialized (deepspeed.init_distributed) and
    before deepspeed.initialize; one ConfigError line when the world does not split into K workers."""
    report_uncaught_in_one_line()
    if not dist.is_initialized():
        raise ConfigError("data_parallel_workers needs torch.distributed initialized first (deepspeed.init_distributed())")
    sizes = ParallelSizes.from_world(dist.get_world_size(), workers, 1, 1)
    topology = build_topology(sizes, timeout)
    alone = comm.new_subgroups([[rank] for rank in range(sizes.world)], timeout)
    return Workers(topology, WorkerMpu(topology, alone))


