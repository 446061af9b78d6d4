"""Which optimizer each parameter gets, decided on the built (sharded) Megatron model from
Megatron's own parameter attributes: Muon for hidden 2-D matrices, AdamW for embeddings, the
output head and every 1-D parameter. A parameter no rule covers is an error, never a silent AdamW."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Routing:
    muon: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)

    def report(self) -> str:
        def block(title, items):
            numel = sum(p.numel() for _, p in items)
            names = "\n".join(f"    {n} {tuple(p.shape)}" for n, p in items)
            return f"  {title}: {len(items)} tensors, {numel:,} local elements\n{names}"
        return "optimizer routing (this rank's shard):\n" + block("muon", self.muon) + "\n" + block("adamw", self.adamw)


def route_parameters(named_parameters, use_muon: bool) -> Routing:
    routing = Routing()
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        if not use_muon:
            routing.adamw.append((name, param))
        elif getattr(param, "is_embedding_or_output_parameter", False) or param.dim() == 1:
            routing.adamw.append((name, param))
        elif param.dim() == 2 and getattr(param, "tensor_model_parallel", False):
            routing.muon.append((name, param))
        else:
            raise ValueError(f"no optimizer rule covers parameter {name} {tuple(param.shape)} "
                             "(not an embedding/output matrix, not 1-D, not a tensor-parallel hidden matrix)")
    return routing
