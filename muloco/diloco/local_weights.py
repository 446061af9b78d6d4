"""The local weights as the outer loop writes them: after a sync, a fragment's local weights become
its global weights (mixed with the local ones, weight alpha, when the sync overlapped inner steps); with
tensors replicated over the worker's D inner-DP replicas, the replica that owns a tensor shares the
result with the others."""
from __future__ import annotations

import torch

from muloco.core import comm
from muloco.core.topology import Topology
from muloco.diloco.outer_state import OuterState
from muloco.diloco.plan import BucketSpec, SyncedTensor


class LocalWeights:
    def __init__(self, tensors: list[SyncedTensor], state: OuterState, buckets: list[list[BucketSpec]],
                 topology: Topology, replicated: bool):
        self.tensors, self.state, self.buckets, self.topology, self.replicated = tensors, state, buckets, topology, replicated
        self.hold_global: set[int] = set()  # fragments whose local weights are the global ones since the last step

    def restart_from_global(self, fragments: list[int], alpha: float = 0.0) -> None:
        """The fragments' local weights := their global weights (mixed with weight alpha of the local ones)."""
        if alpha == 0.0:
            self.hold_global.update(fragments)
        for fragment in fragments:
            for spec in self.buckets[fragment]:
                for i in spec.indices:
                    t = self.tensors[i].tensor
                    new = self.state.global_weights[i].to(t.device, t.dtype, non_blocking=True)
                    t.copy_(new if alpha == 0.0 else t.mul(alpha).add_(new, alpha=1 - alpha))
            self._share_inside_worker(fragment)

    def _share_inside_worker(self, fragment: int) -> None:
        """The owning replica's new weights to the other D-1 replicas (non-owners add zeros: exact)."""
        if not self.replicated or self.topology.sizes.data == 1:
            return
        members = [i for i, t in enumerate(self.tensors) if t.fragment == fragment]
        if not members:
            return
        owned = self.state.global_weights
        flat = torch.cat([self.tensors[i].tensor.detach().reshape(-1) if i in owned
                          else torch.zeros_like(self.tensors[i].tensor).reshape(-1) for i in members])
        comm.all_reduce(flat, group=self.topology.inner_dp_group)
        offset = 0
        for i in members:
            t = self.tensors[i].tensor
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
