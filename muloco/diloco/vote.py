"""The skip vote: whether an outer sync is applied, decided identically on every rank.

Any non-finite pseudogradient anywhere, or a worker whose pseudogradient norm is more than
`max_norm_ratio` times its peers' median, skips the sync for everyone: the workers restart from the
unchanged global weights. Each rank's ballot is its worker's totals (non-finite count, squared norm)
summed over the worker's ranks inside the datacenter; it rides in the header of the exchange's first
collective (muloco.diloco.averaging), so every rank of every outer group sees all K ballots and
the vote costs no cross-datacenter round trip. A skipped sync has spent its bytes; its average is
dropped.
"""
from __future__ import annotations

import math
import statistics

import torch

BALLOT_VALUES = 2  # non-finite count, squared norm
BALLOT_BYTES = 8 * BALLOT_VALUES  # float64, the header of the exchange's first collective


def skip_reason(nonfinite: bool, norms: list[float], max_norm_ratio: float) -> str | None:
    if nonfinite:
        return "non-finite pseudogradient"
    for k, norm in enumerate(norms):
        others = [n for j, n in enumerate(norms) if j != k]
        if others and norm > max_norm_ratio * max(statistics.median(others), 1e-12):
            return f"worker {k} pseudogradient norm {norm:.3g} is over {max_norm_ratio}x its peers'"
    return None


def ballot(nonfinite: bool, sq_norm: float) -> torch.Tensor:
    """One rank's share of its worker's ballot (float64; summed over the worker's ranks, then sent
    as bytes)."""
    return torch.tensor([float(nonfinite), sq_norm], dtype=torch.float64)


def count(ballots: list[torch.Tensor], max_norm_ratio: float) -> tuple[list[float], str | None]:
    """(every worker's pseudogradient norm, the reason to skip or None) from the K workers' ballots
    (as received: uint8 bytes, in worker order)."""
    rows = [b.cpu().clone().view(torch.float64).tolist() for b in ballots]  # clone: aligned
    norms = [math.sqrt(sq) if math.isfinite(sq) else math.inf for _, sq in rows]
    return norms, skip_reason(any(flag > 0 for flag, _ in rows), norms, max_norm_ratio)
