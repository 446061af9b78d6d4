"""Gradients as one model-parallel whole: TP-replicated gradients that Megatron's layers leave
partial, and the global gradient norm over the TP x PP shards."""
from __future__ import annotations

import torch
import torch.distributed as dist

from muloco.core import comm


def is_partial_across_tensor_parallel(name: str) -> bool:
    """Per-head QK-norm gains are shared by all heads, but each TP rank only sees its own heads'
    contribution: the gradient is a sum over TP ranks (Megatron's finalize_model_grads does the same)."""
    return "q_layernorm" in name or "k_layernorm" in name


@torch.no_grad()
def sum_partial_grads(named_params, tp_group) -> None:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [p.grad for n, p in named_params if is_partial_across_tensor_parallel(n) and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def global_grad_norm(params, tp_rank: int, model_parallel_group) -> torch.Tensor:
    """L2 norm of the full model's gradient; TP-replicated parameters count once (on TP rank 0).
    Summed in fp32 on the gradients' device, then reduced on the group's."""
    grads = [p.grad for p in params
             if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
    device = grads[0].device if grads else comm.compute_device()
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        comm.all_reduce(sq, group=model_parallel_group)
    return sq.sqrt()
