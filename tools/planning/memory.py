"""Bytes per rank of the worst pipeline stage: device memory (weights, gradients, the inner optimizer's state and
Muon's workspace, activations, logits) and the host's outer state, for this trainer's run or a DeepSpeed hook run."""
from __future__ import annotations

from dataclasses import dataclass, replace

from muloco.diloco.config import CompressionConfig
from tools.planning.inputs import PlanInputs
from tools.planning.shards import ShardParam
from tools.planning.synced import WirePiece, config_of_group, hook_synced, owned_by_replica
from trainer.model.presets import PRESETS
from trainer.model.stages import stage_layers
from trainer.optim.muon import MOMENTUM_DTYPES
from trainer.optim.muon_comm_model import MuonExchange, comm_dtype, grad_allreduce_bytes


@dataclass
class Memory:
    stage: int
    weights: float
    bf16_weight_copies: float
    gradients: float
    muon_momentum: float
    adamw_moments: float
    muon_workspace: float
    activations: float
    logits: float
    host_outer_state: float  # host memory, per rank
    muon_bytes_per_step: int = 0  # sent per rank per inner step by Muon's exchange (busiest rank)
    grad_allreduce_bytes_per_step: int = 0  # DeepSpeed's inner-DP fp32 gradient all-reduce, per rank
    master_weights: float = 0.0  # DeepSpeed's fp32 master copy (a hook run: its ZeRO partition or bf16 optimizer)

    @property
    def device_total(self) -> float:
        return (self.weights + self.bf16_weight_copies + self.master_weights + self.gradients + self.muon_momentum
                + self.adamw_moments + self.muon_workspace + self.activations + self.logits)


def stage_memory(stage_index: int, stage: list[ShardParam], inputs: PlanInputs, muon_inner: bool) -> Memory:
    """`muon_inner`: the inputs' Muon as the inner optimizer (else AdamW on every parameter)."""
    shape = PRESETS[inputs.model].with_overrides(seq_length=inputs.seq_length)
    T, P = inputs.sizes.tensor, inputs.sizes.pipeline
    n = sum(p.numel for p in stage)
    muon = [p for p in stage if p.muon] if muon_inner else []
    n_muon = sum(p.numel for p in muon)
    workspace = muon_bytes = momentum_size = 0
    if muon:
        momentum_size = MOMENTUM_DTYPES[inputs.muon.momentum_dtype].itemsize
        exchange = MuonExchange.for_local_shards([p.name for p in muon], [p.shape for p in muon], shape, T,
                                                 inputs.sizes.data, inputs.muon.ns_steps, ns_form=inputs.muon.ns_form)
        element_size = comm_dtype(inputs.muon.ns_dtype).itemsize
        workspace = exchange.max_transient_bytes(element_size, element_size, [p.numel for p in muon],
                                                 inputs.muon.nesterov, momentum_size)
        muon_bytes = exchange.max_bytes_sent(element_size).total
    s, b, h, a = inputs.seq_length, inputs.micro_batch, shape.hidden_size, shape.num_attention_heads
    per_layer = s * b * h * (10 + 24 / T + 5 * a * s / (h * T))
    layers = stage_layers(shape.num_layers, P)[stage_index]
    in_flight = min(P - stage_index, inputs.micro_batches)  # 1F1B: stage i holds P - i micro-batches
    vocab_local = sum(p.shape[0] for p in stage if p.name.endswith("output_layer.weight"))
    return Memory(
        stage=stage_index,
        weights=4 * n,
        bf16_weight_copies=2 * n if inputs.bf16 else 0,
        gradients=4 * n,
        muon_momentum=momentum_size * n_muon,
        adamw_moments=8 * (n - n_muon),
        muon_workspace=workspace,
        activations=per_layer * layers * in_flight,
        logits=8 * s * b * vocab_local,
        host_outer_state=host_outer_state(stage, inputs),
        muon_bytes_per_step=muon_bytes,
        grad_allreduce_bytes_per_step=grad_allreduce_bytes(n, inputs.sizes.data),
    )


# -- a DeepSpeed hook run (muloco/hook/)

ZERO3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters


def zero_model_states(params: list[ShardParam], zero: int, data: int, bf16: bool) -> dict[str, float]:
    """Bytes per rank of the model's weights, DeepSpeed's fp32 master weights and the gradients, as a
    DeepSpeed engine holds `params` under ZeRO `zero` with D = `data`: the weights in bf16 (with fp32
    master weights in its optimizer) or fp32; the master weights partitioned from ZeRO 1, the gradients
    (in the weights' dtype, plus the fp32 partition the optimizer steps with) from ZeRO 2, the weights
    from ZeRO 3, which keeps the weights it gathers for the forward until the backward has used them
    again, up to `stage3_max_live_parameters` (DeepSpeed's default, 1e9), and their gradients whole
    until reduced."""
    n = sum(p.numel for p in params)
    size = 2 if bf16 else 4

    def share(stage: int) -> int:
        return data if zero >= stage else 1

    gathered = min(n, ZERO3_MAX_LIVE_PARAMETERS) if zero >= 3 else 0
    fp32_gradients = 4 * n / data if zero >= 1 else (4 * n if bf16 else 0)  # bf16 at stage 0: fp32 accumulation
    return {"weights": size * (n / share(3) + gathered), "bf16_weight_copies": 0.0,
            "master_weights": 4 * n / share(1) if zero >= 1 or bf16 else 0.0,
            "gradients": size * (n / share(2) + gathered) + fp32_gradients}


def hook_memory(stage_index: int, stage: list[ShardParam], inputs: PlanInputs, muon_inner: bool) -> Memory:
    """stage_memory's run as a DeepSpeed engine holds it under ZeRO `inputs.hook_zero`: the model
    states of zero_model_states, the optimizer state partitioned from ZeRO 1, activations and logits
    as the trainer's, DeepSpeed's own Muon workspace not modelled; host outer state of what the
    busiest replica syncs."""
    zero, data = inputs.hook_zero, inputs.sizes.data
    base = stage_memory(stage_index, stage, inputs, muon_inner)
    share = data if zero >= 1 else 1
    host = max(outer_state_bytes(hook_synced(stage, zero, data, d), inputs.compression) for d in range(data))
    return replace(base, **zero_model_states(stage, zero, data, inputs.bf16), muon_momentum=base.muon_momentum / share,
                   adamw_moments=base.adamw_moments / share, muon_workspace=0, muon_bytes_per_step=0,
                   host_outer_state=host)


def outer_state_bytes(synced: list[ShardParam | WirePiece], compression: CompressionConfig) -> float:
    """Host bytes of the outer state of what one rank syncs: fp32 global weights 4, outer momentum 4,
    the pseudogradient built at a sync 4, and error feedback 4 where compressed with it."""
    ef = compression.error_feedback
    return sum(p.numel * (12 + (4 if ef and not _sent_uncompressed(p, compression) else 0)) for p in synced)


def host_outer_state(stage: list[ShardParam], inputs: PlanInputs) -> float:
    return max(outer_state_bytes(owned_by_replica(stage, inputs.sizes.data, d), inputs.compression)
               for d in range(inputs.sizes.data))


def _sent_uncompressed(p: ShardParam | WirePiece, compression: CompressionConfig) -> bool:
    return config_of_group(compression, p.group).method == "none"


def memory_model(inputs: PlanInputs):
    """stage_memory, or hook_memory for a DeepSpeed hook run."""
    return stage_memory if inputs.hook_zero is None else hook_memory
