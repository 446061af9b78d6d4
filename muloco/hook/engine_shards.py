"""What a DeepSpeed engine's inner optimizer updates on this rank: the tensors the outer loop keeps
state for and syncs.

- ZeRO stage 1 or 2 (and DeepSpeed's bf16 optimizer): this rank's fp32 master partition, as flat
  pieces of the model's parameters (DeepSpeed's own lp -> hp fragment mapping, `param._hp_mapping`,
  the one its universal checkpoints use). The partition is the shard: its global weights, momentum
  and error feedback live on this rank alone, it is synced with the same partition of the other
  workers, and nothing is gathered inside the worker. After the outer loop writes a partition,
  `update_lp_params()` refreshes the model's weights from it (bf16 or fp32) before the next forward.
- stage 0 in fp32: the module's parameters, replicated over the worker's D ranks; each rank owns 1/D
  of them for the sync and shares its result inside the worker.
- ZeRO stage 3 and optimizer or parameter offload are refused, with the reason.

Parameters are described by shape (plan.py): embedding and output-embedding modules
(`torch.nn.Embedding`, a Hugging Face model's `get_output_embeddings()`) form the "embedding"
compression group, 1-D tensors "vector", the rest "matrix"; fragments are contiguous runs of
parameters in module order, balanced by bytes (the same on every rank, also under ZeRO).
"""
from __future__ import annotations

import torch

from muloco.diloco.plan import SyncedTensor, TensorSpec, balanced_fragments, synced_tensors


def _embedding_parameters(module: torch.nn.Module) -> set[int]:
    found = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    output = getattr(module, "get_output_embeddings", lambda: None)()
    if output is not None and getattr(output, "weight", None) is not None:
        found.add(id(output.weight))
    return found


def refusal(engine) -> str | None:
    """Why the outer loop cannot attach to this engine's optimizer, if it cannot."""
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        return ("ZeRO stage 3 is not supported: its parameters are gathered layer by layer inside the step, so no rank "
                "holds a stable fp32 partition to keep outer state for between steps; use stage 1 or 2 (the outer state "
                "is then sharded like the optimizer state)")
    if engine.zero_offload_optimizer() is not None or engine.zero_offload_param() is not None:
        return ("ZeRO offload is not supported: the fp32 master partitions move between devices during the step; "
                "use ZeRO stage 1 or 2 without offload_optimizer/offload_param")
    if engine.fp16_enabled():
        return "fp16 with loss scaling is not supported: a skipped step would part the workers' step counts; use bf16"
    return None


def engine_tensors(engine, fragments: int) -> tuple[list[SyncedTensor], bool]:
    """What this rank syncs, and whether it is replicated over the worker's ranks (stage 0 in fp32)
    or this rank's own shard (a master partition)."""
    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    embedding = _embedding_parameters(engine.module)
    fragment = balanced_fragments([p.numel() for _, p in named], fragments)
    partitioned = hasattr(engine.optimizer, "update_lp_params")  # ZeRO 1/2, or the bf16 optimizer
    tensors, specs = [], []
    for (name, p), f in zip(named, fragment):
        spec = TensorSpec(name=name, fragment=f, embedding_or_head=id(p) in embedding)
        if not partitioned:
            tensors.append(p)
            specs.append(spec)
            continue
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # none of it lies in this rank's partition
            continue
        address = mapping.lp_fragment_address
        tensors.append(mapping.get_hp_fragment())
        specs.append(TensorSpec(name=name, shape=tuple(p.shape), offset=address.start, fragment=f,
                                embedding_or_head=spec.embedding_or_head))
    return synced_tensors(tensors, specs, fragments), not partitioned
