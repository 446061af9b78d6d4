"""Nothing received is believed: the checks every rank runs on the payloads of an outer average, and
the reasons it gives. Every payload is decoded within the size its blocks allow (a zstd frame that
would inflate past it is malformed, not a crash), and the decoding is checked before it is averaged:
it must be finite, its squared norm must equal the one its sender claims in the header of the same
collective (the sender computes it from its own decoding, which is bit-identical to the receivers'),
and its norm must stay within `max_norm_ratio` of the others'. Since every rank checks the same bytes
with the same code, every rank rejects the same senders."""
from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from muloco.diloco.compression import Blocks, Compressor, PayloadError

if TYPE_CHECKING:
    from muloco.diloco.averaging import Weights

CLAIM_BYTES = 8  # a sender's squared norm of its own decoding (float64), ahead of the caller's header
# Relative difference allowed between a claimed and a measured squared norm: the two are computed by
# the same code on the same bytes (equal on one device type; this covers a mix of devices).
CLAIM_TOLERANCE = 1e-4


REJECTIONS = ("failed authentication", "malformed payload", "payload decodes to non-finite values",
              "payload norm differs from the norm its sender claims", "payload norm is over max_norm_ratio x its peers'")
AUTHENTICATION, MALFORMED, NONFINITE, CLAIM_MISMATCH, OUTLIER = REJECTIONS
LEFT_OUT = "left out by its header"  # a reason of the caller's (e.g. joining), as a reduce-scatter owner reports it


def squared_norm(t: torch.Tensor) -> float:
    """Sum of squares accumulated in fp64 (without an fp64 copy of the tensor); inf when an entry is
    non-finite or its square overflows."""
    return float(t.square().sum(dtype=torch.float64))


def encode_claim(sq_norm: float) -> torch.Tensor:
    return torch.tensor([sq_norm], dtype=torch.float64).view(torch.uint8)


def read_claim(head: torch.Tensor) -> float:
    return head[:CLAIM_BYTES].cpu().clone().view(torch.float64).item()


def rejected_senders(senders: Sequence[int], failed: dict[int, str], measured: dict[int, float],
                     claims: dict[int, float], max_norm_ratio: float) -> dict[int, str]:
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


class Decodings:
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


def verdict_codes(verdicts: dict[int, str], size: int) -> torch.Tensor:
    """An owner's verdict on every sender: 0 averaged, else 1 + the index of the reason's category
    (a header's own reasons, e.g. "joining", travel as LEFT_OUT)."""
    return torch.tensor([REJECTIONS.index(verdicts[src]) + 1 if verdicts.get(src) in REJECTIONS
                         else len(REJECTIONS) + 1 if src in verdicts else 0 for src in range(size)], dtype=torch.uint8)
