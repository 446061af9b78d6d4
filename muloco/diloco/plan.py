"""What the outer loop syncs, and when: the tensors it syncs (each with its wire shape, compression
group and fragment), which inner-DP replica owns each, the buckets a fragment's tensors travel in, and
the streaming schedule.

A host hands the outer loop tensors (the storage its inner optimizer updates) with optional
`TensorSpec` descriptions. Without one, a tensor is described by its shape alone: 1-D tensors are
"vector", others "matrix" (compressed by rows of its trailing dimensions), and fragments are
contiguous runs of tensors balanced by bytes in the order given (module order). This project's
trainer describes Megatron's parameters (tensor-parallel dimension, embedding and head, layer
fragments: trainer/outer_host.py); the DeepSpeed hook describes ZeRO's fp32 master partitions as flat
pieces of the model's parameters (muloco/hook/).

A flat piece (`TensorSpec.shape` with `offset`) of a parameter whose rows are `cols` wide is synced
as up to three blocks: the partial row it starts in, its whole rows, and the partial row it ends in,
so row-wise compression sees the parameter's own rows (cut only where the partition cuts them).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch

from muloco.diloco.packing import BucketPacking
from muloco.diloco.compression import Compressor, ErrorFeedback, compression_group, rows_shape
from muloco.diloco.config import MuLoCoConfig
from muloco.core.errors import ConfigError
from muloco.core.ownership import assign_owners


@dataclass(frozen=True)
class TensorSpec:
    """How one synced tensor is laid out (every field optional)."""
    name: str | None = None  # its key in the outer state (default: "tensor<i>", by position)
    shape: tuple[int, ...] | None = None  # the whole parameter's shape, when the tensor is a flat piece of it
    offset: int = 0  # that piece's first element in the whole parameter (row-major)
    tensor_parallel_dim: int | None = None  # 1: row-parallel, compressed by columns (so results do not depend on T)
    embedding_or_head: bool = False  # the "embedding" compression group
    fragment: int | None = None  # its streaming fragment (default: balanced by bytes in the order given)
    replicated: bool = False  # a copy that another rank of the worker holds too (a TP-replicated norm on TP rank > 0)


@dataclass
class SyncedTensor:
    name: str
    tensor: torch.Tensor  # the local weights the inner optimizer updates (a parameter, or a view of a master partition)
    wire_shape: tuple[int, int]  # (rows, columns) as compressed
    transposed: bool  # the wire carries its transpose (row-parallel weights, by columns)
    group: str  # compression group: "matrix", "embedding" or "vector"
    fragment: int
    counts_once: bool  # whether this rank's copy counts in worker-wide sums

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return (t.t() if self.transposed else t).reshape(self.wire_shape)

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        return (t.t() if self.transposed else t).reshape(self.tensor.shape)


def balanced_fragments(sizes: list[int], fragments: int) -> list[int]:
    """Fragment of each tensor: contiguous runs in the order given, each about 1/F of the bytes (a
    tensor goes where the middle of its bytes falls)."""
    total = sum(sizes)
    if total == 0:
        return [0] * len(sizes)
    result, before = [], 0
    for size in sizes:
        result.append(min(fragments - 1, int(fragments * (before + size / 2) / total)))
        before += size
    return result


def _blocks(n: int, offset: int, cols: int) -> list[tuple[int, int, int]]:
    """(start in the piece, rows, width) of the blocks a flat piece of n elements starting at element
    `offset` of a parameter with rows `cols` wide is synced as."""
    blocks, start = [], 0
    head = min(n, (-offset) % cols)
    if head:
        blocks.append((0, 1, head))
        start = head
    whole = (n - start) // cols
    if whole:
        blocks.append((start, whole, cols))
        start += whole * cols
    if start < n:
        blocks.append((start, 1, n - start))
    return blocks


def synced_tensors(tensors: list[torch.Tensor], specs: list[TensorSpec | None] | None, fragments: int
                   ) -> list[SyncedTensor]:
    """The outer loop's view of what a host syncs; one clear ConfigError for a description that
    cannot hold."""
    specs = list(specs) if specs is not None else [None] * len(tensors)
    if len(specs) != len(tensors):
        raise ConfigError(f"{len(specs)} tensor descriptions for {len(tensors)} tensors")
    specs = [s or TensorSpec() for s in specs]
    shapes = [s.shape or tuple(t.shape) for t, s in zip(tensors, specs)]
    defaults = balanced_fragments([t.numel() * t.element_size() for t in tensors], fragments)
    synced = []
    for i, (t, spec, shape, default) in enumerate(zip(tensors, specs, shapes, defaults)):
        name = spec.name or f"tensor{i}"
        fragment = default if spec.fragment is None else spec.fragment
        if not 0 <= fragment < fragments:
            raise ConfigError(f"{name}: fragment {fragment} is not one of the {fragments} streaming fragments")
        if spec.tensor_parallel_dim not in (None, 0, 1):
            raise ConfigError(f"{name}: tensor_parallel_dim {spec.tensor_parallel_dim} is not 0, 1 or None")
        group = compression_group(shape, spec.embedding_or_head)
        counts_once = not spec.replicated
        if spec.shape is None:
            transposed = spec.tensor_parallel_dim == 1 and t.dim() == 2
            wire = rows_shape(tuple(reversed(t.shape)) if transposed else t.shape)
            synced.append(SyncedTensor(name, t, wire, transposed, group, fragment, counts_once))
            continue
        whole = math.prod(shape)
        if t.dim() != 1 or not t.is_contiguous() or not 0 <= spec.offset <= whole - t.numel():
            raise ConfigError(f"{name}: a piece of a {tuple(shape)} parameter must be a contiguous 1-D tensor within "
                              f"it (got {tuple(t.shape)} at element {spec.offset})")
        if spec.tensor_parallel_dim == 1:
            raise ConfigError(f"{name}: a flat piece cannot be compressed by columns (tensor_parallel_dim 1)")
        cols = rows_shape(shape)[1]
        for start, rows, width in _blocks(t.numel(), spec.offset, cols):
            view = t[start:start + rows * width].view(rows, width)
            synced.append(SyncedTensor(f"{name}@{spec.offset + start}", view, (rows, width), False, group, fragment,
                                       counts_once))
    return synced


def sync_offsets(sync_interval: int, fragments: int) -> list[int]:
    """Fragment i syncs when step % H == floor(H/F*(i+1)) mod H (the streaming DiLoCo schedule)."""
    return [math.floor(sync_interval / fragments * (i + 1)) % sync_interval for i in range(fragments)]


AUTO_FIRST_OVERLAP = 1  # `overlap_steps: "auto"`: a fragment's first sync, before any timing is known
AUTO_MARGIN = 1.25  # ... later ones cover the slowest worker's last sync of the fragment with this margin


def auto_overlap_steps(needed: float | None, max_overlap_steps: int) -> int:
    """`overlap_steps: "auto"`: tau for a fragment's next sync, from the inner steps its last sync took on
    the slowest worker (`needed`, reduced alike by every worker; None: its first sync, or its metrics were
    lost when an elastic member left)."""
    if needed is None:
        return AUTO_FIRST_OVERLAP
    return max(1, min(max_overlap_steps, math.ceil(AUTO_MARGIN * needed)))


def owned_by(tensors: list[SyncedTensor], replicas: int, replica: int, replicated: bool) -> list[int]:
    """The tensors this rank keeps the outer state of and syncs: with tensors replicated over the
    worker's D inner-DP replicas, 1/D of them (balanced by size); with sharded tensors (ZeRO's
    partitions), all of its own."""
    if not replicated or replicas == 1:
        return list(range(len(tensors)))
    owner = assign_owners([t.tensor.numel() for t in tensors], replicas)
    return [i for i, o in enumerate(owner) if o == replica]


@dataclass
class BucketSpec:
    """Owned tensors of one fragment that travel together: the same compression group (so the same
    codec) and whether they count in worker-wide sums. Ordered by row width (see compression.py)."""
    indices: list[int]
    compressor: Compressor
    packing: BucketPacking
    counts_once: bool
    error_feedback: ErrorFeedback | None

    @property
    def compressed(self) -> bool:
        return self.compressor.config.method != "none"

    @property
    def numel(self) -> int:
        return sum(rows * cols for rows, cols in self.packing.shapes)


def plan_buckets(tensors: list[SyncedTensor], owned: list[int], fragment: int, config: MuLoCoConfig
                 ) -> list[BucketSpec]:
    parts = config.workers if config.collective == "reduce_scatter" else 1
    keyed: dict[tuple[str, bool], list[int]] = {}
    for i in owned:
        if tensors[i].fragment == fragment:
            keyed.setdefault((tensors[i].group, tensors[i].counts_once), []).append(i)
    specs = []
    for (group, counts_once), indices in sorted(keyed.items()):
        indices.sort(key=lambda i: tensors[i].wire_shape[1])
        codec = config.compression.for_group(group)
        specs.append(BucketSpec(indices, Compressor(codec), BucketPacking(tuple(tensors[i].wire_shape for i in indices),
                                                                         parts), counts_once,
                                ErrorFeedback.from_config(codec, config.outer_lr) if codec.error_feedback else None))
    return specs


def plan_signature(tensors: list[SyncedTensor]) -> bytes:
    """32 bytes that two ranks holding the same shard of the same model share: names, wire shapes,
    compression groups and fragments, in order."""
    rows = [[t.name, list(t.wire_shape), t.group, t.fragment, t.transposed] for t in tensors]
    return hashlib.sha256(json.dumps(rows).encode()).digest()


