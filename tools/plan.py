"""Plan a MuLoCo run before renting machines: parameters, per-rank memory, bytes per outer sync and
an idealised wall-clock for a token budget against data-parallel AdamW and Muon.

    python tools/plan.py --model 15b --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --data 4 \
        --workers 16 --sync-interval 30 --compression statistical:4 --error-feedback --seq-length 2048 \
        --global-batch-size 1024 --bandwidth-gbit 10 --tokens 1e11 \
        [--ds_config ds_configs/gpu_15b_muloco_k16.json] [--hook-zero {0,1,2,3}] [--json]

Shapes come from the real Megatron GPTModel: every pipeline stage of one tensor-parallel rank is
built on the meta device (no memory) in a single process that joins a *fake* T x P world
(torch's "fake" process-group backend), so Megatron's own layers decide the shard shapes. TP ranks of
a stage hold identically shaped shards, so one TP rank per stage is enough.

Memory model (bytes per rank, the largest pipeline stage; this trainer keeps fp32 parameters and
runs bf16 as Megatron autocast over them):
  weights 4/param; bf16 weight copies autocast keeps for the backward 2/param (bf16 only);
  gradients 4/param (DeepSpeed without ZeRO keeps them in the parameter dtype);
  Muon momentum 4 per Muon parameter (2 with muon.momentum_dtype bfloat16); AdamW moments 8 per
  AdamW parameter;
  Muon step workspace: the peak of the step's transient buffers on the busiest rank, and Muon's bytes
  sent per rank per inner step (intra-worker, reported next to the gradient all-reduce, not in the
  wall-clock), both from trainer/optim/muon_comm_model.py, the formulas DistributedMuon executes;
  activations (Korthikanti et al. 2022, no sequence parallelism, no recomputation, Megatron's local
  attention that materialises the scores): s*b*h*(10 + 24/T + 5*a*s/(h*T)) bytes per layer and
  micro-batch of b sequences, min(P, M) micro-batches in flight on the first stage (1F1B);
  logits on the last stage: 8 bytes per token and local vocab entry (fp32 logits and their gradient).
  Not counted: the CUDA context and allocator fragmentation (keep ~10% headroom).
Host memory (outer state, per rank): each of the D inner-DP replicas owns ~1/D of its shard (the
outer loop's own owner assignment): fp32 global weights 4 + outer momentum 4 + error feedback 4 (the
compressed parameters, when on) + the fp32 pseudogradient 4 built at a sync.

A DeepSpeed hook run (`--hook-zero N`: a team's own loop with muloco/hook/ attached) is the same
model as DeepSpeed holds it (`zero_model_states`): the model's weights in bf16 with fp32 master weights
in the optimizer (or all fp32), the master weights and optimizer state partitioned over D from ZeRO 1,
the gradients from ZeRO 2, the weights from ZeRO 3 (plus what it keeps gathered: up to 1e9); the
synced shard and its host outer state are the rank's ZeRO partition (`hook_synced`).

Bytes per outer sync per rank: the compression module's `Compressor.payload_nbytes` on each owned
tensor as the outer loop sends it (row-parallel weights transposed; embeddings/head and 1-D tensors
at `embedding_bits` / `vector_bits`, via `compression_group`), put through the formulas of
muloco/diloco/averaging.py (all_gather: (K-1) * S; reduce_scatter: sum_{j != k} S_j + (K-1) * max_j S_j),
plus (K-1) * (8 + 16) bytes of header in the first collective (the payload's norm claim and the
skip-vote ballot), K + 8 bytes of verdicts and claim ahead of each re-quantized chunk
(reduce_scatter), and with the job secret (on unless `"auth": "none"`) a 32-byte tag on every part
sent (all_gather: K-1 of them; reduce_scatter: 2 (K-1)).

Wall-clock model (idealised): compute is 6 * N * tokens FLOPs at `--mfu` of `--gpu-tflops` per GPU,
on the same K*D*P*T GPUs for every method, stretched by the pipeline bubble (M + P - 1) / M.
The K datacenters are joined by links of `--bandwidth-gbit` each; with `--bandwidth-scope datacenter`
(the default) the ranks of a datacenter share its link, with `rank` each rank has its own.
- DP AdamW / DP Muon: every step, a hierarchical gradient all-reduce whose cross-datacenter part is a
  ring all-reduce over K of each rank's 1/D share of its shard, 2 (K-1)/K * shard/D * `--dp-grad-bytes`,
  assumed perfectly overlapped with compute (step = max(compute, communication), the best case for DP).
- MuLoCo: every H steps one sync of the bytes above, not overlapped (or overlapped with tau inner steps
  when the ds_config's streaming block sets overlap_steps). With `--codec-json FILE` (the last line of
  `benchmarks/codec_throughput.py` run on the target device) the sync also pays the codec on the
  busiest rank's E owned elements: all_gather encodes E and decodes K payloads of E; reduce_scatter
  encodes E, decodes K chunks of E/K, re-encodes E/K and decodes the K averaged chunks.
Latency, the intra-datacenter collectives and Newton-Schulz time are ignored. Same tokens for every
method: MuLoCo at K > 1 reaches a somewhat higher loss at equal tokens (the paper's final-loss table, see docs/performance.md), which this
model does not price in.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import (DATA_FLAGS, DS_CONFIG_FLAGS, MODEL_FLAGS, RUN_FLAGS, add_ds_config_flag, add_global_batch_size,
                            check_model_shape)
from trainer.flags import Flag, add_flags, field_flag
from muloco.diloco.packing import row_split
from muloco.diloco.auth import TAG_BYTES
from muloco.diloco.payload_checks import CLAIM_BYTES
from muloco.diloco.compression import Compressor, compression_group, rows_shape
from muloco.diloco.config import CompressionConfig, MuLoCoConfig
from muloco.diloco.plan import TensorSpec, synced_tensors
from muloco.diloco.membership import STATIC_HEADER_BYTES
from muloco.core.typed_json import read_json_object
from trainer.ds_config import LayoutConfig, load_ds_config
from muloco.core.errors import ConfigError, TopologyError
from trainer.model.sharding import sharding_of
from trainer.model.presets import PRESETS, ModelShape
from trainer.model.stages import stage_layers
from trainer.optim.config import MuonParams, OptimizerConfig
from trainer.optim.muon import MOMENTUM_DTYPES
from trainer.optim.muon_comm_model import MuonExchange, comm_dtype, grad_allreduce_bytes
from muloco.core.ownership import assign_owners
from trainer.recipe import PAPER_VOCAB  # the paper presets' counts match a Llama-3 vocabulary
from muloco.core.topology import ParallelSizes
from muloco.core.typed_json import set_path

GIB = 1024 ** 3


@dataclass(frozen=True)
class WirePiece:
    """A flat piece of a parameter that a DeepSpeed hook rank syncs (a row block of its ZeRO partition)."""
    name: str
    wire_shape: tuple[int, int]
    group: str

    @property
    def numel(self) -> int:
        return self.wire_shape[0] * self.wire_shape[1]


@dataclass(frozen=True)
class ShardParam:
    """One parameter as one TP rank of one pipeline stage holds it."""
    name: str
    shape: tuple[int, ...]
    tensor_parallel: bool  # split across TP ranks (False: replicated, e.g. norms)
    transposed_on_wire: bool  # row-parallel weights are compressed by columns
    embedding_or_output: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def group(self) -> str:
        return compression_group(self.shape, self.embedding_or_output)

    @property
    def wire_shape(self) -> tuple[int, int]:
        """(rows, columns) as compressed: row-parallel weights by columns."""
        return rows_shape((self.shape[1], self.shape[0]) if self.transposed_on_wire else self.shape)

    @property
    def muon(self) -> bool:
        """Routed to Muon when the inner optimizer is Muon (trainer.optim.routing's rule)."""
        return len(self.shape) == 2 and not self.embedding_or_output


# -- shapes from the real model -------------------------------------------------------------------

def build_stage_shards(shape: ModelShape, vocab_size: int, tensor: int, pipeline: int) -> list[list[ShardParam]]:
    """Parameters of TP rank 0 of every pipeline stage, from Megatron's GPTModel built on meta."""
    # Imported here: megatron-core and the fake backend are only needed for building.
    from megatron.core import parallel_state as mps
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from megatron_patches import apply_cpu_shims_if_needed
    from trainer.model.builder import build_model, padded_vocab_size

    check_model_shape(shape, tensor, pipeline)
    vocab = padded_vocab_size(vocab_size, tensor)
    apply_cpu_shims_if_needed()
    stages = []
    for stage in range(pipeline):
        # A single process cannot join a real T x P world; the fake backend lets it be any rank.
        dist.init_process_group("fake", rank=stage * tensor, world_size=tensor * pipeline, store=FakeStore())
        try:
            mps.initialize_model_parallel(tensor, pipeline, order="tp-pp-dp", create_gloo_process_groups=False)
            with torch.device("meta"):
                model = build_model(shape, vocab)
            stages.append([ShardParam(name, tuple(p.shape), sharding_of(name).partition_dim is not None,
                                      sharding_of(name).partition_dim == 1,
                                      name.endswith(("word_embeddings.weight", "output_layer.weight")))
                           for name, p in model.named_parameters()])
        finally:
            mps.destroy_model_parallel()
            dist.destroy_process_group()
    return stages


def parameter_count(stages: list[list[ShardParam]], tensor: int) -> int:
    """Global count: TP-split parameters times T, replicated ones once."""
    return sum(p.numel * (tensor if p.tensor_parallel else 1) for stage in stages for p in stage)


# -- inputs ---------------------------------------------------------------------------------------

@dataclass
class PlanInputs:
    model: str
    sizes: ParallelSizes  # K x D x P x T
    muloco: MuLoCoConfig  # the ds_config's outer loop (its defaults when it has none)
    optimizer: OptimizerConfig  # the inner optimizer: muon (MuLoCo) or adamw (DiLoCo)
    seq_length: int
    global_batch: int
    micro_batch: int
    bf16: bool
    bandwidth_gbit: float
    bandwidth_scope: str
    tokens: float
    gpu_tflops: float
    mfu: float
    dp_grad_bytes: int
    vocab_size: int
    gpu_memory_gib: float
    codec: CodecThroughput | None = None  # None: the codec's time is not modelled
    hook_zero: int | None = None  # a DeepSpeed hook run (muloco/hook/) under this ZeRO stage; None: this trainer's run

    @property
    def compression(self) -> CompressionConfig:
        return self.muloco.compression

    @property
    def authenticated(self) -> bool:
        """Every outer message tagged (muloco.auth; off only with "none")."""
        return self.muloco.auth != "none"

    @property
    def muon(self) -> MuonParams | None:
        """Muon's hyperparameters when it is the inner optimizer."""
        return self.optimizer.params if isinstance(self.optimizer.params, MuonParams) else None

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per step (gradient accumulation), from B split over K workers x D."""
        per_step = self.micro_batch * self.sizes.data * self.sizes.workers
        if self.global_batch % per_step:
            raise ConfigError(f"global batch {self.global_batch} is not divisible by micro-batch x D x K = "
                              f"{self.micro_batch} x {self.sizes.data} x {self.sizes.workers}")
        return self.global_batch // per_step


@dataclass(frozen=True)
class CodecThroughput:
    """Elements per second of one compression setting's encoder and decoder on the target device."""
    encode: float
    decode: float
    source: str

    @classmethod
    def from_benchmark(cls, path: Path, compression: CompressionConfig) -> "CodecThroughput | None":
        """The row of `compression` in benchmarks/codec_throughput.py's JSON (its last line); None for
        method none, which has no codec."""
        if compression.method == "none":
            return None
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        try:
            rows = json.loads(lines[-1])["rows"]
        except (IndexError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"--codec-json {path}: not the JSON last line of benchmarks/codec_throughput.py") from err
        for row in rows:
            same = row.get("method") == compression.method and (
                row.get("topk_fraction") == compression.topk_fraction if compression.method == "topk"
                else row.get("bits") == compression.bits)
            if same:
                return cls(float(row["encode_elements_per_s"]), float(row["decode_elements_per_s"]), str(path))
        raise ConfigError(f"--codec-json {path} has no row for {compression.method} "
                          f"{compression.topk_fraction if compression.method == 'topk' else compression.bits}")

    def sync_seconds(self, owned_elements: float, workers: int, collective: str) -> float:
        E, K = owned_elements, workers
        if collective == "all_gather":
            return E / self.encode + K * E / self.decode
        return (E + E / K) / self.encode + 2 * E / self.decode


def parse_compression(spec: str) -> dict:
    """The compression block of 'none', 'statistical:4', 'linear:2', 'topk:0.02' (no argument: the
    block's default bits or fraction)."""
    method, _, arg = spec.partition(":")
    if method == "none" or not arg:
        return {"method": method}
    return {"method": method, **({"topk_fraction": float(arg)} if method == "topk" else {"bits": int(arg)})}


# -- memory ---------------------------------------------------------------------------------------

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


# -- a DeepSpeed hook run (muloco/hook/) ------------------------------------------------------------

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


def hook_synced(stage: list[ShardParam], zero: int, data: int, replica: int) -> list[ShardParam | WirePiece]:
    """What inner-DP replica `replica` syncs in a hook run (muloco/hook/engine_shards.py): at ZeRO 0 the
    whole parameters it owns (as this trainer's ranks), at ZeRO 3 its partition of every parameter
    (each cut into D equal parts, the last one padded), at ZeRO 1/2 its slice of the flat partition
    (the parameters end to end, cut into D equal parts; DeepSpeed's few elements of alignment padding
    left out); a piece of a parameter synced as plan.synced_tensors cuts it into row blocks."""
    if zero == 0:
        return _owned(stage, data, replica)
    pieces = []  # (parameter, first element, elements)
    if zero >= 3:
        for p in stage:
            size = -(-p.numel // data)
            count = min(size, p.numel - replica * size)
            if count > 0:
                pieces.append((p, replica * size, count))
    else:
        size = -(-sum(p.numel for p in stage) // data)
        low, high, offset = replica * size, (replica + 1) * size, 0
        for p in stage:
            start, end = max(low, offset), min(high, offset + p.numel)
            if start < end:
                pieces.append((p, start - offset, end - start))
            offset += p.numel
    specs = [TensorSpec(name=p.name, shape=p.shape, offset=first, embedding_or_head=p.embedding_or_output)
             for p, first, _ in pieces]
    synced = synced_tensors([torch.empty(count, device="meta") for _, _, count in pieces], specs, 1)
    return [WirePiece(t.name, t.wire_shape, t.group) for t in synced]


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


def _owned(stage: list[ShardParam], data: int, replica: int) -> list[ShardParam]:
    """The parameters inner-DP replica `replica` syncs (muloco.diloco.plan.owned_by's assignment)."""
    owners = assign_owners([p.numel for p in stage], data)
    return [p for p, owner in zip(stage, owners) if owner == replica]


def _sent_uncompressed(p: ShardParam | WirePiece, compression: CompressionConfig) -> bool:
    return _config_of_group(compression, p.group).method == "none"


@functools.cache  # a 15B plan asks once per tensor per rank: hundreds of thousands of times
def _config_of_group(compression: CompressionConfig, group: str) -> CompressionConfig:
    return compression.for_group(group)


def outer_state_bytes(synced: list[ShardParam | WirePiece], compression: CompressionConfig) -> float:
    """Host bytes of the outer state of what one rank syncs: fp32 global weights 4, outer momentum 4,
    the pseudogradient built at a sync 4, and error feedback 4 where compressed with it."""
    ef = compression.error_feedback
    return sum(p.numel * (12 + (4 if ef and not _sent_uncompressed(p, compression) else 0)) for p in synced)


def host_outer_state(stage: list[ShardParam], inputs: PlanInputs) -> float:
    return max(outer_state_bytes(_owned(stage, inputs.sizes.data, d), inputs.compression)
               for d in range(inputs.sizes.data))


# -- bytes ----------------------------------------------------------------------------------------

def sync_bytes_sent(params: list[ShardParam | WirePiece], compression: CompressionConfig, collective: str,
                    workers: int, outer_rank: int, authenticated: bool = True) -> int:
    """Bytes one rank sends in one outer sync of `params` (averaging.py's accounting), the header
    (norm claim, skip-vote ballot, the worker's steps and weights digest: every rank sends it to the K-1
    others, with or without params) and, when authenticated, the tags included."""
    if workers == 1:
        return 0
    headers = (workers - 1) * (CLAIM_BYTES + STATIC_HEADER_BYTES)
    tags = (workers - 1) * TAG_BYTES if authenticated else 0

    def nbytes(p: ShardParam | WirePiece, shape) -> int:
        size = Compressor(_config_of_group(compression, p.group)).payload_nbytes(shape)
        if size is None:
            raise ConfigError("zstd payload sizes depend on the data; plan without zstd")
        return size

    if collective == "all_gather":
        return (workers - 1) * sum(nbytes(p, p.wire_shape) for p in params) + headers + tags
    chunk = [0] * workers  # S_j: bytes of row chunk j over all tensors
    for p in params:
        rows, cols = p.wire_shape
        for j, count in enumerate(row_split(rows, workers)):
            chunk[j] += nbytes(p, (count, cols))
    verdicts = workers + CLAIM_BYTES  # ahead of each owner's re-quantized chunk
    return (sum(s for j, s in enumerate(chunk) if j != outer_rank) + (workers - 1) * (max(chunk) + verdicts)
            + headers + 2 * tags)


@dataclass
class SyncBytes:
    per_rank_max: int  # the busiest rank
    per_rank_mean: float  # what the trainer logs as bytes_sent_per_rank
    per_worker: int  # all ranks of one datacenter together (mean over workers)
    uncompressed_per_rank_max: int  # the same sync without compression, for the ratio


def outer_sync_bytes(stages: list[list[ShardParam]], inputs: PlanInputs) -> SyncBytes:
    K, D = inputs.sizes.workers, inputs.sizes.data
    synced = [[_owned(stage, D, d) if inputs.hook_zero is None else hook_synced(stage, inputs.hook_zero, D, d)
               for d in range(D)] for stage in stages]

    def per_rank(compression: CompressionConfig) -> list[int]:
        # TP ranks of a stage hold identically shaped shards, so stage 0's TP rank 0 stands for all T.
        return [sync_bytes_sent(params, compression, inputs.muloco.collective, K, k, inputs.authenticated)
                for k in range(K) for stage in synced for params in stage]

    sent = per_rank(inputs.compression)
    raw = per_rank(CompressionConfig("none"))
    total = sum(sent) * inputs.sizes.tensor  # over every rank of the world
    return SyncBytes(max(sent), total / inputs.sizes.world, round(total / inputs.sizes.workers), max(raw))


# -- wall-clock -----------------------------------------------------------------------------------

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


# -- the plan -------------------------------------------------------------------------------------

@dataclass
class Plan:
    inputs: PlanInputs
    parameters: int
    memory: list[Memory]  # the worst stage of the MuLoCo run's inner optimizer, then of DP AdamW
    sync: SyncBytes
    times: list[MethodTime]
    fits: bool


def _memory_model(inputs: PlanInputs):
    return stage_memory if inputs.hook_zero is None else hook_memory


def make_plan(inputs: PlanInputs) -> Plan:
    shape = PRESETS[inputs.model].with_overrides(seq_length=inputs.seq_length)
    stages = build_stage_shards(shape, inputs.vocab_size, inputs.sizes.tensor, inputs.sizes.pipeline)
    params = parameter_count(stages, inputs.sizes.tensor)
    memory_of = _memory_model(inputs)
    memory = [max((memory_of(i, stage, inputs, muon_inner) for i, stage in enumerate(stages)),
                  key=lambda m: m.device_total) for muon_inner in (inputs.muon is not None, False)]
    sync = outer_sync_bytes(stages, inputs)
    fits = memory[0].device_total * 1.1 <= inputs.gpu_memory_gib * GIB
    return Plan(inputs, params, memory, sync, wall_clock(params, stages, sync, inputs), fits)


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def render(plan: Plan) -> str:
    i = plan.inputs
    z = i.sizes
    run = "this trainer" if i.hook_zero is None else f"a DeepSpeed hook run (muloco/hook/) at ZeRO {i.hook_zero}"
    lines = [f"# plan: {i.model}, K={z.workers} x D={z.data} x P={z.pipeline} x T={z.tensor} = {z.world} GPUs, {run}",
             f"parameters: {plan.parameters:,} (vocab {i.vocab_size}, seq {i.seq_length})",
             f"pipeline stages: {' + '.join(map(str, stage_layers(PRESETS[i.model].num_layers, z.pipeline)))} layers",
             f"batch: B={i.global_batch} sequences/step = {i.global_batch // z.workers} per worker = "
             f"micro {i.micro_batch} x accumulation {i.micro_batches} x D {z.data}",
             "", f"## memory per rank (worst pipeline stage; {_precision(i)})",
             f"| | {i.optimizer.type} inner (stage {plan.memory[0].stage}) | adamw (stage {plan.memory[1].stage}) |",
             "|---|---|---|"]
    for key in ("weights", "bf16_weight_copies", "master_weights", "gradients", "muon_momentum", "adamw_moments",
                "muon_workspace", "activations", "logits"):
        lines.append(f"| {key} | {_gib(getattr(plan.memory[0], key))} | {_gib(getattr(plan.memory[1], key))} |")
    lines += [f"| **device total** | **{_gib(plan.memory[0].device_total)}** | {_gib(plan.memory[1].device_total)} |",
              f"| host outer state | {_gib(plan.memory[0].host_outer_state)} | |",
              f"fits a {i.gpu_memory_gib:g} GiB GPU with 10% headroom: {'yes' if plan.fits else 'NO'}"]
    if i.hook_zero is None:  # DistributedMuon's exchange (DeepSpeed's own Muon is not modelled)
        lines.append(f"Muon exchange per inner step ({i.muon.ns_dtype if i.muon else '-'}, intra-worker): "
                     f"{plan.memory[0].muon_bytes_per_step:,} B per rank vs the fp32 gradient all-reduce's "
                     f"{plan.memory[0].grad_allreduce_bytes_per_step:,} B")
    lines += ["", f"## bytes per outer sync ({i.compression.method}"
              f"{'' if i.compression.method == 'none' else ':' + str(i.compression.bits)}"
              f"{'+EF' if i.compression.error_feedback else ''}, {i.muloco.collective})",
              f"per rank: {plan.sync.per_rank_max:,} B (max), {plan.sync.per_rank_mean:,.0f} B (mean); "
              f"per datacenter: {plan.sync.per_worker:,} B; "
              f"uncompressed per rank: {plan.sync.uncompressed_per_rank_max:,} B "
              f"({plan.sync.uncompressed_per_rank_max / max(plan.sync.per_rank_max, 1):.1f}x)",
              "", f"## idealised wall-clock for {i.tokens:.3g} tokens at {i.bandwidth_gbit:g} Gbit/s per "
              f"{i.bandwidth_scope} ({i.gpu_tflops:g} TFLOP/s x MFU {i.mfu:g}; codec "
              + (f"{i.codec.encode / 1e6:,.0f}M/{i.codec.decode / 1e6:,.0f}M elements/s encode/decode from "
                 f"{i.codec.source})" if i.codec else "time not modelled: see --codec-json)"),
              "| method | steps | compute s/step | cross-DC s/step | hours | vs fastest | cross-DC bytes/rank |",
              "|---|---|---|---|---|---|---|"]
    fastest = min(t.total_hours for t in plan.times)
    for t in plan.times:
        lines.append(f"| {t.method} | {t.steps:,} | {t.compute_s_per_step:.3f} | {t.communication_s_per_step:.3f} | "
                     f"{t.total_hours:,.1f} | {t.total_hours / fastest:.2f}x | {t.cross_dc_bytes_per_rank:.3g} |")
    return "\n".join(lines)


def _precision(inputs: PlanInputs) -> str:
    if inputs.hook_zero is None:
        return "bf16 autocast" if inputs.bf16 else "fp32"
    return "bf16 weights, fp32 master weights" if inputs.bf16 else "fp32"


def _trainer_flag(field: str) -> Flag:
    return next(f for f in (*RUN_FLAGS, *DATA_FLAGS, *MODEL_FLAGS, *DS_CONFIG_FLAGS) if f.field == field)


# The flags that set ds_config values before the trainer's loader reads it, so plan and run read the
# same values: the trainer's own (T and P planned into the layout block the trainer checks a run
# against), and the planner's for settings the trainer takes from the ds_config only.
DS_FLAGS = [replace(_trainer_flag("tensor_parallel"), path="layout.tensor"),
            replace(_trainer_flag("pipeline_parallel"), path="layout.pipeline"),
            field_flag("--data", LayoutConfig, "data", "layout.data"),
            _trainer_flag("train_micro_batch_size_per_gpu"),
            field_flag("--workers", MuLoCoConfig, "workers", "muloco.workers"),
            field_flag("--sync-interval", MuLoCoConfig, "sync_interval", "muloco.sync_interval"),
            field_flag("--collective", MuLoCoConfig, "collective", "muloco.collective")]
ERROR_FEEDBACK = field_flag("--error-feedback", CompressionConfig, "error_feedback",
                            "muloco.compression.error_feedback")


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    raw = read_json_object(args.ds_config) if args.ds_config else {}
    origins = {}
    if args.compression is not None:  # the whole block: what the ds_config's said of another method goes
        set_path(raw, "muloco.compression", parse_compression(args.compression))
        origins.update({f"muloco.compression.{k}": "--compression" for k in ("method", "bits", "topk_fraction")})
    for flag in [*DS_FLAGS, ERROR_FEEDBACK]:
        if getattr(args, flag.field) is not None:
            set_path(raw, flag.path, getattr(args, flag.field))
            origins[flag.path] = flag.name
    ds = load_ds_config(raw, origins)
    ds.check_model(args.model)
    layout = ds.layout or LayoutConfig()  # the layout the ds_config was planned for
    muloco = ds.muloco or MuLoCoConfig()  # without an outer loop: MuLoCo planned at its defaults
    sizes = ParallelSizes(workers=muloco.workers, data=layout.data or 1, pipeline=layout.pipeline or 1,
                          tensor=layout.tensor or 1)
    micro = ds.train_micro_batch_size_per_gpu
    if args.global_batch_size is not None:
        global_batch = args.global_batch_size
    else:
        global_batch = micro * ds.gradient_accumulation_steps * sizes.data * sizes.workers
    codec = CodecThroughput.from_benchmark(args.codec_json, muloco.compression) if args.codec_json else None
    return PlanInputs(
        model=args.model, sizes=sizes, muloco=muloco, optimizer=ds.optimizer,
        seq_length=PRESETS[args.model].with_overrides(seq_length=args.seq_length).seq_length,
        global_batch=global_batch, micro_batch=micro, bf16=ds.bf16.enabled,
        bandwidth_gbit=args.bandwidth_gbit, bandwidth_scope=args.bandwidth_scope, tokens=args.tokens,
        gpu_tflops=args.gpu_tflops, mfu=args.mfu, dp_grad_bytes=args.dp_grad_bytes,
        vocab_size=PAPER_VOCAB if args.vocab_size is None else args.vocab_size,
        gpu_memory_gib=args.gpu_memory_gib, codec=codec, hook_zero=args.hook_zero)


# -- which layouts fit a node ---------------------------------------------------------------------

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
            worst = max(_memory_model(inputs)(i, stage, candidate, inputs.muon is not None).device_total
                        for i, stage in enumerate(stages))
            fits.append(LayoutFit(tensor, pipeline, worst / GIB, worst * 1.1 <= inputs.gpu_memory_gib * GIB))
    return fits


def render_layouts(inputs: PlanInputs, fits: list[LayoutFit]) -> str:
    shape = PRESETS[inputs.model]
    lines = [f"## layouts of {inputs.model} on {NODE_GPUS}-GPU nodes of {inputs.gpu_memory_gib:g} GiB "
             f"(D={inputs.sizes.data}, micro-batch {inputs.micro_batch}, {inputs.optimizer.type} inner)",
             "| T | P | stage layers | GiB per GPU (worst stage) | fits |", "|---|---|---|---|---|"]
    for f in fits:
        layers = " + ".join(map(str, stage_layers(shape.num_layers, f.pipeline)))
        lines.append(f"| {f.tensor} | {f.pipeline} | {layers} | {f.device_gib:.1f} | {'yes' if f.fits else 'no'} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(PRESETS))
    # Each over the ds_config's value at its path; neither given: the setting's default.
    g = p.add_argument_group("the ds_config's settings")
    add_flags(g, DS_FLAGS, override=True, where="default: the ds_config's {path}")
    add_global_batch_size(g)
    g.add_argument("--compression", default=None,
                   help="none | statistical:BITS | linear:BITS | topk:FRACTION (the whole muloco.compression block)")
    add_flags(g, [ERROR_FEEDBACK], override=True, where="default: the ds_config's {path}")
    g = p.add_argument_group("the model")
    add_flags(g, [_trainer_flag("seq_length")], override=True, where="default: the preset's")
    add_flags(g, [_trainer_flag("vocab_size")], override=True)  # its doc says the planner's default
    p.add_argument("--bandwidth-gbit", type=float, default=10.0)
    p.add_argument("--bandwidth-scope", choices=["datacenter", "rank"], default="datacenter")
    p.add_argument("--tokens", type=float, default=1e11)
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s per GPU (H100 SXM)")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--dp-grad-bytes", type=int, default=2, help="bytes per gradient element DP all-reduces (bf16)")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    add_ds_config_flag(p, required=False, help="take K, H, compression, collective, optimizer, bf16, batch and layout "
                       "from it, as the trainer reads them (without one: the trainer's defaults, AdamW in fp32)")
    p.add_argument("--codec-json", type=Path, default=None,
                   help="benchmarks/codec_throughput.py's output on the target device: the sync's codec time")
    p.add_argument("--hook-zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="plan a DeepSpeed hook run (muloco/hook/: a team's own loop) under this ZeRO stage instead of "
                        "this trainer's run: DeepSpeed's weights, master weights and gradients, the ZeRO partition "
                        "as the synced shard")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of markdown")
    p.add_argument("--list-layouts", action="store_true",
                   help=f"also list every T x P that fits {NODE_GPUS}-GPU nodes of --gpu-memory-gib")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the asked-for layout fits the GPU memory, 1 when it does not, 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        inputs = inputs_from_args(args)
        plan = make_plan(inputs)
        fits = layouts_that_fit(inputs) if args.list_layouts else None
    except (ConfigError, TopologyError, ValueError) as err:
        print(f"plan error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(plan), **({"layouts": [asdict(f) for f in fits]} if fits is not None else {})},
                         default=str))
    else:
        print(render(plan))
        if fits is not None:
            print("\n" + render_layouts(inputs, fits))
    if not plan.fits:
        print(f"plan error: T={inputs.sizes.tensor} P={inputs.sizes.pipeline} needs "
              f"{plan.memory[0].device_total / GIB:.1f} GiB per GPU, more than {args.gpu_memory_gib:g} GiB with 10% "
              "headroom (--list-layouts shows the layouts that fit)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
