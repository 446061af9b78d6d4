"""The outer exchange: every collective of the outer loop that crosses the datacenter link.

`Wire` is one cross-datacenter group as seen by one rank: it runs the collectives on the group's
device (trainer.comm.group_device: the host for gloo, the accelerator for NCCL; only packed payloads
and a few statistics ever cross), counts bytes and round trips, emulates the slow link, and turns
failures into CollectiveErrors that name the caller's context.

`average_buckets` averages compressed pseudogradient buckets over an outer group. Determinism:
every rank decodes the same payload bytes with the same code, sums the decoded buckets in rank order
in fp32 and divides by K, so all ranks end with bit-identical averages. Method "none" takes the same
path (its payload is the raw fp32 bytes), which is a plain fp32 average. Two collectives:
- all_gather: each rank all-gathers its payloads and decodes all K of them (1 round trip).
- reduce_scatter: tensor rows are split into K contiguous chunks (row_split); rank j gets every
  worker's payload for chunk j (one all-to-all), averages them, re-quantizes the average and
  all-gathers it (2 round trips).
Each rank may add a small header (bytes of the same size on every rank) that reaches every rank of
the group with the first collective: the outer loop's skip vote travels this way, so deciding
whether to apply a sync costs no round trip of its own. Error feedback only covers the first quantization: the
  re-quantization error of a chunk is not fed back (it would need per-owner state that moves with
  the chunk assignment). Top-k re-selects k entries from the averaged chunk.
With zstd, payload sizes depend on the data: each collective is preceded by an all-gather of the
sizes (one more round trip), and all-gather buffers are padded to the largest rank's.

Byte accounting (CollectiveStats, per rank, what it puts on / takes off the wire; the same for a ring
and for direct sends): an all-gather of n bytes per rank sends and receives (K-1)*n; an all-to-all
sends the blocks addressed to the other K-1 ranks and receives theirs; an all-reduce of n bytes
sends and receives 2 (K-1)/K * n (a ring). With S = this rank's payload bytes, S_j its bytes for
chunk j and Q_j = the re-quantized chunk j:
  all_gather:      sent = (K-1) * max_r S_r                      (grows with K)
  reduce_scatter:  sent = sum_{j != rank} S_j + (K-1) * max_j Q_j ~ 2 (K-1)/K * S (flat in K)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from trainer import comm
from trainer.diloco.compression import Compressor, Encoded, Layout
from trainer.diloco.link import SlowLink


@dataclass
class CollectiveStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0


class CollectiveError(RuntimeError):
    """A collective of the outer sync failed or timed out; the message names the caller's context."""


def row_split(n_rows: int, parts: int) -> list[int]:
    """Rows per chunk for `parts` contiguous chunks: the first n_rows % parts chunks get one more
    row; with fewer rows than parts the trailing chunks are empty."""
    base, extra = divmod(n_rows, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


class Wire:
    """A cross-datacenter group as seen by one rank. Not thread-safe: one caller at a time."""

    def __init__(self, group, link: SlowLink | None):
        self.group = group
        self.link = link
        self.device = comm.group_device(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stats = CollectiveStats()

    # The raw collectives on the group; a wire over another kind of group (trainer/elastic's
    # reconfigurable quorum group) overrides these three.
    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_gather_into_tensor(output, input, group=self.group)

    def _all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                         input_sizes: list[int]) -> None:
        dist.all_to_all_single(output, input, output_sizes, input_sizes, group=self.group)

    def _all_reduce(self, buffer: torch.Tensor) -> None:
        dist.all_reduce(buffer, group=self.group)

    def take_stats(self) -> CollectiveStats:
        """The counts since the last call (one sync's)."""
        stats, self.stats = self.stats, CollectiveStats()
        return stats

    def _run(self, op: str, context: str, collective: Callable[[], object], sent: int, received: int) -> None:
        try:
            collective()
        except RuntimeError as exc:
            raise CollectiveError(f"{op} failed on rank {self.rank} of {self.size} in {context}: {exc}") from exc
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.round_trips += 1
        if self.link is not None:
            self.link.wait(sent)

    def all_gather(self, buffer: torch.Tensor, context: str) -> list[torch.Tensor]:
        """All-gather equal-size 1-D buffers; returns one per rank, in rank order, on the wire's device."""
        n = buffer.numel()
        if self.size == 1 or n == 0:
            return [buffer.to(self.device)] * self.size
        buffer = buffer.to(self.device)
        gathered = torch.empty(self.size * n, dtype=buffer.dtype, device=self.device)
        nbytes = (self.size - 1) * n * buffer.element_size()
        self._run("all_gather", context, lambda: self._all_gather_into(gathered, buffer), nbytes, nbytes)
        return list(gathered.split(n))

    def all_gather_padded(self, buffer: torch.Tensor, sizes: Sequence[int], context: str) -> list[torch.Tensor]:
        """All-gather byte buffers whose per-rank sizes every rank knows."""
        width = max(sizes)
        padded = torch.cat([buffer.to(self.device), buffer.new_zeros(width - buffer.numel(), device=self.device)])
        return [part[:size] for part, size in zip(self.all_gather(padded, context), sizes)]

    def all_gather_ints(self, values: Sequence[int], context: str) -> list[list[int]]:
        gathered = self.all_gather(torch.tensor(list(values), dtype=torch.int64), context)
        return [part.tolist() for part in gathered]

    def all_to_all(self, blocks: Sequence[torch.Tensor], receive_sizes: Sequence[int], context: str
                   ) -> list[torch.Tensor]:
        """Send blocks[j] to rank j; returns the block from each rank, in rank order."""
        if self.size == 1:
            return [blocks[0].to(self.device)]
        send_sizes = [block.numel() for block in blocks]
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=self.device)
        send = torch.cat([block.to(self.device) for block in blocks])
        sent = sum(send_sizes) - send_sizes[self.rank]
        taken = sum(receive_sizes) - receive_sizes[self.rank]
        self._run("all_to_all", context, lambda: self._all_to_all_into(received, send, list(receive_sizes), send_sizes),
                  sent, taken)
        return list(received.split(list(receive_sizes)))

    def sum(self, values: torch.Tensor, context: str) -> torch.Tensor:
        """All-reduce (sum) a small float64 vector; returns it on the host."""
        if self.size == 1:
            return values.cpu()
        buffer = values.to(self.device)
        nbytes = 2 * (self.size - 1) * buffer.numel() * buffer.element_size() // self.size
        self._run("all_reduce", context, lambda: self._all_reduce(buffer), nbytes, nbytes)
        return buffer.cpu()

    def sum_per_worker(self, values: Sequence[float], worker: int, workers: int, context: str) -> list[list[float]]:
        """Each worker's sums of `values` over its ranks (result[k][i]): every rank puts its values in
        its worker's slot of one vector, summed over the group (which must span every rank)."""
        slots = torch.zeros(workers, len(values), dtype=torch.float64)
        slots[worker] = torch.tensor(list(values), dtype=torch.float64)
        return self.sum(slots.reshape(-1), context).view(workers, len(values)).tolist()


@dataclass(frozen=True)
class BucketLayout:
    """Tensors of one bucket (as (rows, columns)) in one flat buffer, CHUNK-major: row chunk j of every
    tensor (row_split over `parts`), then chunk j+1, so the chunk an outer rank owns in a
    reduce-scatter is one contiguous slice. parts = 1 is the tensors one after another."""
    shapes: tuple[tuple[int, int], ...]
    parts: int

    @property
    def counts(self) -> list[list[int]]:
        return [row_split(rows, self.parts) for rows, _ in self.shapes]

    @property
    def chunks(self) -> list[Layout]:
        counts = self.counts
        return [tuple((count[j], cols) for count, (_, cols) in zip(counts, self.shapes)) for j in range(self.parts)]

    @property
    def chunk_numels(self) -> list[int]:
        return [sum(rows * cols for rows, cols in chunk) for chunk in self.chunks]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """(rows, columns) tensors -> one flat fp32 buffer."""
        splits = [t.float().split(count) for t, count in zip(tensors, self.counts)]
        return torch.cat([split[j].reshape(-1) for j in range(self.parts) for split in splits])

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of flatten: (rows, columns) tensors."""
        blocks = [chunk_flat.split([rows * cols for rows, cols in chunk])
                  for chunk_flat, chunk in zip(flat.split(self.chunk_numels), self.chunks)]
        return [torch.cat([blocks[j][i].view(self.chunks[j][i]) for j in range(self.parts)])
                for i in range(len(self.shapes))]


@dataclass
class Bucket:
    """One bucket to average: its codec, its layout and this rank's flat fp32 buffer (the
    pseudogradient, error feedback already added)."""
    compressor: Compressor
    layout: BucketLayout
    flat: torch.Tensor


@dataclass
class Averaged:
    average: torch.Tensor  # flat fp32, the bucket's layout, bit-identical on every rank of the group
    residual: torch.Tensor  # flat fp32: what this rank's payload did not carry (flat - its decoding)


@dataclass
class Exchanged:
    averaged: list[Averaged]  # one per bucket
    headers: list[torch.Tensor]  # every group rank's header (uint8), in rank order


def _encode_chunks(bucket: Bucket) -> list[Encoded]:
    layout = bucket.layout
    return [bucket.compressor.encode_bucket(chunk, layout_j)
            for chunk, layout_j in zip(bucket.flat.split(layout.chunk_numels), layout.chunks)]


def _sizes_by_rank(wire: Wire, own: Sequence[int], fixed: Sequence[int | None], context: str) -> list[list[int]]:
    """Every rank's payload sizes: `fixed` (the same on every rank) unless zstd makes them data-dependent."""
    if None not in fixed:
        return [list(fixed)] * wire.size
    return wire.all_gather_ints(own, context)


def _average_in_rank_order(decoded: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum in rank order, then divide: the same fp32 operations on every rank. Takes the decodings
    one at a time, so only one is alive besides the running sum."""
    total, count = None, 0
    for tensor in decoded:
        total = tensor.clone() if total is None else total.add_(tensor)
        count += 1
    return total.div_(count)


def average_buckets(buckets: Sequence[Bucket], wire: Wire, collective: str, context: str,
                    members: Sequence[int] | None = None, header: torch.Tensor | None = None) -> Exchanged:
    """Average each bucket over the wire's group (or over the group ranks `members` only: the others
    still take part in the collectives, and receive the average), and deliver every rank's `header`
    (uint8, the same size on every rank); decoding happens on each bucket's own device. With a
    header the collectives run even when there are no buckets."""
    header = torch.empty(0, dtype=torch.uint8) if header is None else header
    if collective == "all_gather":
        return _all_gather_average(buckets, wire, context, members, header)
    if members is not None:
        raise ValueError("averaging over a subset of the group is implemented for the all_gather collective only")
    return _reduce_scatter_average(buckets, wire, context, header)


def _all_gather_average(buckets: Sequence[Bucket], wire: Wire, context: str, members: Sequence[int] | None,
                        header: torch.Tensor) -> Exchanged:
    encoded = [_encode_chunks(bucket)[0] for bucket in buckets]
    fixed = [header.numel()] + [b.compressor.bucket_nbytes(b.layout.chunks[0]) for b in buckets]
    sizes = _sizes_by_rank(wire, [header.numel()] + [e.nbytes for e in encoded], fixed, context)
    payload = torch.cat([header.to(wire.device)] + [e.data.to(wire.device) for e in encoded])
    buffers = wire.all_gather_padded(payload, [sum(s) for s in sizes], context)
    received = [buffer.split(rank_sizes) for buffer, rank_sizes in zip(buffers, sizes)]
    out = []
    for i, (bucket, own) in enumerate(zip(buckets, encoded), start=1):
        device, chunk = bucket.flat.device, bucket.layout.chunks[0]
        decoded = (bucket.compressor.decode_bucket(received[rank][i].to(device), chunk)
                   for rank in (range(wire.size) if members is None else members))
        out.append(Averaged(_average_in_rank_order(decoded), bucket.flat - own.decoded))
    return Exchanged(out, [parts[0] for parts in received])


def _reduce_scatter_average(buckets: Sequence[Bucket], wire: Wire, context: str, header: torch.Tensor) -> Exchanged:
    size, me, n = wire.size, wire.rank, len(buckets)
    encoded = [_encode_chunks(bucket) for bucket in buckets]  # [bucket][chunk]

    # Phase 1: rank j receives every worker's header and payload for chunk j. A block holds n + 1
    # entries (the header, then the buckets); sizes are indexed [rank][j*(n+1) + entry].
    fixed = [size_ for j in range(size) for size_ in
             [header.numel()] + [buckets[i].compressor.bucket_nbytes(buckets[i].layout.chunks[j]) for i in range(n)]]
    own = [size_ for j in range(size) for size_ in [header.numel()] + [encoded[i][j].nbytes for i in range(n)]]
    sizes = _sizes_by_rank(wire, own, fixed, context)
    blocks = [torch.cat([header.to(wire.device)] + [encoded[i][j].data.to(wire.device) for i in range(n)])
              for j in range(size)]
    receive_sizes = [sizes[src][me * (n + 1):(me + 1) * (n + 1)] for src in range(size)]
    received = wire.all_to_all(blocks, [sum(s) for s in receive_sizes], context)
    from_rank = [buffer.split(s) for buffer, s in zip(received, receive_sizes)]

    # Phase 2: average own chunk in rank order and re-quantize it.
    requantized = []
    for i, bucket in enumerate(buckets):
        own_chunk, device = bucket.layout.chunks[me], bucket.flat.device
        decoded = (bucket.compressor.decode_bucket(from_rank[src][i + 1].to(device), own_chunk) for src in range(size))
        requantized.append(bucket.compressor.encode_bucket(_average_in_rank_order(decoded), own_chunk))

    # Phase 3: all-gather the re-quantized chunks; every rank decodes all of them, its own included.
    q_fixed = [buckets[i].compressor.bucket_nbytes(buckets[i].layout.chunks[me]) for i in range(n)]
    if None in q_fixed:
        q_sizes = wire.all_gather_ints([q.nbytes for q in requantized], context)
    else:
        q_sizes = [[buckets[i].compressor.bucket_nbytes(buckets[i].layout.chunks[j]) for i in range(n)]
                   for j in range(size)]
    q_payload = torch.cat([q.data.to(wire.device) for q in requantized]) if requantized \
        else torch.empty(0, dtype=torch.uint8, device=wire.device)
    buffers = wire.all_gather_padded(q_payload, [sum(s) for s in q_sizes], context)
    owned = [buffer.split(s) for buffer, s in zip(buffers, q_sizes)]
    out = []
    for i, bucket in enumerate(buckets):
        device, chunks = bucket.flat.device, bucket.layout.chunks
        average = torch.cat([bucket.compressor.decode_bucket(owned[j][i].to(device), chunks[j]) for j in range(size)])
        sent = torch.cat([chunk.decoded for chunk in encoded[i]])
        out.append(Averaged(average, bucket.flat - sent))
    return Exchanged(out, [parts[0] for parts in from_rank])
