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


DEFAULT_BUCKET_NUMEL = 1 << 28  # full-layout elements gathered at once (tools/plan.py prices this workspace)


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
    """`bucket_numel` bounds the full-layout elements gathered at once (memory at 15B scale); the
    ownership plan is global, so each bucket's work is spread over all owners too."""

    def __init__(self, names: list[str], params: list[torch.nn.Parameter], model_shape: ModelShape,
                 tp: ShardGroup, dp: ShardGroup, bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        self.names, self.params, self.model_shape, self.tp, self.dp = names, params, model_shape, tp, dp
        self.layouts: list[ParamLayout] = [layout_of(n) for n in names]
        self.full_shapes = [full_shape(tuple(p.shape), lay, tp.size) for p, lay in zip(params, self.layouts)]
        self.matrices = [LogicalMatrix(i, part, shp)
                         for i, (n, fs) in enumerate(zip(names, self.full_shapes))
                         for part, shp in logical_shapes(n, fs, model_shape).items()]
        self.buckets = self._buckets(bucket_numel)
        self.plan: OwnershipPlan | None = None
        self._ns_steps: int | None = None

    def _buckets(self, bucket_numel: int) -> list[list[int]]:
        buckets, current, size = [], [], 0
        for i, p in enumerate(self.params):
            n = p.numel() * self.tp.size
            if current and size + n > bucket_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        return buckets + ([current] if current else [])

    def _ownership(self, ns_steps: int) -> OwnershipPlan:
        if self.plan is None or self._ns_steps != ns_steps:
            costs = [newton_schulz_flops(m.shape, ns_steps) for m in self.matrices]
            self.plan = OwnershipPlan.build(costs, self.tp.size * self.dp.size)
            self._ns_steps = ns_steps
        return self.plan

    @property
    def owner_id(self) -> int:
        return self.dp.rank * self.tp.size + self.tp.rank

    def _gather_full(self, bucket: list[int], directions: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        if self.tp.size == 1:
            return {i: directions[i] for i in bucket}
        flat = torch.cat([directions[i].reshape(-1) for i in bucket])
        gathered = torch.empty(self.tp.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat, group=self.tp.group)
        per_rank = gathered.view(self.tp.size, -1)
        fulls, offset = {}, 0
        for i in bucket:
            d, n = directions[i], directions[i].numel()
            fulls[i] = unshard([per_rank[r, offset:offset + n].view_as(d) for r in range(self.tp.size)],
                               self.layouts[i])
            offset += n
        return fulls

    def _orthogonalized_updates(self, fulls: dict[int, torch.Tensor], config: MuonConfig) -> dict[int, torch.Tensor]:
        """Full-layout, lr-scaled updates of the bucket's parameters holding a matrix this rank owns."""
        mine: dict[int, dict[str, torch.Tensor]] = {}
        for item in self._ownership(config.ns_steps).items_of(self.owner_id):
            m = self.matrices[item]
            if m.param_index not in fulls:
                continue
            direction = logical_matrices(self.names[m.param_index], fulls[m.param_index], self.model_shape)[m.part]
            ortho = orthogonalize_direction(direction, config) * lr_scale(m.shape, config.lr_scaling)
            mine.setdefault(m.param_index, {})[m.part] = ortho
        updates = {}
        for i, parts in mine.items():
            for part, tensor in logical_matrices(self.names[i], fulls[i], self.model_shape).items():
                parts.setdefault(part, torch.zeros_like(tensor))
            updates[i] = from_logical_matrices(self.names[i], parts, self.model_shape)
        return updates

    def _scatter_local(self, bucket: list[int], updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every rank's local slice of the bucket's updates, from the owners' full-layout results."""
        if self.tp.size == 1 and self.dp.size == 1:
            return updates  # this rank owns everything
        sizes = [self.params[i].numel() for i in bucket]
        buffer = torch.zeros(self.tp.size, sum(sizes), dtype=self.params[bucket[0]].dtype)
        offset = 0
        for i, n in zip(bucket, sizes):
            if i in updates:
                for r in range(self.tp.size):
                    buffer[r, offset:offset + n] = shard(updates[i], self.layouts[i], r, self.tp.size).reshape(-1)
            offset += n
        if self.dp.size > 1:
            dist.all_reduce(buffer, group=self.dp.group)
        if self.tp.size > 1:
            local = torch.empty(buffer.shape[1], dtype=buffer.dtype)
            dist.reduce_scatter_tensor(local, buffer.reshape(-1), group=self.tp.group)
        else:
            local = buffer[0]
        out, offset = {}, 0
        for i, n in zip(bucket, sizes):
            out[i] = local[offset:offset + n].view_as(self.params[i])
            offset += n
        return out

    @torch.no_grad()
    def step(self, momentum_buffers: list[torch.Tensor], config: MuonConfig) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        directions = [update_momentum(buf, g, config.momentum, config.nesterov)
                      for buf, g in zip(momentum_buffers, grads)]
        for bucket in self.buckets:
            updates = self._scatter_local(bucket, self._orthogonalized_updates(self._gather_full(bucket, directions), config))
            for i in bucket:
                # The lr scale was applied per logical matrix (Q, K, V differ in shape).
                apply_update(self.params[i], updates[i], config.lr, config.weight_decay, scale=1.0)
