"""A plan: the model's parameters, the worst stage's memory, bytes per sync and the wall-clock of each method, and
which T x P layouts fit a node."""
from __future__ import annotations

from dataclasses import dataclass, replace

from muloco.core.errors import ConfigError
from tools.planning.inputs import PlanInputs
from tools.planning.memory import Memory, memory_model
from tools.planning.shards import build_stage_shards, parameter_count
from tools.planning.sync_bytes import SyncBytes, outer_sync_bytes
from tools.planning.wall_clock import MethodTime, wall_clock
from trainer.config import check_model_shape
from trainer.model.presets import PRESETS

GIB = 1024 ** 3


@dataclass
class Plan:
    inputs: PlanInputs
    parameters: int
    memory: list[Memory]  # the worst stage of the MuLoCo run's inner optimizer, then of DP AdamW
    sync: SyncBytes
    times: list[MethodTime]
    fits: bool


def make_plan(inputs: PlanInputs) -> Plan:
    shape = PRESETS[inputs.model].with_overrides(seq_length=inputs.seq_length)
    stages = build_stage_shards(shape, inputs.vocab_size, inputs.sizes.tensor, inputs.sizes.pipeline)
    params = parameter_count(stages, inputs.sizes.tensor)
    memory_of = memory_model(inputs)
    memory = [max((memory_of(i, stage, inputs, muon_inner) for i, stage in enumerate(stages)),
                  key=lambda m: m.device_total) for muon_inner in (inputs.muon is not None, False)]
    sync = outer_sync_bytes(stages, inputs)
    fits = memory[0].device_total * 1.1 <= inputs.gpu_memory_gib * GIB
    return Plan(inputs, params, memory, sync, wall_clock(params, stages, sync, inputs), fits)


# -- which layouts fit a node

NODE_GPUS = 8


@dataclass
class LayoutFit:
    tensor: int
    pipeline: int
    device_gib: float  # the MuLoCo run's worst stage
    fits: bool


def layouts_that_fit(inputs: PlanInputs, max_pipeline: int = 8) -> list[LayoutFit]:
    """Every T (within one node of NODE_GPUS) x P the model can be split into, at the inputs' D, K,
    micro-batch and batch, with its per-GPU memory: what a user of NODE_GPUS-GPU nodes can run."""
    shape = PRESETS[inputs.model].with_overrides(seq_length=inputs.seq_length)
    fits = []
    for tensor in (t for t in range(1, NODE_GPUS + 1) if NODE_GPUS % t == 0):
        for pipeline in range(1, max_pipeline + 1):
            try:
                check_model_shape(shape, tensor, pipeline)
            except ConfigError:
                continue
            candidate = replace(inputs, sizes=replace(inputs.sizes, tensor=tensor, pipeline=pipeline))
            stages = build_stage_shards(shape, inputs.vocab_size, tensor, pipeline)
            worst = max(memory_model(inputs)(i, stage, candidate, inputs.muon is not None).device_total
                        for i, stage in enumerate(stages))
            fits.append(LayoutFit(tensor, pipeline, worst / GIB, worst * 1.1 <= inputs.gpu_memory_gib * GIB))
    return fits
