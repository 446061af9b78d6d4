"""The outer exchange: every collective of the outer loop that crosses the datacenter link.

`Wire` is one cross-datacenter group as seen by one rank: it runs the collectives on the group's
device (muloco.core.comm.group_device: the host for gloo, the accelerator for NCCL; only packed payloads
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

Nothing received is believed. With a job key (muloco/diloco/auth.py) every rank's part of every
collective carries a tag, and a part whose tag fails is dropped. Every payload is decoded within the
size its blocks allow (a zstd frame that would inflate past it is malformed, not a crash), and the
decoding is checked before it is averaged: it must be finite, its squared norm must equal the one its
sender claims in the header of the same collective (the sender computes it from its own decoding,
which is bit-identical to the receivers'), and its norm must stay within `max_norm_ratio` of the
others'. A sender that fails any check is rejected; since every rank checks the same bytes with the
same code, every rank rejects the same senders. The caller chooses what a rejection means: the
single-world outer loop skips the sync for everyone (as for a non-finite worker), the elastic one
averages over the others (`leave_out=True`, all-gather only). With reduce-scatter each chunk's owner
checks the chunks it receives and sends its verdicts with its re-quantized chunk, whose receivers
check it in turn: every rank learns every rejection.

Byte accounting (CollectiveStats, per rank, what it puts on / takes off the wire; the same for a ring
and for direct sends): an all-gather of n bytes per rank sends and receives (K-1)*n; an all-to-all
sends the blocks addressed to the other K-1 ranks and receives theirs; an all-reduce of n bytes
sends and receives 2 (K-1)/K * n (a ring). With S = this rank's payload bytes, S_j its bytes for
chunk j and Q_j = the re-quantized chunk j:
  all_gather:      sent = (K-1) * max_r S_r                      (grows with K)
  reduce_scatter:  sent = sum_{j != rank} S_j + (K-1) * max_j Q_j ~ 2 (K-1)/K * S (flat in K)
S includes the claim (8 bytes) and the caller's header, Q_j the owner's verdicts (K bytes) and
claim; with a job key every part sent adds a 32-byte tag.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from muloco.core import comm
from muloco.diloco.auth import EVERY_RANK, TAG_BYTES, JobKey, Scope
from muloco.diloco.compression import Blocks, Compressor, Encoded, PayloadError
from muloco.diloco.link import SlowLink

CLAIM_BYTES = 8  # a sender's squared norm of its own decoding (float64), ahead of the caller's header
# Relative difference allowed between a claimed and a measured squared norm: the two are computed by
# the same code on the same bytes (equal on one device type; this covers a mix of devices).
CLAIM_TOLERANCE = 1e-4


@dataclass
class CollectiveStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    link_seconds: float = 0.0  # held by the emulated slow link


class CollectiveError(RuntimeError):
    """A collective of the outer sync failed or timed out; the message names the caller's context."""


def row_split(n_rows: int, parts: int) -> list[int]:
    """Rows per chunk for `parts` contiguous chunks: the first n_rows % parts chunks get one more
    row; with fewer rows than parts the trailing chunks are empty."""
    base, extra = divmod(n_rows, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


class Wire:
    """A cross-datacenter group as seen by one rank. Not thread-safe: one caller at a time.

    With a job key, `begin` names the sync the next messages belong to, and each rank's part of every
    collective is sent with its tag; the collectives return None in place of a part whose tag fails.
    Subclasses provide the two raw collectives on their kind of group (GroupWire: a torch.distributed
    group; muloco/elastic's QuorumWire: torchft's reconfigurable group)."""

    def __init__(self, rank: int, size: int, device: torch.device, link: SlowLink | None,
                 key: JobKey | None = None, channel: str = "outer"):
        self.rank, self.size, self.device = rank, size, device
        self.link = link
        self.stats = CollectiveStats()
        self.key, self.channel = key, channel
        self.begin(outer_step=0, fragment=0)

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def _all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                         input_sizes: list[int]) -> None:
        raise NotImplementedError

    def take_stats(self) -> CollectiveStats:
        """The counts since the last call (one sync's)."""
        stats, self.stats = self.stats, CollectiveStats()
        return stats

    def begin(self, outer_step: int, fragment: int, epoch: int = 0) -> None:
        """The next messages belong to this sync (every rank of the group calls it alike)."""
        self._scope = Scope(self.channel, epoch, outer_step, fragment)
        self._sequence = 0

    @property
    def tag_bytes(self) -> int:
        return TAG_BYTES if self.key is not None else 0

    def _sealed(self, data: torch.Tensor, receiver: int) -> torch.Tensor:
        """`data` (uint8) followed by its tag, on the wire's device."""
        data = data.to(self.device)
        if self.key is None:
            return data
        tag = self.key.tag(self._scope, self._sequence, self.rank, receiver, data)
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(self.device)])

    def _opened(self, part: torch.Tensor, sender: int, receiver: int) -> torch.Tensor | None:
        """A received part without its tag, or None when the tag does not verify. This rank's own
        part never crossed the link (the collective copies it locally), so it is not checked."""
        if self.key is None:
            return part
        if sender == self.rank:
            return part[:-TAG_BYTES]
        data, tag = part[:-TAG_BYTES], part[-TAG_BYTES:]
        tag_bytes = tag.cpu().numpy().tobytes()
        return data if self.key.verify(tag_bytes, self._scope, self._sequence, sender, receiver, data) else None

    def _run(self, op: str, context: str, collective: Callable[[], object], sent: int, received: int) -> None:
        try:
            collective()
        except RuntimeError as exc:
            raise CollectiveError(f"{op} failed on rank {self.rank} of {self.size} in {context}: {exc}") from exc
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.round_trips += 1
        if self.link is not None:
            held = time.perf_counter()
            self.link.wait(sent)
            self.stats.link_seconds += time.perf_counter() - held

    def all_gather(self, buffer: torch.Tensor, context: str) -> list[torch.Tensor | None]:
        """All-gather equal-size 1-D uint8 buffers; returns one per rank, in rank order, on the wire's
        device (None: its tag failed)."""
        if self.size == 1:
            return [buffer.to(self.device)]
        sealed = self._sealed(buffer.reshape(-1).view(torch.uint8), EVERY_RANK)
        n = sealed.numel()
        if n == 0:
            return [sealed] * self.size
        gathered = torch.empty(self.size * n, dtype=torch.uint8, device=self.device)
        nbytes = (self.size - 1) * n
        self._run("all_gather", context, lambda: self._all_gather_into(gathered, sealed), nbytes, nbytes)
        parts = [self._opened(part, sender, EVERY_RANK) for sender, part in enumerate(gathered.split(n))]
        self._sequence += 1
        return parts

    def all_gather_padded(self, buffer: torch.Tensor, sizes: Sequence[int], context: str
                          ) -> list[torch.Tensor | None]:
        """All-gather byte buffers whose per-rank sizes every rank knows."""
        width = max(sizes)
        buffer = buffer[:sizes[self.rank]]  # more only where every rank refused this rank's sizes
        padded = torch.cat([buffer.to(self.device), buffer.new_zeros(width - buffer.numel(), device=self.device)])
        return [None if part is None else part[:size]
                for part, size in zip(self.all_gather(padded, context), sizes)]

    def all_gather_ints(self, values: Sequence[int], context: str) -> list[list[int] | None]:
        gathered = self.all_gather(torch.tensor(list(values), dtype=torch.int64).view(torch.uint8), context)
        return [None if part is None else part.cpu().clone().view(torch.int64).tolist() for part in gathered]

    def all_gather_floats(self, values: Sequence[float], context: str) -> list[list[float] | None]:
        """Every rank's float64 values (a few statistics), in rank order."""
        gathered = self.all_gather(torch.tensor(list(values), dtype=torch.float64).view(torch.uint8), context)
        return [None if part is None else part.cpu().clone().view(torch.float64).tolist() for part in gathered]

    def all_to_all(self, blocks: Sequence[torch.Tensor], receive_sizes: Sequence[int], context: str
                   ) -> list[torch.Tensor | None]:
        """Send blocks[j] (uint8) to rank j; returns the block from each rank, in rank order (None:
        its tag failed). `receive_sizes` are the blocks' sizes without tags."""
        if self.size == 1:
            return [blocks[0].to(self.device)]
        sealed = [self._sealed(block, receiver) for receiver, block in enumerate(blocks)]
        send_sizes = [block.numel() for block in sealed]
        receive_sizes = [size + self.tag_bytes for size in receive_sizes]
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=self.device)
        send = torch.cat(sealed)
        sent = sum(send_sizes) - send_sizes[self.rank]
        taken = sum(receive_sizes) - receive_sizes[self.rank]
        self._run("all_to_all", context, lambda: self._all_to_all_into(received, send, list(receive_sizes), send_sizes),
                  sent, taken)
        parts = [self._opened(part, sender, self.rank)
                 for sender, part in enumerate(received.split(list(receive_sizes)))]
        self._sequence += 1
        return parts

    def sum_per_worker(self, values: Sequence[float], workers: int, context: str) -> list[list[float]]:
        """Each worker's sums of `values` over its ranks (result[k][i]), for a group that spans every
        rank with the worker index slowest: every rank's values gathered, summed in rank order. A
        rank whose tag fails counts as zeros (these are statistics, not weights)."""
        rows = self.all_gather_floats(values, context)
        per_worker = self.size // workers
        sums = [[0.0] * len(values) for _ in range(workers)]
        for rank, row in enumerate(rows):
            if row is not None:
                sums[rank // per_worker] = [a + b for a, b in zip(sums[rank // per_worker], row)]
        return sums


class GroupWire(Wire):
    """A Wire over a torch.distributed process group (None: the default group)."""

    def __init__(self, group, link: SlowLink | None, key: JobKey | None = None, channel: str = "outer"):
        super().__init__(dist.get_rank(group), dist.get_world_size(group), comm.group_device(group), link, key, channel)
        self.group = group

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_gather_into_tensor(output, input, group=self.group)

    def _all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                         input_sizes: list[int]) -> None:
        dist.all_to_all_single(output, input, output_sizes, input_sizes, group=self.group)


@dataclass(frozen=True)
class BucketPacking:
    """Tensors of one bucket (as (rows, columns)) in one flat buffer, CHUNK-major: row chunk j of every
    tensor (row_split over `parts`), then chunk j+1, so the chunk an outer rank owns in a
    reduce-scatter is one contiguous slice. parts = 1 is the tensors one after another."""
    shapes: tuple[tuple[int, int], ...]
    parts: int

    @property
    def counts(self) -> list[list[int]]:
        return [row_split(rows, self.parts) for rows, _ in self.shapes]

    @property
    def chunks(self) -> list[Blocks]:
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
    """One bucket to average: its codec, its packing and this rank's flat fp32 buffer (the
    pseudogradient, error feedback already added)."""
    compressor: Compressor
    packing: BucketPacking
    flat: torch.Tensor


@dataclass
class Averaged:
    average: torch.Tensor  # flat fp32 in the bucket's packing, bit-identical on every rank of the group
    residual: torch.Tensor  # flat fp32: what this rank's payload did not carry (flat - its decoding)


# Why a sender's payload is not averaged; every rank finds the same reasons for the same bytes (the
# reduce-scatter owners send them as codes, an index into this tuple plus one).
REJECTIONS = ("failed authentication", "malformed payload", "payload decodes to non-finite values",
              "payload norm differs from the norm its sender claims", "payload norm is over max_norm_ratio x its peers'")
AUTHENTICATION, MALFORMED, NONFINITE, CLAIM_MISMATCH, OUTLIER = REJECTIONS
LEFT_OUT = "left out by its header"  # a reason of the caller's (e.g. joining), as a reduce-scatter owner reports it


@dataclass
class Exchanged:
    averaged: list[Averaged]  # one per bucket; empty when a rejection dropped the average
    headers: list[torch.Tensor | None]  # every group rank's header (uint8), in rank order; None: not received
    rejected: dict[int, str] = field(default_factory=dict)  # group rank -> why its payload was not averaged


def squared_norm(t: torch.Tensor) -> float:
    """Sum of squares accumulated in fp64 (without an fp64 copy of the tensor); inf when an entry is
    non-finite or its square overflows."""
    return float(t.square().sum(dtype=torch.float64))


def _claim(sq_norm: float) -> torch.Tensor:
    return torch.tensor([sq_norm], dtype=torch.float64).view(torch.uint8)


def _read_claim(head: torch.Tensor) -> float:
    return head[:CLAIM_BYTES].cpu().clone().view(torch.float64).item()


def _encode_chunks(bucket: Bucket) -> list[Encoded]:
    packing = bucket.packing
    return [bucket.compressor.encode_bucket(piece, blocks)
            for piece, blocks in zip(bucket.flat.split(packing.chunk_numels), packing.chunks)]


def _sizes_by_rank(wire: Wire, own: Sequence[int], fixed: Sequence[int | None], limits: Sequence[int], context: str
                   ) -> tuple[list[list[int]], dict[int, str]]:
    """Every rank's payload sizes: `fixed` (the same on every rank) unless zstd makes them
    data-dependent, when they are gathered; a rank whose sizes fail their tag or exceed `limits` is
    rejected (its sizes count as zeros, on every rank alike)."""
    if None not in fixed:
        return [list(fixed)] * wire.size, {}
    sizes, rejected = [], {}
    for rank, claimed in enumerate(wire.all_gather_ints(own, context)):
        if claimed is None:
            rejected[rank] = AUTHENTICATION
        elif len(claimed) != len(limits) or any(not 0 <= size <= limit for size, limit in zip(claimed, limits)):
            rejected[rank] = MALFORMED
        sizes.append([0] * len(limits) if rank in rejected else claimed)
    return sizes, rejected


def _verdicts(senders: Sequence[int], failed: dict[int, str], measured: dict[int, float], claims: dict[int, float],
              max_norm_ratio: float) -> dict[int, str]:
    """Sender -> why it is rejected: `failed` already, a squared norm that is not the claimed one, or a
    norm over max_norm_ratio times the median of the other accepted senders'."""
    reasons = dict(failed)
    for r in senders:
        if r not in reasons:
            m, c = measured.get(r, 0.0), claims[r]
            if not (math.isfinite(c) and abs(m - c) <= CLAIM_TOLERANCE * max(abs(m), abs(c))):
                reasons[r] = CLAIM_MISMATCH
    accepted = [r for r in senders if r not in reasons]
    for r in accepted:
        others = [math.sqrt(measured.get(j, 0.0)) for j in accepted if j != r]
        if others and math.sqrt(measured.get(r, 0.0)) > max_norm_ratio * max(statistics.median(others), 1e-12):
            reasons[r] = OUTLIER
    return reasons


class _Decodings:
    """The payloads of one bucket's blocks from several senders, decoded and checked one at a time: each
    sender's squared norm is accumulated over the buckets, and a sender whose payload is malformed or
    non-finite is marked failed and skipped from then on."""

    def __init__(self):
        self.failed: dict[int, str] = {}
        self.measured: dict[int, float] = {}

    def decode(self, sender: int, compressor: Compressor, data: torch.Tensor, blocks: Blocks, device
               ) -> torch.Tensor | None:
        if sender in self.failed:
            return None
        try:
            decoded = compressor.decode_bucket(data.to(device), blocks)
        except PayloadError:
            self.failed[sender] = MALFORMED
            return None
        sq = squared_norm(decoded)
        if not math.isfinite(sq):
            self.failed[sender] = NONFINITE
            return None
        self.measured[sender] = self.measured.get(sender, 0.0) + sq
        return decoded

    def sum_in_rank_order(self, senders: Sequence[int], payloads: Callable[[int], torch.Tensor],
                          compressor: Compressor, blocks: Blocks, device, weights: Weights | None = None
                          ) -> tuple[torch.Tensor | None, list[int]]:
        """(sum of the senders' decodings that pass, each times its `weights` factor when given, the
        senders summed). Sums in rank order, so every rank does the same fp32 operations; only one
        decoding is alive besides the running sum."""
        total, summed = None, []
        for sender in senders:
            if sender in self.failed:
                continue
            decoded = self.decode(sender, compressor, payloads(sender), blocks, device)
            if decoded is None:
                continue
            if weights is None:
                total = decoded.clone() if total is None else total.add_(decoded)
            else:
                factor = weights.factor(sender)
                total = decoded.mul(factor) if total is None else total.add_(decoded, alpha=factor)
            summed.append(sender)
        return total, summed


def _average_over(kept: list[int], totals: list[tuple[torch.Tensor | None, list[int]]], buckets: Sequence[Bucket],
                  bucket_blocks: Sequence[Blocks], payloads: Callable[[int, int], torch.Tensor],
                  weights: Weights | None) -> list[torch.Tensor]:
    """Each bucket's average over the `kept` senders (plain, or the `weights`' merge): the running
    sums where they hold exactly those senders, else summed again (a sender rejected after its bucket
    was summed: rare, the failure path)."""
    averages = []
    for i, ((total, summed), bucket, blocks) in enumerate(zip(totals, buckets, bucket_blocks)):
        if summed != kept:
            total, _ = _Decodings().sum_in_rank_order(kept, lambda r: payloads(r, i), bucket.compressor, blocks,
                                                      bucket.flat.device, weights)
        averages.append(total.div_(len(kept)) if weights is None else total.mul_(weights.scale(kept)))
    return averages


class Weights(Protocol):
    """A weighted merge (muloco/diloco/pace.py): sum_k factor(k) x_k, times scale(kept senders)."""

    def factor(self, sender: int) -> float: ...

    def scale(self, kept: list[int]) -> float: ...


Choose = Callable[[list["torch.Tensor | None"]], tuple[list[int], dict[int, str]]]
# (every rank's header, the senders `choose` picked) -> their merge's weights
Weigh = Callable[[list["torch.Tensor | None"], list[int]], "Weights | None"]


def everyone(headers: list[torch.Tensor | None]) -> tuple[list[int], dict[int, str]]:
    """Every rank of the group sends a payload to average (the single-world mode)."""
    return list(range(len(headers))), {}


def average_buckets(buckets: Sequence[Bucket], wire: Wire, collective: str, context: str,
                    header: torch.Tensor | None = None, choose: Choose = everyone,
                    max_norm_ratio: float = math.inf, leave_out: bool = False, weigh: Weigh | None = None
                    ) -> Exchanged:
    """Average each bucket over the senders `choose` picks from every rank's `header` (uint8, the same
    size on every rank, delivered with the first collective; it returns the senders and why each
    other rank is not one). Ranks not chosen still take part in the collectives and receive the
    average. Every chosen payload is checked (see the module docstring); with `leave_out` the average
    is over the senders that pass, else any rejection drops it (`averaged` is empty). Decoding happens
    on each bucket's own device. With a header the collectives run even when there are no buckets.
    `weigh` (when given) turns the headers of the senders into the weights of the merge (None from it: the
    plain average)."""
    header = torch.empty(0, dtype=torch.uint8) if header is None else header
    if collective == "all_gather":
        return _all_gather_average(buckets, wire, context, header, choose, max_norm_ratio, leave_out, weigh)
    return _reduce_scatter_average(buckets, wire, context, header, choose, max_norm_ratio, leave_out, weigh)


def _all_gather_average(buckets: Sequence[Bucket], wire: Wire, context: str, header: torch.Tensor, choose: Choose,
                        max_norm_ratio: float, leave_out: bool, weigh: Weigh | None) -> Exchanged:
    encoded = [_encode_chunks(bucket)[0] for bucket in buckets]
    bucket_blocks = [bucket.packing.chunks[0] for bucket in buckets]
    head = torch.cat([_claim(sum(squared_norm(e.decoded) for e in encoded)), header.cpu()])
    fixed = [head.numel()] + [b.compressor.bucket_nbytes(blocks) for b, blocks in zip(buckets, bucket_blocks)]
    limits = [head.numel()] + [b.compressor.max_bucket_nbytes(blocks) for b, blocks in zip(buckets, bucket_blocks)]
    sizes, failed = _sizes_by_rank(wire, [head.numel()] + [e.nbytes for e in encoded], fixed, limits, context)
    payload = torch.cat([head.to(wire.device)] + [e.data.to(wire.device) for e in encoded])
    buffers = wire.all_gather_padded(payload, [sum(s) for s in sizes], context)
    parts = {r: buffer.split(sizes[r]) for r, buffer in enumerate(buffers) if buffer is not None and r not in failed}
    headers = [parts[r][0][CLAIM_BYTES:] if r in parts else None for r in range(wire.size)]

    senders, left_out = choose(headers)
    weights = weigh(headers, senders) if weigh is not None else None
    decodings = _Decodings()
    decodings.failed.update({r: failed.get(r, AUTHENTICATION) for r in senders if r not in parts})
    totals = [decodings.sum_in_rank_order(senders, lambda r: parts[r][i], bucket.compressor, blocks, bucket.flat.device,
                                          weights)
              for i, (bucket, blocks) in enumerate(zip(buckets, bucket_blocks), start=1)]
    claims = {r: _read_claim(parts[r][0]) for r in senders if r in parts}
    rejected = _verdicts(senders, decodings.failed, decodings.measured, claims, max_norm_ratio)
    kept = [r for r in senders if r not in rejected]
    rejected.update(left_out)
    if not kept or (rejected.keys() - left_out.keys() and not leave_out):
        return Exchanged([], headers, rejected)
    averages = _average_over(kept, totals, buckets, bucket_blocks, lambda r, i: parts[r][i + 1], weights)
    return Exchanged([Averaged(average, bucket.flat - own.decoded)
                      for average, bucket, own in zip(averages, buckets, encoded)], headers, rejected)


def _reduce_scatter_average(buckets: Sequence[Bucket], wire: Wire, context: str, header: torch.Tensor, choose: Choose,
                            max_norm_ratio: float, leave_out: bool, weigh: Weigh | None) -> Exchanged:
    size, me, n = wire.size, wire.rank, len(buckets)
    encoded = [_encode_chunks(bucket) for bucket in buckets]  # [bucket][chunk]

    # Phase 1: rank j receives every worker's claim, header and payload for chunk j. A block holds
    # n + 1 entries (claim and header, then the buckets); sizes are indexed [rank][j*(n+1) + entry].
    heads = [torch.cat([_claim(sum(squared_norm(encoded[i][j].decoded) for i in range(n))), header.cpu()])
             for j in range(size)]
    head_size = heads[0].numel()
    chunks = [bucket.packing.chunks for bucket in buckets]  # [bucket][chunk]
    fixed = [x for j in range(size) for x in [head_size] + [buckets[i].compressor.bucket_nbytes(chunks[i][j])
                                                            for i in range(n)]]
    limits = [x for j in range(size) for x in [head_size] + [buckets[i].compressor.max_bucket_nbytes(chunks[i][j])
                                                             for i in range(n)]]
    own = [x for j in range(size) for x in [head_size] + [encoded[i][j].nbytes for i in range(n)]]
    sizes, failed = _sizes_by_rank(wire, own, fixed, limits, context)
    blocks = [torch.cat([heads[j].to(wire.device)] + [encoded[i][j].data.to(wire.device) for i in range(n)])
              for j in range(size)]
    receive_sizes = [sizes[src][me * (n + 1):(me + 1) * (n + 1)] for src in range(size)]
    received = wire.all_to_all(blocks, [sum(s) for s in receive_sizes], context)
    parts = {src: buffer.split(receive_sizes[src]) for src, buffer in enumerate(received)
             if buffer is not None and src not in failed}
    headers = [parts[src][0][CLAIM_BYTES:] if src in parts else None for src in range(size)]

    # Phase 2: check the chunks this rank owns from the senders its headers choose, average them in
    # rank order and re-quantize.
    senders, left_out = choose(headers)
    weights = weigh(headers, senders) if weigh is not None else None
    owned = [chunks[i][me] for i in range(n)]
    decodings = _Decodings()
    decodings.failed.update({src: failed.get(src, AUTHENTICATION) for src in senders if src not in parts})
    totals = [decodings.sum_in_rank_order(senders, lambda src: parts[src][i], bucket.compressor, blocks,
                                          bucket.flat.device, weights)
              for i, (bucket, blocks) in enumerate(zip(buckets, owned), start=1)]
    claims = {src: _read_claim(parts[src][0]) for src in senders if src in parts}
    verdicts = {**left_out, **_verdicts(senders, decodings.failed, decodings.measured, claims, max_norm_ratio)}

    def requantize(kept: list[int]) -> list[Encoded]:
        averages = (_average_over(kept, totals, buckets, owned, lambda src, i: parts[src][i + 1], weights) if kept else
                    [torch.zeros(sum(r * c for r, c in blocks), device=b.flat.device) for b, blocks in zip(buckets, owned)])
        return [bucket.compressor.encode_bucket(average, blocks)
                for bucket, average, blocks in zip(buckets, averages, owned)]

    # Phase 3: every rank gathers every owner's verdicts (a code per sender: 0 averaged, else why not)
    # and re-quantized chunk, and checks them. Owners that saw different headers or payloads may have
    # averaged over different senders; with leave_out they average again over the senders no owner
    # refused (phase 4, only then), else any refusal drops the sync.
    kept = [src for src in range(size) if src not in verdicts]
    gathered = _gather_requantized(wire, requantize(kept), _codes(verdicts, size), buckets, chunks, context)
    refused = {src: reason for codes in gathered.codes for src, reason in codes.items()}
    if gathered.failed_owners:
        return _refused_owners(gathered, headers, verdicts | refused, leave_out, context)
    if leave_out and any(set(codes) != set(refused) for codes in gathered.codes):
        final = [src for src in range(size) if src not in refused]
        gathered = _gather_requantized(wire, requantize(final), _codes(refused, size), buckets, chunks, context)
        if gathered.failed_owners:
            return _refused_owners(gathered, headers, refused, leave_out, context)
    rejected = {src: verdicts.get(src, reason) for src, reason in refused.items()}
    if not leave_out and rejected.keys() - left_out.keys() or len(rejected) == size:
        return Exchanged([], headers, rejected)
    out = []
    for i, bucket in enumerate(buckets):
        average = torch.cat([gathered.decoded[j][i] for j in range(size)])
        sent = torch.cat([chunk.decoded for chunk in encoded[i]])
        out.append(Averaged(average, bucket.flat - sent))
    return Exchanged(out, headers, rejected)


def _codes(verdicts: dict[int, str], size: int) -> torch.Tensor:
    """An owner's verdict on every sender: 0 averaged, else 1 + the index of the reason's category
    (a header's own reasons, e.g. "joining", travel as LEFT_OUT)."""
    return torch.tensor([REJECTIONS.index(verdicts[src]) + 1 if verdicts.get(src) in REJECTIONS
                         else len(REJECTIONS) + 1 if src in verdicts else 0 for src in range(size)], dtype=torch.uint8)


@dataclass
class _Requantized:
    decoded: list[list[torch.Tensor] | None]  # [owner][bucket]
    codes: list[dict[int, str]]  # every owner's refusals: sender -> reason
    failed_owners: dict[int, str]  # owners whose part failed its tag or checks


def _gather_requantized(wire: Wire, requantized: list[Encoded], codes: torch.Tensor, buckets: Sequence[Bucket],
                        chunks: list[list[Blocks]], context: str) -> _Requantized:
    """All-gather each owner's verdict codes, claim and re-quantized chunk; decode and check them all."""
    size, me, n = wire.size, wire.rank, len(buckets)
    q_head = torch.cat([codes, _claim(sum(squared_norm(q.decoded) for q in requantized))])
    fixed = [q_head.numel()] + [buckets[i].compressor.bucket_nbytes(chunks[i][me]) for i in range(n)]
    failed: dict[int, str] = {}
    if None in fixed:
        limits = [[q_head.numel()] + [buckets[i].compressor.max_bucket_nbytes(chunks[i][j]) for i in range(n)]
                  for j in range(size)]
        sizes = []
        for j, claimed in enumerate(wire.all_gather_ints([q_head.numel()] + [q.nbytes for q in requantized], context)):
            ok = claimed is not None and len(claimed) == n + 1 and all(0 <= a <= b for a, b in zip(claimed, limits[j]))
            if not ok:
                failed[j] = AUTHENTICATION if claimed is None else MALFORMED
            sizes.append(claimed if ok else [0] * (n + 1))
    else:
        sizes = [[q_head.numel()] + [buckets[i].compressor.bucket_nbytes(chunks[i][j]) for i in range(n)]
                 for j in range(size)]
    payload = torch.cat([q_head.to(wire.device)] + [q.data.to(wire.device) for q in requantized])
    buffers = wire.all_gather_padded(payload, [sum(s) for s in sizes], context)
    checked = _Decodings()
    checked.failed.update(failed)
    decoded: list[list[torch.Tensor] | None] = []
    all_codes: list[dict[int, str]] = []
    for j, buffer in enumerate(buffers):
        if buffer is None or j in failed:
            checked.failed.setdefault(j, AUTHENTICATION)
            decoded.append(None)
            all_codes.append({})
            continue
        q_parts = buffer.split(sizes[j])
        owner_codes = {}
        for src, code in enumerate(q_parts[0][:size].tolist()):
            if 0 < code <= len(REJECTIONS) + 1:
                owner_codes[src] = f"{(*REJECTIONS, LEFT_OUT)[code - 1]} (found by the owner of chunk {j})"
            elif code:
                checked.failed[j] = MALFORMED
        all_codes.append(owner_codes)
        decoded.append([checked.decode(j, buckets[i].compressor, q_parts[i + 1], chunks[i][j], buckets[i].flat.device)
                        for i in range(n)])
        if j not in checked.failed:
            measured, claim = checked.measured.get(j, 0.0), _read_claim(q_parts[0][size:])
            if not (math.isfinite(claim) and abs(measured - claim) <= CLAIM_TOLERANCE * max(abs(measured), abs(claim))):
                checked.failed[j] = CLAIM_MISMATCH
    return _Requantized(decoded, all_codes, checked.failed)


def _refused_owners(gathered: _Requantized, headers, rejected: dict[int, str], leave_out: bool, context: str) -> Exchanged:
    """An owner whose re-quantized chunk fails: nobody can complete the average. The single world skips
    the sync (the owner's worker named); where a sender is left out instead, the attempt fails."""
    reasons = {j: f"{reason} (its re-quantized chunk {j})" for j, reason in gathered.failed_owners.items()}
    if leave_out:
        raise CollectiveError(f"re-quantized chunks failed their checks in {context}: "
                              + "; ".join(f"rank {j}: {why}" for j, why in reasons.items()))
    return Exchanged([], headers, {**rejected, **reasons})
