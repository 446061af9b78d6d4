"""Muon over Megatron tensor-parallel shards, exactly Muon on the logical matrices at every T.

Each step:
1. momentum on the local shard (elementwise, so sharding does not change it);
2. all-gather the momentum directions over the TP group into full-layout tensors;
3. split them into logical matrices (Q, K, V; gate, up; the rest whole) with the shared layout
   mapping, and orthogonalize only the matrices this rank owns: ownership is balanced by
   Newton-Schulz FLOPs over the T x D ranks that hold identical gradients (the TP group of each of
   the D inner-DP replicas), so each rank does about 1/(T*D) of the work;
4. owners write their results into a zero buffer laid out as [shard for TP rank 0 | ... | T-1];
   a sum over the inner-DP group and a reduce-scatter over the TP group deliver to every rank its
   slice. Every element has exactly one non-zero contributor, so the sums are exact;
5. decoupled weight decay and the scaled update on the local shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.model.layout import (ParamLayout, from_logical_matrices, full_shape, layout_of,
                                  logical_matrices, logical_shapes, shard, unshard)
from trainer.model.presets import ModelShape
from trainer.optim.muon import MuonConfig, apply_update, lr_scale, orthogonalize_direction, update_momentum
from trainer.optim.newton_schulz import newton_schulz_flops
from trainer.optim.ownership import OwnershipPlan


@dataclass(frozen=True)
class LogicalMatrix:
    param_index: int
    part: str  # "q", "k", "v", "gate", "up", or "" for a whole matrix
    shape: tuple[int, int]


@dataclass(frozen=True)
class ShardGroup:
    """A process group and this rank's place in it (size 1 and group None when alone)."""

    group: object
    rank: int
    size: int

    @classmethod
    def of(cls, group) -> "ShardGroup":
        if group is None or dist.get_world_size(group) == 1:
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))


class DistributedMuon:
    def __init__(self, names: list[str], params: list[torch.nn.Parameter], model_shape: ModelShape,
                 tp: ShardGroup, dp: ShardGroup):
        self.names, self.params, self.model_shape, self.tp, self.dp = names, params, model_shape, tp, dp
        self.layouts: list[ParamLayout] = [layout_of(n) for n in names]
        self.full_shapes = [full_shape(tuple(p.shape), lay, tp.size) for p, lay in zip(params, self.layouts)]
        self.matrices = [LogicalMatrix(i, part, shp)
                         for i, (n, fs) in enumerate(zip(names, self.full_shapes))
                         for part, shp in logical_shapes(n, fs, model_shape).items()]
        self.plan: OwnershipPlan | None = None
        self._ns_steps: int | None = None

    def _ownership(self, ns_steps: int) -> OwnershipPlan:
        if self.plan is None or self._ns_steps != ns_steps:
            costs = [newton_schulz_flops(m.shape, ns_steps) for m in self.matrices]
            self.plan = OwnershipPlan.build(costs, self.tp.size * self.dp.size)
            self._ns_steps = ns_steps
        return self.plan

    @property
    def owner_id(self) -> int:
        return self.dp.rank * self.tp.size + self.tp.rank

    def _gather_full(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.tp.size == 1:
            return directions
        flat = torch.cat([d.reshape(-1) for d in directions])
        gathered = torch.empty(self.tp.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat, group=self.tp.group)
        per_rank = gathered.view(self.tp.size, -1)
        fulls, offset = [], 0
        for d, layout in zip(directions, self.layouts):
            n = d.numel()
            fulls.append(unshard([per_rank[r, offset:offset + n].view_as(d) for r in range(self.tp.size)], layout))
            offset += n
        return fulls

    def _orthogonalized_updates(self, fulls: list[torch.Tensor], config: MuonConfig) -> list[torch.Tensor | None]:
        """Full-layout, lr-scaled updates for the parameters holding a matrix this rank owns."""
        plan = self._ownership(config.ns_steps)
        mine: dict[int, dict[str, torch.Tensor]] = {}
        for item in plan.items_of(self.owner_id):
            m = self.matrices[item]
            direction = logical_matrices(self.names[m.param_index], fulls[m.param_index], self.model_shape)[m.part]
            ortho = orthogonalize_direction(direction, config) * lr_scale(m.shape, config.lr_scaling)
            mine.setdefault(m.param_index, {})[m.part] = ortho
        updates: list[torch.Tensor | None] = [None] * len(fulls)
        for i, parts in mine.items():
            logical = logical_matrices(self.names[i], fulls[i], self.model_shape)
            for part, tensor in logical.items():
                parts.setdefault(part, torch.zeros_like(tensor))
            updates[i] = from_logical_matrices(self.names[i], parts, self.model_shape)
        return updates

    def _scatter_local(self, updates: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Every rank's local slice of the updates, from the owners' full-layout results."""
        if self.tp.size == 1 and self.dp.size == 1:
            return updates  # this rank owns everything
        local_sizes = [p.numel() for p in self.params]
        buffer = torch.zeros(self.tp.size, sum(local_sizes), dtype=self.params[0].dtype)
        offset = 0
        for p, layout, update, n in zip(self.params, self.layouts, updates, local_sizes):
            if update is not None:
                for r in range(self.tp.size):
                    buffer[r, offset:offset + n] = shard(update, layout, r, self.tp.size).reshape(-1)
            offset += n
        if self.dp.size > 1:
            dist.all_reduce(buffer, group=self.dp.group)
        if self.tp.size > 1:
            local = torch.empty(buffer.shape[1], dtype=buffer.dtype)
            dist.reduce_scatter_tensor(local, buffer.reshape(-1), group=self.tp.group)
        else:
            local = buffer[0]
        out, offset = [], 0
        for p, n in zip(self.params, local_sizes):
            out.append(local[offset:offset + n].view_as(p))
            offset += n
        return out

    @torch.no_grad()
    def step(self, momentum_buffers: list[torch.Tensor], config: MuonConfig) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        directions = [update_momentum(buf, g, config.momentum, config.nesterov)
                      for buf, g in zip(momentum_buffers, grads)]
        updates = self._scatter_local(self._orthogonalized_updates(self._gather_full(directions), config))
        for p, u in zip(self.params, updates):
            apply_update(p, u, config.lr, config.weight_decay, scale=1.0)  # lr scale applied per logical matrix
