"""The paper's claims as tests on mean ± std over seeds.

Rule (stated in the README): with SE = sqrt(s_a^2/n_a + s_b^2/n_b),
- "a < b" holds when mean_b - mean_a > Z SE, does not hold when mean_a - mean_b > Z SE;
- "a <= b" does not hold when mean_a - mean_b > Z SE, and holds otherwise;
- "a within r of b" (effectively lossless / works) holds when (mean_a - mean_b) + Z SE < r mean_b, does
  not hold when (mean_a - mean_b) - Z SE > r mean_b;
- a difference of differences (degradation from K=1 to K=4) uses the SE of all four means;
- anything else is inconclusive, and so is every test where a method it needs has fewer than
  MIN_SEEDS seeds. A claim made of several tests holds when all hold, does not hold when one does not.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

Z = 2.0
MIN_SEEDS = 3
LOSSLESS_TOLERANCE = 0.01  # "effectively lossless": within 1% of the uncompressed val loss
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        return cls(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))

    @property
    def sq_se(self) -> float:
        return self.std ** 2 / self.n

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.std:.4f} (n={self.n})"


def _enough(*stats: Stat | None) -> bool:
    return all(s is not None and s.n >= MIN_SEEDS for s in stats)


def _signed(margin: float, se: float) -> str:
    """HOLDS when `margin` (positive = the claim's direction) exceeds Z SE, FAILS below -Z SE."""
    if margin > Z * se:
        return HOLDS
    return FAILS if margin < -Z * se else INCONCLUSIVE


def less(a: Stat | None, b: Stat | None) -> str:
    """a < b (lower is better for losses)."""
    if not _enough(a, b):
        return INCONCLUSIVE
    return _signed(b.mean - a.mean, math.sqrt(a.sq_se + b.sq_se))


def at_most(a: Stat | None, b: Stat | None) -> str:
    """a <= b: only a clear excess of a over b refutes it."""
    return INCONCLUSIVE if not _enough(a, b) else (FAILS if less(b, a) == HOLDS else HOLDS)


def within(a: Stat | None, b: Stat | None, ratio: float = LOSSLESS_TOLERANCE) -> str:
    """a is no more than `ratio` (relative) worse than b."""
    if not _enough(a, b):
        return INCONCLUSIVE
    return _signed(ratio * b.mean - (a.mean - b.mean), math.sqrt(a.sq_se + b.sq_se))


def smaller_increase(a1: Stat | None, a4: Stat | None, b1: Stat | None, b4: Stat | None) -> str:
    """(a4 - a1) < (b4 - b1): method a degrades less from K=1 to K=4 than method b."""
    if not _enough(a1, a4, b1, b4):
        return INCONCLUSIVE
    margin = (b4.mean - b1.mean) - (a4.mean - a1.mean)
    return _signed(margin, math.sqrt(a1.sq_se + a4.sq_se + b1.sq_se + b4.sq_se))


def all_of(verdicts: list[str]) -> str:
    if FAILS in verdicts:
        return FAILS
    return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else INCONCLUSIVE
