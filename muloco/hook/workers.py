"""The world as K workers, and DeepSpeed's `mpu` for one of them.

The world is K workers of D x P x T ranks each (muloco/core/topology.py), the worker index slowest:
    rank = ((k * D + d) * P + p) * T + t
so a worker (one datacenter) is a contiguous block of ranks, and inside it the tensor rank is fastest,
then the pipeline stage, then the data-parallel replica: Megatron's "tp-pp-dp" order. `Workers.mpu`
narrows DeepSpeed's data parallelism (its gradient all-reduce, ZeRO's partitions) to the D ranks of
one worker that hold the same tensor- and pipeline-parallel shard, and answers the model-parallel
questions with the user's groups: a Megatron-core `parallel_state` (or a Megatron-DeepSpeed-style
mpu) initialized in that order, or groups built here from T and P. The outer groups join the ranks
that hold the same shard (d, p, t) in different workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from muloco.core import comm
from muloco.core.errors import ConfigError
from muloco.core.topology import (ParallelSizes, RankCoordinates, Topology, build_topology,
                                  inner_data_parallel_ranks, rank_of)
from muloco.hook.reports import report_uncaught_in_one_line

MEGATRON_ORDER = ("the workers must be contiguous blocks of ranks with the tensor rank fastest, then the pipeline "
                  "stage, then the data-parallel replica (Megatron-core: initialize_model_parallel(..., "
                  "order=\"tp-pp-dp\"))")


@dataclass
class ModelParallelGroups:
    """This rank's tensor-parallel, pipeline and model-parallel (tensor x pipeline) groups."""
    tensor: object
    pipeline: object
    model: object


def _tensor_ranks(sizes: ParallelSizes) -> list[list[int]]:
    return [[rank_of(RankCoordinates(k, d, p, t), sizes) for t in range(sizes.tensor)]
            for k in range(sizes.workers) for d in range(sizes.data) for p in range(sizes.pipeline)]


def _pipeline_ranks(sizes: ParallelSizes) -> list[list[int]]:
    return [[rank_of(RankCoordinates(k, d, p, t), sizes) for p in range(sizes.pipeline)]
            for k in range(sizes.workers) for d in range(sizes.data) for t in range(sizes.tensor)]


def _model_ranks(sizes: ParallelSizes) -> list[list[int]]:
    return [[rank_of(RankCoordinates(k, d, p, t), sizes) for p in range(sizes.pipeline) for t in range(sizes.tensor)]
            for k in range(sizes.workers) for d in range(sizes.data)]


def _mine(groups: list[list[int]], rank: int) -> list[int]:
    return next(ranks for ranks in groups if rank in ranks)


def _data_parallel_ranks(topology: Topology) -> list[int]:
    return _mine(inner_data_parallel_ranks(topology.sizes), topology.rank)


def _build_model_parallel_groups(sizes: ParallelSizes, timeout: timedelta) -> ModelParallelGroups:
    """Each distinct split of the world made once (at T = 1 the tensor groups are single ranks, and
    the model groups are the pipeline groups)."""
    made: dict[str, object] = {}

    def groups(ranks: list[list[int]]):
        key = repr(ranks)
        if key not in made:
            made[key] = comm.new_subgroups(ranks, timeout)
        return made[key]

    return ModelParallelGroups(*(groups(ranks(sizes)) for ranks in (_tensor_ranks, _pipeline_ranks, _model_ranks)))


def _layout_problem(mpu, sizes: ParallelSizes, rank: int) -> str | None:
    """How the user's groups differ from the layout, on this rank (None: they match)."""
    for what, group, expected in (("tensor-parallel", mpu.get_tensor_model_parallel_group(), _tensor_ranks),
                                  ("pipeline", mpu.get_pipeline_model_parallel_group(), _pipeline_ranks)):
        ranks = sorted(dist.get_process_group_ranks(group))
        if ranks != _mine(expected(sizes), rank):
            return f"rank {rank}'s {what} group is ranks {ranks}, not {_mine(expected(sizes), rank)}: {MEGATRON_ORDER}"
    return None


def _agree(problem: str | None, hint: str) -> None:
    """Every rank raises when any rank found a problem (none goes on to a collective the others skip)."""
    flag = comm.all_reduce(torch.tensor([0.0 if problem is None else 1.0]), op=dist.ReduceOp.MAX)
    if flag.item():
        raise ConfigError(problem or f"another rank's model-parallel groups do not match the layout: {hint}")


class WorkerMpu:
    """The `mpu` DeepSpeed asks for, answered for one worker: "data parallel" is the worker's D ranks
    that hold this rank's shard (so DeepSpeed never reduces across workers), tensor, pipeline and
    model parallel the model-parallel groups."""

    def __init__(self, topology: Topology, groups: ModelParallelGroups):
        self._topology, self._groups = topology, groups

    def get_data_parallel_group(self):
        return self._topology.inner_dp_group

    def get_data_parallel_rank(self) -> int:
        return self._topology.coords.data

    def get_data_parallel_world_size(self) -> int:
        return self._topology.sizes.data

    def get_data_parallel_group_ranks(self) -> list[int]:
        return _data_parallel_ranks(self._topology)

    def get_tensor_model_parallel_group(self):
        return self._groups.tensor

    def get_tensor_model_parallel_rank(self) -> int:
        return self._topology.coords.tensor

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._topology.sizes.tensor

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._topology.rank - self._topology.coords.tensor

    def get_pipeline_model_parallel_group(self):
        return self._groups.pipeline

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._topology.coords.pipeline

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._topology.sizes.pipeline

    def get_model_parallel_group(self):
        return self._groups.model

    def get_model_parallel_rank(self) -> int:
        return self._topology.coords.pipeline * self._topology.sizes.tensor + self._topology.coords.tensor

    def get_model_parallel_world_size(self) -> int:
        return self._topology.sizes.pipeline * self._topology.sizes.tensor


@dataclass
class Workers:
    """The world as K workers of D x P x T ranks, and DeepSpeed's `mpu` for one worker."""
    topology: Topology
    mpu: WorkerMpu

    @property
    def data_parallel_ranks(self) -> list[int]:
        """The ranks DeepSpeed's data parallelism must span on this rank: its shard's D replicas in its worker."""
        return _data_parallel_ranks(self.topology)

    @property
    def worker(self) -> int:
        """This rank's worker (its datacenter), 0..K-1."""
        return self.topology.coords.worker

    @property
    def data_size(self) -> int:
        """How many ranks read different data: K workers x D replicas (a sampler's `num_replicas`)."""
        return self.topology.sizes.workers * self.topology.sizes.data

    @property
    def data_rank(self) -> int:
        """This rank's reader among them (a sampler's `rank`): replica d of worker k reads k*D + d (the P x T
        ranks of one replica read alike)."""
        return self.topology.coords.worker * self.topology.sizes.data + self.topology.coords.data


def data_parallel_workers(workers: int, mpu=None, *, tensor: int | None = None, pipeline: int | None = None,
                          timeout: timedelta = comm.COLLECTIVE_TIMEOUT) -> Workers:
    """Every rank calls it, after torch.distributed is initialized (deepspeed.init_distributed) and
    after the model-parallel groups exist (`mpu`: Megatron-core's `parallel_state` after
    initialize_model_parallel(..., order="tp-pp-dp"), or a Megatron-DeepSpeed-style mpu), before
    deepspeed.initialize. Without an mpu the tensor and pipeline sizes (default 1) are given here and
    `Workers.mpu` holds groups built for them. One ConfigError line, on every rank, when the world
    does not split into K workers or the mpu's groups are not laid out as above."""
    report_uncaught_in_one_line()
    if not dist.is_initialized():
        raise ConfigError("data_parallel_workers needs torch.distributed initialized first (deepspeed.init_distributed())")
    if mpu is not None:
        given = {"tensor": (tensor, mpu.get_tensor_model_parallel_world_size()),
                 "pipeline": (pipeline, mpu.get_pipeline_model_parallel_world_size())}
        clash = [f"{name}={mine} but the mpu's is {theirs}" for name, (mine, theirs) in given.items()
                 if mine is not None and mine != theirs]
        if clash:
            raise ConfigError(f"data_parallel_workers: {'; '.join(clash)} (give the mpu alone)")
        tensor, pipeline = (theirs for _, theirs in given.values())
    sizes = ParallelSizes.from_world(dist.get_world_size(), workers, pipeline or 1, tensor or 1)  # a ConfigError
    if mpu is not None:
        _agree(_layout_problem(mpu, sizes, dist.get_rank()), MEGATRON_ORDER)
        groups = ModelParallelGroups(mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group(),
                                     mpu.get_model_parallel_group())
    topology = build_topology(sizes, timeout)
    if mpu is None:
        groups = _build_model_parallel_groups(sizes, timeout)
    return Workers(topology, WorkerMpu(topology, groups))
