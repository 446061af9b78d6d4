"""What one rank sends through the outer loop: the whole parameters it owns (this trainer's ranks), or in a DeepSpeed
hook run the pieces of its ZeRO partition; and each tensor's compression setting."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from muloco.core.ownership import assign_owners
from muloco.diloco.config import CompressionConfig
from muloco.diloco.plan import TensorSpec, synced_tensors
from tools.planning.shards import ShardParam


@dataclass(frozen=True)
class WirePiece:
    """A flat piece of a parameter that a DeepSpeed hook rank syncs (a row block of its ZeRO partition)."""
    name: str
    wire_shape: tuple[int, int]
    group: str

    @property
    def numel(self) -> int:
        return self.wire_shape[0] * self.wire_shape[1]


def owned_by_replica(stage: list[ShardParam], data: int, replica: int) -> list[ShardParam]:
    """The parameters inner-DP replica `replica` syncs (muloco.diloco.plan.owned_by's assignment)."""
    owners = assign_owners([p.numel for p in stage], data)
    return [p for p, owner in zip(stage, owners) if owner == replica]


def hook_synced(stage: list[ShardParam], zero: int, data: int, replica: int) -> list[ShardParam | WirePiece]:
    """What inner-DP replica `replica` syncs in a hook run (muloco/hook/engine_shards.py): at ZeRO 0 the
    whole parameters it owns (as this trainer's ranks), at ZeRO 3 its partition of every parameter
    (each cut into D equal parts, the last one padded), at ZeRO 1/2 its slice of the flat partition
    (the parameters end to end, cut into D equal parts; DeepSpeed's few elements of alignment padding
    left out); a piece of a parameter synced as plan.synced_tensors cuts it into row blocks."""
    if zero == 0:
        return owned_by_replica(stage, data, replica)
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


@functools.cache  # a 15B plan asks once per tensor per rank: hundreds of thousands of times
def config_of_group(compression: CompressionConfig, group: str) -> CompressionConfig:
    return compression.for_group(group)
