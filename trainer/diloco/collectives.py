"""Averaging compressed pseudogradients across the K workers of an outer group.

Determinism: every rank decodes the same payload bytes with the same code, sums the decoded tensors
in rank order in fp32 and divides by K, so all ranks end with bit-identical averages. Method "none"
takes the same path (its payload is the raw fp32 bytes), which is a plain fp32 average.

Two collectives, both batched over many tensors so that one sync costs a few collectives, not a few
per parameter:
- all_gather_average: each rank all-gathers its payloads and decodes all K of them.
- reduce_scatter_average: tensor rows are split into K contiguous chunks (row_split); rank j gets every
  worker's payload for chunk j (one all-to-all), averages them, re-quantizes the average with the same
  compressor and all-gathers it. Error feedback only covers the first quantization: the
  re-quantization error of a chunk is not fed back (it would need per-owner state that moves with
  the chunk assignment). Top-k re-selects k entries from the averaged chunk.

Byte accounting (CollectiveStats, per rank, what it puts on / takes off the wire; the same for a ring
and for direct sends): an all-gather of n bytes per rank sends and receives (K-1)*n; an all-to-all
sends the blocks addressed to the other K-1 ranks and receives theirs. Payload sizes are known to
every rank from the shapes unless zstd is on; then each collective is preceded by an all-gather of
8 bytes per payload, and all-gather buffers are padded to the largest rank's (padding counted).
With S = this rank's total payload bytes and S_j = its bytes for chunk j, Q_j = re-quantized chunk j:
  all_gather_average:      sent = (K-1) * max_r S_r                      (grows with K)
  reduce_scatter_average:  sent = sum_{j != rank} S_j + (K-1) * max_j Q_j ~ 2 (K-1)/K * S (flat in K)
received is symmetric (the blocks other ranks address to this one, and (K-1) * the padded size).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

import torch
import torch.distributed as dist

from trainer.diloco.compression import Compressor, ErrorFeedback, Payload, rows_shape
from trainer.diloco.link import SlowLink

Codec = Union[Compressor, ErrorFeedback]
Group = Union[dist.ProcessGroup, None]


@dataclass
class CollectiveStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def __add__(self, other: "CollectiveStats") -> "CollectiveStats":
        return CollectiveStats(self.bytes_sent + other.bytes_sent,
                               self.bytes_received + other.bytes_received,
                               self.seconds + other.seconds)


class CollectiveError(RuntimeError):
    """A collective of the outer sync failed or timed out; the message names the caller's context."""


def row_split(n_rows: int, parts: int) -> list[int]:
    """Rows per chunk for `parts` contiguous chunks: the first n_rows % parts chunks get one more
    row; with fewer rows than parts the trailing chunks are empty."""
    base, extra = divmod(n_rows, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


class _Wire:
    """The outer group as seen by one rank: runs collectives, counts bytes, emulates the link and
    turns failures into CollectiveErrors that name the caller's context."""

    def __init__(self, group: Group, context: str, link: SlowLink | None, device: torch.device):
        self.group = group
        self.context = context
        self.link = link
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stats = CollectiveStats()

    def _run(self, op: str, collective: Callable[[], object], sent: int, received: int) -> None:
        try:
            collective()
        except RuntimeError as exc:
            raise CollectiveError(
                f"{op} failed on rank {self.rank} of {self.size} in {self.context}: {exc}") from exc
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        if self.link is not None:
            self.link.wait(sent)

    def all_gather(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """All-gather equal-size 1-D buffers; returns one per rank, in rank order."""
        n = buffer.numel()
        if n == 0:
            return [buffer] * self.size
        gathered = torch.empty(self.size * n, dtype=buffer.dtype, device=buffer.device)
        nbytes = (self.size - 1) * n * buffer.element_size()
        self._run("all_gather", lambda: dist.all_gather_single(gathered, buffer, group=self.group),
                  nbytes, nbytes)
        return list(gathered.split(n))

    def all_gather_padded(self, buffer: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """All-gather byte buffers whose per-rank sizes every rank knows."""
        width = max(sizes)
        padded = torch.cat([buffer, buffer.new_zeros(width - buffer.numel())])
        return [part[:size] for part, size in zip(self.all_gather(padded), sizes)]

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        gathered = self.all_gather(torch.tensor(list(values), dtype=torch.int64, device=self.device))
        return [part.tolist() for part in gathered]

    def all_to_all(self, blocks: Sequence[torch.Tensor], receive_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Send blocks[j] to rank j; returns the block from each rank, in rank order."""
        send_sizes = [block.numel() for block in blocks]
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=self.device)
        sent = sum(send_sizes) - send_sizes[self.rank]
        taken = sum(receive_sizes) - receive_sizes[self.rank]
        self._run("all_to_all", lambda: dist.all_to_all_single(
            received, torch.cat(list(blocks)), list(receive_sizes), send_sizes, group=self.group), sent, taken)
        return list(received.split(list(receive_sizes)))


def _plain(codec: Codec) -> Compressor:
    return codec.compressor if isinstance(codec, ErrorFeedback) else codec


def _sizes_by_rank(wire: _Wire, own: Sequence[int], fixed: Sequence[Sequence[int | None]]) -> list[list[int]]:
    """Every rank's payload sizes: fixed[rank] when the shapes determine them (no zstd), else exchanged."""
    if all(None not in rank_sizes for rank_sizes in fixed):
        return [list(rank_sizes) for rank_sizes in fixed]
    return wire.all_gather_ints(own)


def _concat(payloads: Sequence[Payload], device: torch.device) -> torch.Tensor:
    if not payloads:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([payload.data for payload in payloads])


def _split(buffer: torch.Tensor, sizes: Sequence[int]) -> list[Payload]:
    return [Payload(part) for part in buffer.split(list(sizes))]


def _average_in_rank_order(decoded: Iterable[torch.Tensor], size: int) -> torch.Tensor:
    """Sum in the given (rank) order, then divide: the same fp32 operations on every rank. Accumulates
    in place into the first tensor, which decode() returns freshly allocated."""
    total = None
    for tensor in decoded:
        total = tensor if total is None else total.add_(tensor)
    return total.div_(size)


def all_gather_average_many(tensors: Sequence[torch.Tensor], codecs: Sequence[Codec], group: Group, *,
                            context: str, link: SlowLink | None = None
                            ) -> tuple[list[torch.Tensor], CollectiveStats]:
    """Average each tensor over the group: encode (through the codec's error feedback if any),
    all-gather the payloads, decode all K, average. Returns fp32 tensors of the input shapes."""
    start = time.perf_counter()
    wire = _Wire(group, context, link, _batch_device(tensors, codecs))
    shapes = [tensor.shape for tensor in tensors]
    plains = [_plain(codec) for codec in codecs]
    payloads = [codec.compress(tensor) for codec, tensor in zip(codecs, tensors)]

    fixed = [plain.payload_nbytes(shape) for plain, shape in zip(plains, shapes)]
    sizes = _sizes_by_rank(wire, [p.nbytes for p in payloads], [fixed] * wire.size)
    buffers = wire.all_gather_padded(_concat(payloads, wire.device), [sum(s) for s in sizes])
    received = [_split(buffer, rank_sizes) for buffer, rank_sizes in zip(buffers, sizes)]

    averages = [
        _average_in_rank_order((plain.decode(received[rank][i], shape) for rank in range(wire.size)), wire.size)
        for i, (plain, shape) in enumerate(zip(plains, shapes))]
    wire.stats.seconds = time.perf_counter() - start
    return averages, wire.stats


def reduce_scatter_average_many(tensors: Sequence[torch.Tensor], codecs: Sequence[Codec], group: Group, *,
                                context: str, link: SlowLink | None = None
                                ) -> tuple[list[torch.Tensor], CollectiveStats]:
    """Average each tensor over the group with bytes per rank flat in K: rank j averages row chunk j
    of every worker, re-quantizes it (no error feedback) and all ranks decode the re-quantized chunks.
    Returns fp32 tensors of the input shapes."""
    start = time.perf_counter()
    wire = _Wire(group, context, link, _batch_device(tensors, codecs))
    size, me = wire.size, wire.rank
    plains = [_plain(codec) for codec in codecs]
    counts = [row_split(rows_shape(tensor.shape)[0], size) for tensor in tensors]
    chunk_shapes = [[(rows, rows_shape(tensor.shape)[1]) for rows in rows_per_chunk]
                    for tensor, rows_per_chunk in zip(tensors, counts)]
    n = len(tensors)

    # Phase 1: rank j receives every worker's payload for chunk j. Sizes are indexed [rank][i*K + j].
    chunks = [codec.compress_split(tensor, rows) for codec, tensor, rows in zip(codecs, tensors, counts)]
    fixed = [plains[i].payload_nbytes(chunk_shapes[i][j]) for i in range(n) for j in range(size)]
    sizes = _sizes_by_rank(wire, [chunks[i][j].nbytes for i in range(n) for j in range(size)], [fixed] * size)
    blocks = [_concat([chunks[i][j] for i in range(n)], wire.device) for j in range(size)]
    receive_sizes = [[sizes[src][i * size + me] for i in range(n)] for src in range(size)]
    received = wire.all_to_all(blocks, [sum(s) for s in receive_sizes])
    from_rank = [_split(buffer, s) for buffer, s in zip(received, receive_sizes)]

    # Phase 2: average own chunk in rank order and re-quantize it.
    requantized = [
        plains[i].encode(_average_in_rank_order(
            (plains[i].decode(from_rank[src][i], chunk_shapes[i][me]) for src in range(size)), size))
        for i in range(n)]

    # Phase 3: all-gather the re-quantized chunks; every rank decodes all of them, its own included.
    q_sizes = _sizes_by_rank(wire, [p.nbytes for p in requantized],
                             [[plains[i].payload_nbytes(chunk_shapes[i][j]) for i in range(n)] for j in range(size)])
    buffers = wire.all_gather_padded(_concat(requantized, wire.device), [sum(s) for s in q_sizes])
    owned = [_split(buffer, s) for buffer, s in zip(buffers, q_sizes)]
    averages = [
        torch.cat([plains[i].decode(owned[j][i], chunk_shapes[i][j]) for j in range(size)]).reshape(tensors[i].shape)
        for i in range(n)]
    wire.stats.seconds = time.perf_counter() - start
    return averages, wire.stats


def all_gather_average(tensor: torch.Tensor, codec: Codec, group: Group, *, context: str,
                       link: SlowLink | None = None) -> tuple[torch.Tensor, CollectiveStats]:
    (average,), stats = all_gather_average_many([tensor], [codec], group, context=context, link=link)
    return average, stats


def reduce_scatter_average(tensor: torch.Tensor, codec: Codec, group: Group, *, context: str,
                           link: SlowLink | None = None) -> tuple[torch.Tensor, CollectiveStats]:
    (average,), stats = reduce_scatter_average_many([tensor], [codec], group, context=context, link=link)
    return average, stats


def all_finite(flag: bool, group: Group, *, context: str = "all_finite") -> bool:
    """True on every rank iff `flag` is True on every rank (e.g. all payloads are finite)."""
    wire = _Wire(group, context, None, _group_device(group))
    return all(flags[0] == 1 for flags in wire.all_gather_ints([int(bool(flag))]))


def _batch_device(tensors: Sequence[torch.Tensor], codecs: Sequence[Codec]) -> torch.device:
    if not tensors:
        raise ValueError("the collectives need at least one tensor")
    if len(tensors) != len(codecs):
        raise ValueError(f"got {len(tensors)} tensors but {len(codecs)} codecs; pass one codec per tensor")
    return tensors[0].device


def _group_device(group: Group) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
