"""What a DeepSpeed engine's inner optimizer updates on this rank: the tensors the outer loop keeps
state for and syncs.

- ZeRO stage 3: this rank's fp32 partition of every parameter, as DeepSpeed's public local API hands
  it (`deepspeed.utils.safe_get_local_fp32_param`: a view of the optimizer's flat fp32 partition,
  checked at attach to be that storage and not a copy). Nothing is gathered inside the worker. After
  the outer loop writes the partitions, the model's partitioned weights are refreshed from them as
  the optimizer step does it (`refresh_model_weights`).
- ZeRO stage 1 or 2 (and DeepSpeed's bf16 optimizer): this rank's fp32 master partition, as flat
  pieces of the model's parameters. DeepSpeed 0.19's public local API covers ZeRO-3 parameters only
  (it asserts `ds_id`) and its full-parameter API gathers over the data-parallel group, so the pieces
  come from the lp -> hp fragment mapping its universal checkpoints use (`param._hp_mapping`);
  `update_lp_params()` refreshes the model's weights (bf16 or fp32) from them.
- stage 0 in fp32: the module's parameters, replicated over the worker's D ranks; each rank owns 1/D
  of them for the sync and shares its result inside the worker.

A partition or a master partition is the shard: its global weights, momentum and error feedback live
on this rank alone and it is synced with the same partition of the other workers. With optimizer or
parameter offload to the host the partitions are host tensors and the same holds; NVMe offload,
whose partitions are swapped out between steps, fp16, and DeepSpeed's pipeline engine
(`PIPELINE_ENGINE` says why) are refused with the reason.

Parameters are described by shape and by the attributes model-parallel libraries set (plan.py):
embedding and output-embedding modules (`torch.nn.Embedding`, a Hugging Face model's
`get_output_embeddings()`, Megatron's `is_embedding_or_output_parameter`) form the "embedding"
compression group, 1-D tensors "vector", the rest "matrix". A tensor-parallel parameter (Megatron's
`tensor_model_parallel`, `partition_dim`) is this rank's slice, row-parallel slices compressed by
columns when whole; a parameter that every tensor-parallel rank holds a copy of counts once in
worker-wide sums (tensor rank 0's). Fragments are contiguous runs of parameters in module order,
balanced by elements (the same on every rank, also under ZeRO).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from muloco.core.errors import ConfigError
from muloco.diloco.plan import SyncedTensor, TensorSpec, balanced_fragments, synced_tensors


def _embedding_parameters(module: torch.nn.Module) -> set[int]:
    found = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    output = getattr(module, "get_output_embeddings", lambda: None)()
    if output is not None and getattr(output, "weight", None) is not None:
        found.add(id(output.weight))
    found.update(id(p) for p in module.parameters() if getattr(p, "is_embedding_or_output_parameter", False))
    return found


def _offload_device(setting) -> str | None:
    device = getattr(setting, "device", None) if setting is not None else None
    return getattr(device, "value", device) if device not in (None, "none") else None


PIPELINE_ENGINE = (
    "DeepSpeed's pipeline engine (a PipelineModule) cannot run as K workers: its grid builds the model-parallel "
    "group from the data-parallel index alone, so with the workers as an axis of its topology that group (every "
    "step's gradient norm) spans the workers, and tied layers (TiedLayerSpec) hang while the module is built; "
    "run the pipeline with Megatron-core's schedules under deepspeed.initialize(..., mpu=workers.mpu) instead "
    "(examples/megatron_muloco.py)")


def refusal(engine) -> str | None:
    """Why the outer loop cannot attach to this engine's optimizer, if it cannot."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):  # its train_batch steps without the engine's `step`
        return PIPELINE_ENGINE
    if engine.fp16_enabled():
        return "fp16 with loss scaling is not supported: a skipped step would part the workers' step counts; use bf16"
    devices = {_offload_device(engine.zero_offload_optimizer()), _offload_device(engine.zero_offload_param())}
    if "nvme" in devices:
        return ("ZeRO offload to NVMe is not supported: the fp32 partitions are swapped out between steps, so no "
                "tensor holds them for the outer loop; offload to the host (\"device\": \"cpu\") or not at all")
    return None


def _tensor_parallel_rank(engine) -> int:
    mpu = getattr(engine, "mpu", None)
    return mpu.get_tensor_model_parallel_rank() if mpu is not None else 0


def _spec(name: str, p: torch.nn.Parameter, fragment: int, embedding: bool, tp_rank: int) -> TensorSpec:
    """A whole parameter as this rank holds it (Megatron's tensor-parallel attributes read)."""
    split = getattr(p, "tensor_model_parallel", False)
    return TensorSpec(name=name, fragment=fragment, embedding_or_head=embedding,
                      tensor_parallel_dim=getattr(p, "partition_dim", None) if split else None,
                      replicated=not split and tp_rank != 0)


def _piece(spec: TensorSpec, shape: tuple[int, ...], offset: int) -> TensorSpec:
    """A flat piece of the parameter `spec` describes (compressed by rows: a piece has no columns)."""
    return TensorSpec(name=spec.name, shape=shape, offset=offset, fragment=spec.fragment,
                      embedding_or_head=spec.embedding_or_head, replicated=spec.replicated)


def _zero3_partition(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
    """This rank's fp32 partition of a ZeRO-3 parameter, without its padding, and its first element."""
    from deepspeed.utils import safe_get_local_fp32_param

    local = safe_get_local_fp32_param(p)
    if local is None:
        return None
    if safe_get_local_fp32_param(p).data_ptr() != local.data_ptr():  # a copy: writing it would change nothing
        raise ConfigError("DeepSpeed's safe_get_local_fp32_param returns a copy of the fp32 partition here (offload "
                          "from an accelerator to the host), so the outer loop cannot write it; use ZeRO-3 without "
                          "offload_optimizer, or ZeRO-1/2 with it")
    start = dist.get_rank(group=p.ds_process_group) * local.numel()  # even partitions, the last one padded
    size = max(0, min(local.numel(), p.ds_numel - start))
    return (local.view(-1)[:size], start) if size else None


def engine_tensors(engine, fragments: int) -> tuple[list[SyncedTensor], bool]:
    """What this rank syncs, and whether it is replicated over the worker's ranks (stage 0 in fp32)
    or this rank's own shard (a partition)."""
    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    embedding = _embedding_parameters(engine.module)
    zero3 = engine.zero_optimization_stage() >= 3
    shapes = [tuple(p.ds_shape) if zero3 else tuple(p.shape) for _, p in named]
    fragment = balanced_fragments([torch.Size(shape).numel() for shape in shapes], fragments)
    partitioned = zero3 or hasattr(engine.optimizer, "update_lp_params")  # ZeRO 1/2/3, or the bf16 optimizer
    tp_rank = _tensor_parallel_rank(engine)
    tensors, specs = [], []
    for (name, p), shape, f in zip(named, shapes, fragment):
        spec = _spec(name, p, f, id(p) in embedding, tp_rank)
        if not partitioned:
            tensors.append(p)
            specs.append(spec)
            continue
        if zero3:
            partition = _zero3_partition(p)
        else:
            mapping = getattr(p, "_hp_mapping", None)
            partition = None if mapping is None else (mapping.get_hp_fragment(), mapping.lp_fragment_address.start)
        if partition is None:  # none of it lies in this rank's partition
            continue
        tensors.append(partition[0])
        specs.append(_piece(spec, shape, partition[1]))
    return synced_tensors(tensors, specs, fragments), not partitioned


def refresh_model_weights(engine) -> None:
    """After the outer loop wrote the fp32 partitions: the model's weights from them, as DeepSpeed's
    own optimizer step leaves them."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        # The epilogue of DeepSpeed's ZeRO-3 step: every parameter released, each sub-group's fp32
        # partition copied into the model's (bf16 or fp32) partition, the parameters kept whole between
        # steps (`stage3_param_persistence_threshold`) gathered again, ZeRO++'s secondary copies dropped.
        optimizer._partition_all_parameters()
        for sub_group in range(len(optimizer.fp16_groups)):
            optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
        persistent = optimizer.persistent_parameters
        if persistent:
            persistent[0].all_gather(persistent)
        optimizer.invalidate_secondary_tensor()
    elif hasattr(optimizer, "update_lp_params"):
        optimizer.update_lp_params()

