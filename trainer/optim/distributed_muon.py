"""Muon over Megatron tensor-parallel shards, exactly Muon on the logical matrices at every T and D.

Every logical matrix (Q, K, V; gate, up; the rest whole) is orthogonalized whole by one owner among
the T x D ranks that hold identical gradients, and each rank receives back only its own pieces
(the plan and its byte and memory counts: trainer/optim/muon_comm_model.py). Each step:
1. momentum on the local shard (elementwise, so sharding does not change it);
2. per bucket of parameters: all-to-all over TP sends each rank's piece of every matrix to that
   matrix's owner in its replica; the next bucket's all-to-all runs while this one's
   Newton-Schulz does;
3. owners orthogonalize their matrices and all-to-all over TP returns piece r to TP rank r;
4. an all-to-all over inner DP of those pieces delivers every replica's results to every replica;
5. decoupled weight decay and the update, lr-scaled per logical matrix, on the local shard.
Pieces travel in bf16 when Newton-Schulz runs in bf16 (the values it would compute on anyway), else
in fp32; either way the update equals single-process Muon on the whole matrices.

Against the documented designs (not run here): Megatron-core's TensorParallelMuon in "duplicated"
mode all-gathers every matrix to every TP rank and each runs Newton-Schulz on all of them (T-fold
redundant work, (T-1) x local bytes sent per rank), "distributed" mode all-reduces Gram matrices at
every Newton-Schulz iteration, and "blockwise" orthogonalizes shards (a different update). Its
layer-sharded Muon and Dion's Muon route each whole matrix to one rank with all-to-alls and back, as
steps 2-3 do here over TP; this exchange also spreads owners over the D inner-DP replicas, which
hold identical gradients, and returns their results with one all-to-all over DP (step 4).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from muloco.core import comm
from trainer.model.sharding import from_logical_matrices, full_shape, sharding_of, logical_matrices
from trainer.model.presets import ModelShape
from trainer.optim.muon import MuonConfig, apply_update, lr_scale, orthogonalize_direction, update_momentum
from trainer.optim.muon_comm_model import DEFAULT_BUCKET_NUMEL, MuonExchange, comm_dtype, local_model_shape


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
    """`bucket_numel` bounds the full (T=1) elements exchanged at once (transient memory at 15B
    scale); ownership is balanced within each bucket, so every bucket's work is spread over all
    T x D owners."""

    def __init__(self, names: list[str], params: list[torch.nn.Parameter], model_shape: ModelShape,
                 tp: ShardGroup, dp: ShardGroup, bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        self.names, self.params, self.model_shape, self.tp, self.dp = names, params, model_shape, tp, dp
        self.bucket_numel = bucket_numel
        self.full_shapes = [full_shape(tuple(p.shape), sharding_of(n), tp.size) for n, p in zip(names, params)]
        self.local_shape = local_model_shape(model_shape, tp.size)
        group = tp.group if tp.group is not None else dp.group
        self.device = comm.group_device(group) if group is not None else params[0].device
        self.exchange: MuonExchange | None = None

    def _exchange(self, config: MuonConfig) -> MuonExchange:
        """The plan for the config's Newton-Schulz (its FLOPs balance the owners), built once per form."""
        x = self.exchange
        if x is None or (x.ns_steps, x.ns_form) != (config.ns_steps, config.ns_form):
            self.exchange = MuonExchange.build(self.names, self.full_shapes, self.model_shape, self.tp.size,
                                               self.dp.size, config.ns_steps, self.bucket_numel, config.ns_form)
        return self.exchange

    def _local_pieces(self, i: int, local: torch.Tensor) -> dict[str, torch.Tensor]:
        return logical_matrices(self.names[i], local, self.local_shape)

    # -- 2. gather to owners ------------------------------------------------------------------------

    def _start_gather(self, x: MuonExchange, b: int, momentum_buffers, config: MuonConfig, dtype):
        """Pack this rank's pieces by destination owner and start the all-to-all; returns
        (receive buffer, handle or None)."""
        d, t, T = self.dp.rank, self.tp.rank, self.tp.size
        send_splits = [x.pieces_numel(x.owned(b, d, dest)) for dest in range(T)]
        send = torch.empty(sum(send_splits), dtype=dtype, device=self.device)
        place, offset = {}, 0  # matrix -> offset in `send`: grouped by owner, in matrix order
        for dest in range(T):
            for m in x.owned(b, d, dest):
                place[m] = offset
                offset += x.matrices[m].piece_numel(T)
        for i in x.buckets[b]:  # one parameter's direction at a time
            p = self.params[i]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            direction = update_momentum(momentum_buffers[i], grad, config.momentum, config.nesterov)
            for part, piece in self._local_pieces(i, direction).items():
                start = place.get(x.index(i, part))
                if start is not None:  # None: owned in another replica, which gathers it there
                    send[start:start + piece.numel()].view_as(piece).copy_(piece)
        if T == 1:
            return send, None
        mine = x.pieces_numel(x.owned(b, d, t))
        recv = torch.empty(T * mine, dtype=dtype, device=self.device)
        if mine == 0 and sum(send_splits) == 0:
            return recv, None
        handle = comm.all_to_all_single(recv, send, [mine] * T, send_splits, group=self.tp.group, async_op=True)
        return recv, handle

    def _whole_matrices(self, x: MuonExchange, b: int, recv: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(matrix index, whole matrix) of each matrix this rank owns, from every TP rank's piece."""
        T = self.tp.size
        owned = x.owned(b, self.dp.rank, self.tp.rank)
        per_source = recv.view(T, -1)
        out, offset = [], 0
        for m in owned:
            lm = x.matrices[m]
            n = lm.piece_numel(T)
            pieces = [per_source[src, offset:offset + n].view(lm.piece_shape(T)) for src in range(T)]
            out.append((m, torch.cat(pieces, dim=lm.split_dim) if T > 1 else pieces[0]))
            offset += n
        return out

    # -- 3, 4. orthogonalize and return pieces -----------------------------------------------------

    def _orthogonalize_and_return(self, x: MuonExchange, b: int, wholes, config: MuonConfig,
                                  dtype) -> list[torch.Tensor]:
        """Slot d' for every replica d': this TP rank's pieces of the matrices owned in replica d'."""
        d, t, T, D = self.dp.rank, self.tp.rank, self.tp.size, self.dp.size
        slot_numels = [x.slot_numel(b, replica) for replica in range(D)]
        own_slot = torch.empty(slot_numels[d], dtype=dtype, device=self.device)
        mine = x.pieces_numel(x.owned(b, d, t))
        # The scatter's send buffer: piece `dest` of every owned result, grouped by destination.
        send = own_slot if T == 1 else torch.empty(T * mine, dtype=dtype, device=self.device)
        per_dest = send[:T * mine].view(T, mine)
        offset = 0
        while wholes:
            m, whole = wholes.pop(0)  # drop each whole matrix as soon as it is orthogonalized
            lm = x.matrices[m]
            ortho = orthogonalize_direction(whole, config)
            n = lm.piece_numel(T)
            for dest, piece in enumerate(ortho.chunk(T, dim=lm.split_dim)):
                per_dest[dest, offset:offset + n].view(lm.piece_shape(T)).copy_(piece)
            offset += n
        if T > 1 and slot_numels[d]:
            sources = [x.pieces_numel(x.owned(b, d, src)) for src in range(T)]
            comm.all_to_all_single(own_slot, send, sources, [mine] * T, group=self.tp.group)
        del send, per_dest
        if D == 1:
            return [own_slot]
        # Every replica's slot to every other replica (sizes differ, so not an all-gather).
        others = [n if r != d else 0 for r, n in enumerate(slot_numels)]
        received = torch.empty(sum(others), dtype=dtype, device=self.device)
        if sum(slot_numels):
            comm.all_to_all_single(received, own_slot.repeat(D - 1), others,
                                   [slot_numels[d] if r != d else 0 for r in range(D)], group=self.dp.group)
        slots = list(received.split(others))
        slots[d] = own_slot
        return slots

    # -- 5. apply --------------------------------------------------------------------------------

    def _apply(self, x: MuonExchange, b: int, slots: list[torch.Tensor], config: MuonConfig, lr: float,
               weight_decay: float) -> None:
        T = self.tp.size
        received: dict[int, dict[str, torch.Tensor]] = {i: {} for i in x.buckets[b]}  # views into slots
        for replica, slot in enumerate(slots):
            offset = 0
            for owner_tp in range(T):
                for m in x.owned(b, replica, owner_tp):
                    lm = x.matrices[m]
                    n = lm.piece_numel(T)
                    received[lm.param_index][lm.part] = slot[offset:offset + n].view(lm.piece_shape(T))
                    offset += n
        for i, views in received.items():  # one parameter's fp32 update at a time
            # The lr scale belongs to the logical matrix (Q, K, V differ in shape); applied in fp32,
            # as on one rank.
            parts = {part: view.float() * lr_scale(x.matrices[x.index(i, part)].shape, config.lr_scaling)
                     for part, view in views.items()}
            update = from_logical_matrices(self.names[i], parts, self.local_shape).to(self.params[i].device)
            apply_update(self.params[i], update.view_as(self.params[i]), lr, weight_decay, scale=1.0)

    @torch.no_grad()
    def step(self, momentum_buffers: list[torch.Tensor], config: MuonConfig, lr: float, weight_decay: float) -> None:
        """One Muon step at this step's (scheduled) lr and weight decay."""
        x = self._exchange(config)
        dtype = comm_dtype(config.ns_dtype)
        in_flight = self._start_gather(x, 0, momentum_buffers, config, dtype) if x.buckets else None
        for b in range(len(x.buckets)):
            (recv, handle), in_flight = in_flight, None
            if handle is not None:
                handle.wait()
            wholes = self._whole_matrices(x, b, recv)
            del recv  # at T > 1 the whole matrices are copies; free the pieces before the next gather
            if b + 1 < len(x.buckets):
                in_flight = self._start_gather(x, b + 1, momentum_buffers, config, dtype)
            self._apply(x, b, self._orthogonalize_and_return(x, b, wholes, config, dtype), config, lr, weight_decay)
