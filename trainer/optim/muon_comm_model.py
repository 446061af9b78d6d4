"""Distributed Muon's exchange as pure functions of shapes and the parallel layout: the logical matrices, who owns
each one, how parameters are bucketed, the bytes each rank sends per optimizer step and the step's
transient memory. `DistributedMuon` executes exactly this plan; benchmarks/muon_comm.py and
tools/plan.py evaluate it for models they never build.

Ranks: the T x D ranks of one pipeline stage of one worker hold identical gradients (TP shards of D
replicas); owner id `d*T + t` is the rank with TP rank t in inner-DP replica d. Per bucket:
1. gather (all-to-all over TP, inside each replica): every rank sends its piece of each matrix
   to the matrix's owner in its own replica (a piece is 1/T of the matrix, cut along the TP split);
2. the owner orthogonalizes the whole matrix;
3. scatter (all-to-all over TP): the owner sends piece r of the result to TP rank r of its replica;
   TP rank t of replica d then holds its pieces of every matrix owned in replica d, its "slot";
4. all-to-all over inner DP (the ranks with the same TP rank): each rank sends its slot to the
   others (slots differ in size, so no padded all-gather), and ends with its pieces of every matrix
   of the bucket.
Elements travel in the communication dtype (`comm_dtype`): bf16 when Newton-Schulz runs in bf16
(it would round its input to bf16 first anyway, and its output is bf16), else fp32.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from trainer.model.sharding import Split, full_shape, sharding_of, logical_shapes
from trainer.model.presets import ModelShape
from trainer.optim.newton_schulz import NS_DTYPES, NSForm, newton_schulz_flops, newton_schulz_workspace_numel
from muloco.core.ownership import assign_owners


# Full (T=1) elements exchanged per bucket: one 15B layer (T=4: ~130 MB of bf16 pieces per rank).
DEFAULT_BUCKET_NUMEL = 1 << 28


def comm_dtype(ns_dtype: str) -> torch.dtype:
    """Momentum pieces and updates travel in the Newton-Schulz dtype (bf16 or fp32)."""
    return NS_DTYPES[ns_dtype]


def local_model_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The shape whose fused-QKV form one TP shard has (1/T of the heads and query groups), so
    `trainer.model.sharding.logical_matrices` splits a shard into its pieces of Q, K, V."""
    return replace(shape, num_attention_heads=shape.num_attention_heads // tp,
                   num_query_groups=None if shape.num_query_groups is None else shape.num_query_groups // tp)


@dataclass(frozen=True)
class LogicalMatrix:
    param_index: int
    part: str  # "q", "k", "v", "gate", "up", or "" for a whole matrix
    shape: tuple[int, int]  # full (rows, cols)
    split_dim: int  # TP ranks' pieces concatenate along this dim into the matrix

    def piece_shape(self, tp: int) -> tuple[int, int]:
        rows, cols = self.shape
        return (rows // tp, cols) if self.split_dim == 0 else (rows, cols // tp)

    def piece_numel(self, tp: int) -> int:
        return self.shape[0] * self.shape[1] // tp


def logical_matrices_of(names: Sequence[str], full_shapes: Sequence[tuple[int, ...]],
                        model_shape: ModelShape) -> list[LogicalMatrix]:
    """Every logical matrix of the parameters (Q, K, V of a fused QKV; gate, up of fc1; else whole)."""
    matrices = []
    for i, (name, shape) in enumerate(zip(names, full_shapes)):
        sharding = sharding_of(name)
        if sharding.split is Split.REPLICATED:
            raise ValueError(f"distributed Muon expects tensor-parallel matrices; {name} is replicated")
        matrices += [LogicalMatrix(i, part, s, sharding.partition_dim)
                     for part, s in logical_shapes(name, tuple(shape), model_shape).items()]
    return matrices


def param_buckets(full_numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Consecutive parameters grouped so that each group's full (T=1) elements stay within
    `bucket_numel` (a larger single parameter is a bucket of its own)."""
    buckets, current, size = [], [], 0
    for i, n in enumerate(full_numels):
        if current and size + n > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return buckets + ([current] if current else [])


@dataclass(frozen=True)
class BytesSent:
    tp_gather: int
    tp_scatter: int
    dp_all_gather: int

    @property
    def total(self) -> int:
        return self.tp_gather + self.tp_scatter + self.dp_all_gather


@dataclass(frozen=True)
class MuonExchange:
    """The plan of one Muon step's exchange on one pipeline stage: matrices, owners, buckets."""

    matrices: tuple[LogicalMatrix, ...]
    owners: tuple[int, ...]  # owner id (d*T + t) of each matrix
    buckets: tuple[tuple[int, ...], ...]  # parameter indices per bucket
    tp: int
    dp: int
    ns_steps: int
    ns_form: NSForm  # the owners' Newton-Schulz, whose FLOPs balance them and whose workspace counts

    @classmethod
    def build(cls, names: Sequence[str], full_shapes: Sequence[tuple[int, ...]], model_shape: ModelShape,
              tp: int, dp: int, ns_steps: int, bucket_numel: int, ns_form: NSForm = "standard") -> MuonExchange:
        """Ownership is balanced by Newton-Schulz FLOPs within each bucket: buckets are processed one
        after the other, so a bucket's slowest owner is what the step waits for."""
        matrices = logical_matrices_of(names, full_shapes, model_shape)
        buckets = param_buckets([math.prod(s) for s in full_shapes], bucket_numel)
        owners, totals = [0] * len(matrices), [0.0] * (tp * dp)
        for bucket in buckets:
            members = [m for m, lm in enumerate(matrices) if lm.param_index in bucket]
            costs = [newton_schulz_flops(matrices[m].shape, ns_steps, ns_form) for m in members]
            # Ties (a bucket with fewer big matrices than owners) go to the owners with the least
            # work so far, which also spreads each rank's bytes over the step.
            for m, cost, owner in zip(members, costs, assign_owners(costs, tp * dp, totals)):
                owners[m] = owner
                totals[owner] += cost
        return cls(tuple(matrices), tuple(owners), tuple(tuple(b) for b in buckets), tp, dp, ns_steps, ns_form)

    @classmethod
    def for_local_shards(cls, names: Sequence[str], local_shapes: Sequence[tuple[int, ...]],
                         model_shape: ModelShape, tp: int, dp: int, ns_steps: int,
                         bucket_numel: int = DEFAULT_BUCKET_NUMEL, ns_form: NSForm = "standard") -> MuonExchange:
        """The plan from one TP rank's shard shapes (what tools/plan.py reads off the model)."""
        full = [full_shape(tuple(s), sharding_of(n), tp) for n, s in zip(names, local_shapes)]
        return cls.build(names, full, model_shape, tp, dp, ns_steps, bucket_numel, ns_form)

    @cached_property
    def _bucket_matrices(self) -> list[list[int]]:
        bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        out: list[list[int]] = [[] for _ in self.buckets]
        for m, lm in enumerate(self.matrices):
            out[bucket_of[lm.param_index]].append(m)
        return out

    @cached_property
    def _index(self) -> dict[tuple[int, str], int]:
        return {(lm.param_index, lm.part): m for m, lm in enumerate(self.matrices)}

    def index(self, param_index: int, part: str) -> int:
        """The matrix index of a parameter's logical part."""
        return self._index[(param_index, part)]

    def matrices_in(self, bucket: int) -> list[int]:
        return self._bucket_matrices[bucket]

    def owned(self, bucket: int, data_rank: int, tp_rank: int) -> list[int]:
        """Matrices of the bucket owned by rank (data_rank, tp_rank), ascending."""
        owner = data_rank * self.tp + tp_rank
        return [m for m in self.matrices_in(bucket) if self.owners[m] == owner]

    def pieces_numel(self, matrices: Sequence[int]) -> int:
        return sum(self.matrices[m].piece_numel(self.tp) for m in matrices)

    def slot_numel(self, bucket: int, data_rank: int) -> int:
        """Elements of one replica's slot (its pieces of the matrices owned in that replica); the
        same at every TP rank, since pieces are 1/T of a matrix."""
        return sum(self.pieces_numel(self.owned(bucket, data_rank, t)) for t in range(self.tp))

    def bytes_sent(self, data_rank: int, tp_rank: int, element_size: int) -> BytesSent:
        """Bytes rank (data_rank, tp_rank) sends in one step (definitions: muloco.core.comm.bytes_sent)."""
        gather = scatter = dp = 0
        for b in range(len(self.buckets)):
            gather += sum(self.pieces_numel(self.owned(b, data_rank, t)) for t in range(self.tp) if t != tp_rank)
            scatter += (self.tp - 1) * self.pieces_numel(self.owned(b, data_rank, tp_rank))
            dp += (self.dp - 1) * self.slot_numel(b, data_rank)
        return BytesSent(gather * element_size, scatter * element_size, dp * element_size)

    def max_bytes_sent(self, element_size: int) -> BytesSent:
        """The busiest rank's bytes."""
        return max((self.bytes_sent(d, t, element_size) for d in range(self.dp) for t in range(self.tp)),
                   key=lambda b: b.total)

    def transient_bytes(self, data_rank: int, tp_rank: int, element_size: int, ns_element_size: int,
                        local_numels: Sequence[int], nesterov: bool, momentum_element_size: int = 4) -> int:
        """Peak bytes of the buffers one step allocates beyond parameters, gradients and momentum,
        following `DistributedMuon.step`: while bucket b is orthogonalized and exchanged, bucket
        b+1's gather (its send buffer, this rank's replica's slot, and its receive buffer, the whole
        matrices it owns) is in flight. Phases of bucket b:
          pack: bucket b-1's whole matrices are held while one parameter's fp32 direction (Nesterov),
            the fp32 sum of a momentum stored in bf16 and a copy of its pieces are packed into
            bucket b's gather;
          orthogonalize: the owned whole matrices, the scatter's send buffer, this rank's slot and
            Newton-Schulz's workspace for the largest owned matrix (newton_schulz_workspace_numel);
          DP exchange: the own slot, its D-1 copies being sent and the D-1 slots received;
          apply: the D slots and two fp32 copies of the largest local parameter (its scaled pieces
            and the update assembled from them).
        Each buffer is counted at its allocated size, in the communication dtype unless noted."""
        c = element_size

        def slot(b: int, d: int) -> int:
            return self.slot_numel(b, d) * c

        def owned_whole(b: int) -> int:
            return self.tp * self.pieces_numel(self.owned(b, data_rank, tp_rank)) * c

        def gather(b: int) -> int:
            return slot(b, data_rank) + owned_whole(b) if b < len(self.buckets) else 0

        peak = 0
        for b, bucket in enumerate(self.buckets):
            in_flight = gather(b + 1)
            ns = max((newton_schulz_workspace_numel(self.matrices[m].shape, self.ns_steps, self.ns_form)
                      for m in self.owned(b, data_rank, tp_rank)), default=0) * ns_element_size
            slots = sum(slot(b, d) for d in range(self.dp))
            largest_local = max(local_numels[i] for i in bucket) * 4
            fp32_copies = 1 + nesterov + (momentum_element_size < 4)
            pack = (owned_whole(b - 1) if b else 0) + gather(b) + largest_local * fp32_copies
            peak = max(peak, pack,
                       in_flight + 2 * owned_whole(b) + slot(b, data_rank) + ns,
                       in_flight + slots + (self.dp - 1) * slot(b, data_rank),
                       in_flight + slots + 2 * largest_local)
        return peak

    def max_transient_bytes(self, element_size: int, ns_element_size: int, local_numels: Sequence[int],
                            nesterov: bool, momentum_element_size: int = 4) -> int:
        return max(self.transient_bytes(d, t, element_size, ns_element_size, local_numels, nesterov,
                                        momentum_element_size)
                   for d in range(self.dp) for t in range(self.tp))


def grad_allreduce_bytes(local_numel: int, dp: int, element_size: int = 4) -> int:
    """DeepSpeed's inner-DP gradient all-reduce of one rank (ring: 2(D-1)/D of the buffer). It never
    sees the trainer's bf16 block, so it reduces the fp32 gradients of the fp32 parameters in fp32."""
    return 2 * (dp - 1) * local_numel * element_size // dp
