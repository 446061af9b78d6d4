"""What each outer sync logs, gathered from every rank in one collective, which also checks that
every worker rejected the same payloads.

    pseudograd_norm      mean over workers of ||delta_k|| (from the skip vote)
    pseudograd_cosine    mean over workers of cos(delta_k, average): the paper's alignment mechanism
    averaged_norm        ||average||
    bytes_sent_per_rank  payload bytes of the exchange, mean over every rank
    overlap_needed       the sync's wall time in inner steps (sync_seconds / step_seconds), mean over a
                         worker's ranks, max over the workers
    compression_error    ||residual|| / ||sent||: what the payloads did not carry, relative to what
                         they were asked to (the error-feedback residual, computed anyway)
"""
from __future__ import annotations

import math
import statistics
import hashlib
import json
from dataclasses import dataclass

from muloco.diloco.wire import CollectiveError


@dataclass
class LocalSums:
    """This rank's share of the sums (TP-replicated tensors count on one rank only)."""
    dot: float = 0.0  # <delta, average>
    average_sq: float = 0.0
    bytes_sent: float = 0.0
    residual_sq: float = 0.0  # over compressed buckets
    sent_sq: float = 0.0  # over compressed buckets
    verdict: float = 0.0  # verdict_digest of the payloads this rank's outer group rejected
    overlap_needed: float = 0.0  # this sync's wall time in this rank's inner steps, divided by the ranks per worker


def verdict_digest(rejected: dict[int, str], skipped: str | None) -> float:
    """A 32-bit digest of the decision an outer group took: which senders it rejected, and whether it
    skipped the sync (the reasons' wording may differ between members; what decides the weights may
    not). Exact as a float, and its sums over a worker's ranks stay exact."""
    text = json.dumps([sorted(rejected), skipped is not None])
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little"))


def sync_record(rows: list[list[float]], contributors: list[int], ranks_per_worker: int, norms: list[float],
                context: str) -> dict:
    """The sync's statistics from every member's LocalSums summed over its ranks (`rows`, one per
    member), over the `contributors` (`norms` empty for a sync nobody applied: then only the verdicts
    are checked); bytes are the mean over every member's ranks (each sent its payload).

    Every rank of an outer group checks the same received bytes, so the groups' verdicts agree unless
    a message was altered on its way to some receivers only; then those receivers' weights now differ
    from the others', and the run stops here, on every rank, rather than train on apart."""
    if len({row[5] for row in rows}) > 1:
        raise CollectiveError(f"the workers disagree on which outer payloads to reject in {context} (a message was "
                              f"altered on its way to some of them, or a worker is at another outer step): their "
                              f"weights now differ; restart every worker from the same checkpoint")
    # The slowest worker's sync, in its own inner steps: what `overlap_steps: "auto"` covers (every
    # member reduces the same rows, so every member finds the same value).
    timing = {"overlap_needed": max(row[6] for row in rows)}
    if not norms:
        return timing
    sums = [rows[i] for i in contributors]
    dots, average_sq = [s[0] for s in sums], sums[0][1]  # every worker holds the same average
    residual_sq, sent_sq = sum(s[3] for s in sums), sum(s[4] for s in sums)
    return {
        "pseudograd_cosine": statistics.fmean(
            dots[k] / max(norms[k] * math.sqrt(average_sq), 1e-30) for k in range(len(sums))),
        "averaged_norm": math.sqrt(average_sq),
        "bytes_sent_per_rank": sum(row[2] for row in rows) / (len(rows) * ranks_per_worker),
        "compression_error": math.sqrt(residual_sq / sent_sq) if sent_sq > 0 else 0.0,
        **timing,
    }
