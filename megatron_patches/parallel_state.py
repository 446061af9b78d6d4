"""Megatron's process groups for the K x D x P x T topology.

Megatron is initialized with order "tp-pp-dp", which matches our rank order (tensor fastest, then
pipeline, then the K*D replicas with the worker slowest), so its TP and PP groups are exactly ours.
Its data-parallel groups would then span all K*D replicas, i.e. cross datacenters every step; we
narrow every data-parallel view Megatron keeps to the inner DP group of one worker, so that nothing
in Megatron (or DeepSpeed, through the mpu) ever reduces across workers.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as mps

from muloco.core import comm
from muloco.core.topology import (ParallelSizes, Topology, coordinates,
                              inner_data_parallel_ranks, rank_of, RankCoordinates)


def _tensor_and_inner_data_ranks(sizes: ParallelSizes) -> list[list[int]]:
    return [[rank_of(RankCoordinates(k, d, p, t), sizes) for d in range(sizes.data) for t in range(sizes.tensor)]
            for k in range(sizes.workers) for p in range(sizes.pipeline)]


def initialize_megatron_groups(topology: Topology, timeout: timedelta) -> None:
    sizes = topology.sizes
    mps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        order="tp-pp-dp",
        create_gloo_process_groups=False,
        distributed_timeout_minutes=max(1, int(timeout.total_seconds() // 60)),
    )
    rank = dist.get_rank()
    dp_ranks = next(r for r in inner_data_parallel_ranks(sizes) if rank in r)
    tp_dp_group = comm.new_subgroups(_tensor_and_inner_data_ranks(sizes), timeout)
    dp_group = topology.inner_dp_group
    mps._DATA_PARALLEL_GROUP = dp_group
    mps._DATA_PARALLEL_GROUP_GLOO = dp_group
    mps._DATA_PARALLEL_GLOBAL_RANKS = dp_ranks
    mps._DATA_PARALLEL_GROUP_WITH_CP = dp_group
    mps._DATA_PARALLEL_GROUP_WITH_CP_AG = None
    mps._DATA_PARALLEL_GROUP_WITH_CP_GLOO = dp_group
    mps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = dp_ranks
    mps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = dp_group
    mps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = dp_group
    mps._TENSOR_AND_DATA_PARALLEL_GROUP = tp_dp_group
    mps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = tp_dp_group
    assert mps.get_data_parallel_world_size() == sizes.data, "Megatron DP must be the inner DP group"
    assert coordinates(rank, sizes).tensor == mps.get_tensor_model_parallel_rank()
    assert coordinates(rank, sizes).pipeline == mps.get_pipeline_model_parallel_rank()


class DeepSpeedMpu:
    """The `mpu` DeepSpeed expects, answered from Megatron's groups: "model parallel" is TP x PP,
    "data parallel" the inner DP group (so DeepSpeed never reduces across workers)."""

    get_data_parallel_group = staticmethod(mps.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(mps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(mps.get_data_parallel_world_size)
    get_model_parallel_group = staticmethod(mps.get_model_parallel_group)
    get_tensor_model_parallel_group = staticmethod(mps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(mps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(mps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(mps.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_group = staticmethod(mps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(mps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(mps.get_pipeline_model_parallel_world_size)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank(mps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size(mps.get_model_parallel_group())

    @staticmethod
    def get_data_parallel_group_ranks() -> list[int]:
        return list(mps._DATA_PARALLEL_GLOBAL_RANKS)
