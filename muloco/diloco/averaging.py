"""The averaging protocol of the outer exchange: `average_buckets` averages compressed pseudogradient
buckets over an outer group (a `Wire`, muloco/diloco/wire.py). Determinism: every rank decodes the same
payload bytes with the same code, sums the decoded buckets in rank order in fp32 and divides by K, so
all ranks end with bit-identical averages. Method "none" takes the same path (its payload is the raw
fp32 bytes), which is a plain fp32 average. Two collectives:
- all_gather: each rank all-gathers its payloads and decodes all K of them (1 round trip).
- reduce_scatter: tensor rows are split into K contiguous chunks (packing.row_split); rank j gets every
  worker's payload for chunk j (one all-to-all), averages them, re-quantizes the average and
  all-gathers it (2 round trips).
Each rank may add a small header (bytes of the same size on every rank) that reaches every rank of
the group with the first collective: the outer loop's skip vote travels this way, so deciding
whether to apply a sync costs no round trip of its own. Error feedback only covers the first quantization: the
  re-quantization error of a chunk is not fed back (it would need per-owner state that moves with
  the chunk assignment). Top-k re-selects k entries from the averaged chunk.
With zstd, payload sizes depend on the data: each collective is preceded by an all-gather of the
sizes (one more round trip), and all-gather buffers are padded to the largest rank's.

Every received part is checked before it is averaged (muloco/diloco/payload_checks.py); a part whose
tag fails is dropped. The caller chooses what a rejection means: the single-world outer loop skips the
sync for everyone (as for a non-finite worker), the elastic one averages over the others
(`leave_out=True`, all-gather only). With reduce-scatter each chunk's owner checks the chunks it
receives and sends its verdicts with its re-quantized chunk, whose receivers check it in turn: every
rank learns every rejection.

Bytes per rank (the wire's accounting), with S = this rank's payload bytes, S_j its bytes for chunk j
and Q_j = the re-quantized chunk j:
  all_gather:      sent = (K-1) * max_r S_r                      (grows with K)
  reduce_scatter:  sent = sum_{j != rank} S_j + (K-1) * max_j Q_j ~ 2 (K-1)/K * S (flat in K)
S includes the claim (8 bytes) and the caller's header, Q_j the owner's verdicts (K bytes) and
claim; with a job key every part sent adds a 32-byte tag.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from muloco.diloco.compression import Blocks, Compressor, Encoded
from muloco.diloco.packing import BucketPacking
from muloco.diloco.payload_checks import (AUTHENTICATION, CLAIM_BYTES, CLAIM_MISMATCH, CLAIM_TOLERANCE, LEFT_OUT,
                                          MALFORMED, REJECTIONS, Decodings, encode_claim, read_claim, rejected_senders,
                                          squared_norm, verdict_codes)
from muloco.diloco.wire import CollectiveError, Wire


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

@dataclass
class Exchanged:
    averaged: list[Averaged]  # one per bucket; empty when a rejection dropped the average
    headers: list[torch.Tensor | None]  # every group rank's header (uint8), in rank order; None: not received
    rejected: dict[int, str] = field(default_factory=dict)  # group rank -> why its payload was not averaged



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



def _average_over(kept: list[int], totals: list[tuple[torch.Tensor | None, list[int]]], buckets: Sequence[Bucket],
                  bucket_blocks: Sequence[Blocks], payloads: Callable[[int, int], torch.Tensor],
                  weights: Weights | None) -> list[torch.Tensor]:
    """Each bucket's average over the `kept` senders (plain, or the `weights`' merge): the running
    sums where they hold exactly those senders, else summed again (a sender rejected after its bucket
    was summed: rare, the failure path)."""
    averages = []
    for i, ((total, summed), bucket, blocks) in enumerate(zip(totals, buckets, bucket_blocks)):
        if summed != kept:
            total, _ = Decodings().sum_in_rank_order(kept, lambda r: payloads(r, i), bucket.compressor, blocks,
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
    head = torch.cat([encode_claim(sum(squared_norm(e.decoded) for e in encoded)), header.cpu()])
    fixed = [head.numel()] + [b.compressor.bucket_nbytes(blocks) for b, blocks in zip(buckets, bucket_blocks)]
    limits = [head.numel()] + [b.compressor.max_bucket_nbytes(blocks) for b, blocks in zip(buckets, bucket_blocks)]
    sizes, failed = _sizes_by_rank(wire, [head.numel()] + [e.nbytes for e in encoded], fixed, limits, context)
    payload = torch.cat([head.to(wire.device)] + [e.data.to(wire.device) for e in encoded])
    buffers = wire.all_gather_padded(payload, [sum(s) for s in sizes], context)
    parts = {r: buffer.split(sizes[r]) for r, buffer in enumerate(buffers) if buffer is not None and r not in failed}
    headers = [parts[r][0][CLAIM_BYTES:] if r in parts else None for r in range(wire.size)]

    senders, left_out = choose(headers)
    weights = weigh(headers, senders) if weigh is not None else None
    decodings = Decodings()
    decodings.failed.update({r: failed.get(r, AUTHENTICATION) for r in senders if r not in parts})
    totals = [decodings.sum_in_rank_order(senders, lambda r: parts[r][i], bucket.compressor, blocks, bucket.flat.device,
                                          weights)
              for i, (bucket, blocks) in enumerate(zip(buckets, bucket_blocks), start=1)]
    claims = {r: read_claim(parts[r][0]) for r in senders if r in parts}
    rejected = rejected_senders(senders, decodings.failed, decodings.measured, claims, max_norm_ratio)
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
    heads = [torch.cat([encode_claim(sum(squared_norm(encoded[i][j].decoded) for i in range(n))), header.cpu()])
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
    decodings = Decodings()
    decodings.failed.update({src: failed.get(src, AUTHENTICATION) for src in senders if src not in parts})
    totals = [decodings.sum_in_rank_order(senders, lambda src: parts[src][i], bucket.compressor, blocks,
                                          bucket.flat.device, weights)
              for i, (bucket, blocks) in enumerate(zip(buckets, owned), start=1)]
    claims = {src: read_claim(parts[src][0]) for src in senders if src in parts}
    verdicts = {**left_out, **rejected_senders(senders, decodings.failed, decodings.measured, claims, max_norm_ratio)}

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
    gathered = _gather_requantized(wire, requantize(kept), verdict_codes(verdicts, size), buckets, chunks, context)
    refused = {src: reason for codes in gathered.codes for src, reason in codes.items()}
    if gathered.failed_owners:
        return _refused_owners(gathered, headers, verdicts | refused, leave_out, context)
    if leave_out and any(set(codes) != set(refused) for codes in gathered.codes):
        final = [src for src in range(size) if src not in refused]
        gathered = _gather_requantized(wire, requantize(final), verdict_codes(refused, size), buckets, chunks, context)
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



@dataclass
class _Requantized:
    decoded: list[list[torch.Tensor] | None]  # [owner][bucket]
    codes: list[dict[int, str]]  # every owner's refusals: sender -> reason
    failed_owners: dict[int, str]  # owners whose part failed its tag or checks


def _gather_requantized(wire: Wire, requantized: list[Encoded], codes: torch.Tensor, buckets: Sequence[Bucket],
                        chunks: list[list[Blocks]], context: str) -> _Requantized:
    """All-gather each owner's verdict codes, claim and re-quantized chunk; decode and check them all."""
    size, me, n = wire.size, wire.rank, len(buckets)
    q_head = torch.cat([codes, encode_claim(sum(squared_norm(q.decoded) for q in requantized))])
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
    checked = Decodings()
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
            measured, claim = checked.measured.get(j, 0.0), read_claim(q_parts[0][size:])
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
