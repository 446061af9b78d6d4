"""The skip vote: whether an outer sync goes ahead, decided identically on every rank.

Any non-finite pseudogradient anywhere, or a worker whose pseudogradient norm is more than
`max_norm_ratio` times its peers' median, skips the sync for everyone: the workers restart from the
unchanged global weights. One all-reduce over every rank carries each worker's summed squared norm
and non-finite flag.
"""
from __future__ import annotations

import math
import statistics

from trainer.diloco.collectives import Wire


def skip_reason(nonfinite: bool, norms: list[float], max_norm_ratio: float) -> str | None:
    if nonfinite:
        return "non-finite pseudogradient"
    for k, norm in enumerate(norms):
        others = [n for j, n in enumerate(norms) if j != k]
        if others and norm > max_norm_ratio * max(statistics.median(others), 1e-12):
            return f"worker {k} pseudogradient norm {norm:.3g} is over {max_norm_ratio}x its peers'"
    return None


class SkipVote:
    def __init__(self, wire: Wire, worker: int, workers: int, max_norm_ratio: float):
        self.wire, self.worker, self.workers, self.max_norm_ratio = wire, worker, workers, max_norm_ratio

    def __call__(self, nonfinite: bool, sq_norm: float, context: str) -> tuple[list[float], str | None]:
        """(every worker's pseudogradient norm, the reason to skip or None) from this rank's share."""
        sums = self.wire.sum_per_worker([float(nonfinite), sq_norm], self.worker, self.workers, f"skip vote, {context}")
        norms = [math.sqrt(sq) if math.isfinite(sq) else math.inf for _, sq in sums]
        return norms, skip_reason(any(flag > 0 for flag, _ in sums), norms, self.max_norm_ratio)
