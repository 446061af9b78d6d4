"""The paper's claims as paired tests over seeds.

Every method runs the same seeds, and a seed fixes the initial weights, the data order and the
validation sample (Megatron shuffles the valid split with it), so the seed's own effect (most of the spread: the same seed is the best or worst for every method) cancels
in a per-seed difference. Each test therefore takes, over the seeds both sides ran, the per-seed
margin in the claim's direction, and its 95% Student-t interval: mean ± t(n-1) sd/sqrt(n).
- "a < b" (lower is better): margin b - a; holds when the interval lies above 0, does not hold when
  it lies below 0;
- "a <= b": does not hold when b < a holds, and holds otherwise;
- "a within r of b" (effectively lossless / works): margin r b - (a - b);
- "a degrades less than b from K=1 to K=4": margin (b4 - b1) - (a4 - a1);
- anything else is inconclusive, and so is every test with fewer than MIN_SEEDS common seeds. A claim
  made of several tests holds when all hold, does not hold when one does not.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MIN_SEEDS = 3
LOSSLESS_TOLERANCE = 0.01  # "effectively lossless": within 1% of the uncompressed val loss
CONFIDENCE = 0.95
# Two-sided 95% quantiles of Student's t by degrees of freedom; beyond the table the normal's 1.96.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
HOLDS, FAILS, INCONCLUSIVE, NOT_RUN = "holds", "does not hold", "inconclusive", "not run"


def t_quantile(degrees_of_freedom: int) -> float:
    return T_975[degrees_of_freedom - 1] if degrees_of_freedom <= len(T_975) else 1.960


@dataclass(frozen=True)
class Stat:
    """One method's value (final val loss, alignment) per seed."""

    by_seed: dict[int, float]

    @property
    def n(self) -> int:
        return len(self.by_seed)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.by_seed.values())

    @property
    def std(self) -> float:
        return statistics.stdev(self.by_seed.values()) if self.n > 1 else 0.0

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.std:.4f} (n={self.n})"


def _common_seeds(*stats: Stat | None) -> list[int]:
    if any(s is None for s in stats):
        return []
    return sorted(set.intersection(*(set(s.by_seed) for s in stats)))


def _paired(margin, *stats: Stat | None) -> str:
    """HOLDS when the confidence interval of `margin(*values of one seed)` over the seeds every stat
    has lies above 0, FAILS when it lies below 0."""
    seeds = _common_seeds(*stats)
    if len(seeds) < MIN_SEEDS:
        return INCONCLUSIVE
    margins = [margin(*(s.by_seed[seed] for s in stats)) for seed in seeds]
    half_width = t_quantile(len(seeds) - 1) * statistics.stdev(margins) / math.sqrt(len(seeds))
    mean = statistics.fmean(margins)
    if mean - half_width > 0:
        return HOLDS
    return FAILS if mean + half_width < 0 else INCONCLUSIVE


def less(a: Stat | None, b: Stat | None) -> str:
    """a < b (lower is better for losses)."""
    return _paired(lambda x, y: y - x, a, b)


def at_most(a: Stat | None, b: Stat | None) -> str:
    """a <= b: only a clear excess of a over b refutes it."""
    if len(_common_seeds(a, b)) < MIN_SEEDS:
        return INCONCLUSIVE
    return FAILS if less(b, a) == HOLDS else HOLDS


def within(a: Stat | None, b: Stat | None, ratio: float = LOSSLESS_TOLERANCE) -> str:
    """a is no more than `ratio` (relative) worse than b."""
    return _paired(lambda x, y: ratio * y - (x - y), a, b)


def smaller_increase(a1: Stat | None, a4: Stat | None, b1: Stat | None, b4: Stat | None) -> str:
    """(a4 - a1) < (b4 - b1): method a degrades less from K=1 to K=4 than method b."""
    return _paired(lambda x1, x4, y1, y4: (y4 - y1) - (x4 - x1), a1, a4, b1, b4)


def all_of(verdicts: list[str]) -> str:
    if FAILS in verdicts:
        return FAILS
    return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else INCONCLUSIVE
