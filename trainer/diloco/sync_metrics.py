"""What each outer sync logs, gathered from every rank in one collective.

    pseudograd_norm      mean over workers of ||delta_k|| (from the skip vote)
    pseudograd_cosine    mean over workers of cos(delta_k, average): the paper's alignment mechanism
    averaged_norm        ||average||
    bytes_sent_per_rank  payload bytes of the exchange, mean over every rank
    compression_error    ||residual|| / ||sent||: what the payloads did not carry, relative to what
                         they were asked to (the error-feedback residual, computed anyway)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import astuple, dataclass

from trainer.diloco.collectives import Wire


@dataclass
class LocalSums:
    """This rank's share of the sums (TP-replicated tensors count on one rank only)."""
    dot: float = 0.0  # <delta, average>
    average_sq: float = 0.0
    bytes_sent: float = 0.0
    residual_sq: float = 0.0  # over compressed buckets
    sent_sq: float = 0.0  # over compressed buckets


def sync_record(wire: Wire, workers: int, norms: list[float], local: LocalSums, context: str) -> dict:
    sums = wire.sum_per_worker(list(astuple(local)), workers, f"sync metrics, {context}")
    dots, average_sq = [s[0] for s in sums], sums[0][1]  # every worker holds the same average
    residual_sq, sent_sq = sum(s[3] for s in sums), sum(s[4] for s in sums)
    return {
        "pseudograd_cosine": statistics.fmean(
            dots[k] / max(norms[k] * math.sqrt(average_sq), 1e-30) for k in range(workers)),
        "averaged_norm": math.sqrt(average_sq),
        "bytes_sent_per_rank": sum(s[2] for s in sums) / wire.size,
        "compression_error": math.sqrt(residual_sq / sent_sq) if sent_sq > 0 else 0.0,
    }
