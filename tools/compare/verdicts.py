"""The rules that turn per-seed results into verdicts: paired tests over seeds.

Every method runs the same seeds, and a seed fixes the initial weights, the data order and the
validation sample (Megatron shuffles the valid split with it), so the seed's own effect (most of the
spread: the same seed is the best or worst for every method) cancels in a per-seed difference. Each
test takes, over the seeds every side ran, the per-seed value of a quantity (a difference of
losses, of increases, of cosines) and its 95% Student-t interval, mean ± t(n-1) sd/sqrt(n), and
compares the interval with a bound:
- "a < b" (superiority, lower is better): b - a must lie above 0; it does not hold when it lies below 0;
- "a <= b" (non-inferiority with margin r): a - b must lie below the margin r x b (b's mean over the
  seeds); it does not hold when it lies above the margin;
- otherwise, and with fewer than MIN_SEEDS common seeds, the test is inconclusive. A claim made of
  several tests holds when all hold and does not hold when one does not.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MIN_SEEDS = 3
NON_INFERIORITY_MARGIN = 0.005  # "a <= b": a may exceed b by less than 0.5% of b
LOSSLESS_MARGIN = 0.01  # "effectively lossless": within 1% of the uncompressed val loss
CONFIDENCE = 0.95
# Two-sided 95% quantiles of Student's t by degrees of freedom; beyond the table the normal's 1.96.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
NOT_RUN = "not run"  # the corpus does not run every method the claim compares
PENDING = "pending"  # it does, and some of them have no test-seed result yet


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

    def interval(self) -> tuple[float, float] | None:
        """The mean's 95% Student-t interval over the seeds; None with fewer than two."""
        if self.n < 2:
            return None
        half_width = t_quantile(self.n - 1) * self.std / math.sqrt(self.n)
        return self.mean - half_width, self.mean + half_width

    def on(self, seeds) -> Stat:
        """The values of `seeds` only."""
        return Stat({s: v for s, v in self.by_seed.items() if s in seeds})

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.std:.4f} (n={self.n})"


@dataclass(frozen=True)
class Test:
    """A paired test: `quantity` per common seed, its interval, and the bound it must clear."""
    quantity: str  # what was measured, e.g. "DP AdamW − DP Muon"
    verdict: str
    n: int
    bound: float
    above: bool  # the claim needs the interval above `bound` (else below it)
    mean: float | None = None
    low: float | None = None
    high: float | None = None

    def __str__(self) -> str:
        wanted = f"{'>' if self.above else '<'} {self.bound:+.4f}"
        if self.mean is None:
            return f"{self.quantity}: {self.n} common seeds, {MIN_SEEDS} needed"
        return f"{self.quantity} = {self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}] (n={self.n}; holds if {wanted})"


def common_seeds(*stats: Stat | None) -> list[int]:
    if any(s is None for s in stats):
        return []
    return sorted(set.intersection(*(set(s.by_seed) for s in stats)))


def _test(quantity: str, value, stats: tuple[Stat | None, ...], bound, above: bool) -> Test:
    """`value(*one seed's values)` over the common seeds against `bound` (a number, or a function of
    the stats' means)."""
    seeds = common_seeds(*stats)
    if len(seeds) < MIN_SEEDS:
        return Test(quantity, INCONCLUSIVE, len(seeds), 0.0 if callable(bound) else bound, above)
    values = [value(*(s.by_seed[seed] for s in stats)) for seed in seeds]
    if callable(bound):
        bound = bound(*(statistics.fmean(s.by_seed[seed] for seed in seeds) for s in stats))
    mean = statistics.fmean(values)
    half_width = t_quantile(len(seeds) - 1) * statistics.stdev(values) / math.sqrt(len(seeds))
    low, high = mean - half_width, mean + half_width
    if (low > bound) if above else (high < bound):
        verdict = HOLDS
    elif (high < bound) if above else (low > bound):
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return Test(quantity, verdict, len(seeds), bound, above, mean, low, high)


def less(a: Stat | None, b: Stat | None, quantity: str) -> Test:
    """a < b: `quantity` is b - a, which must lie above 0."""
    return _test(quantity, lambda x, y: y - x, (a, b), 0.0, above=True)


def non_inferior(a: Stat | None, b: Stat | None, quantity: str, margin: float = NON_INFERIORITY_MARGIN) -> Test:
    """a <= b up to `margin` (relative to b): `quantity` is a - b, which must lie below margin x mean(b)."""
    return _test(quantity, lambda x, y: x - y, (a, b), lambda _, mean_b: margin * mean_b, above=False)


def smaller_increase(a1: Stat | None, ak: Stat | None, b1: Stat | None, bk: Stat | None, quantity: str) -> Test:
    """(ak - a1) < (bk - b1): method a degrades less than b from K=1 to K=k; `quantity` is the difference."""
    return _test(quantity, lambda x1, xk, y1, yk: (yk - y1) - (xk - x1), (a1, ak, b1, bk), 0.0, above=True)


def smaller_relative_gap(a: Stat | None, a_base: Stat | None, b: Stat | None, b_base: Stat | None,
                         quantity: str) -> Test:
    """a / a_base < b / b_base: a is closer to its baseline than b to its own, relatively."""
    return _test(quantity, lambda x, x0, y, y0: y / y0 - x / x0, (a, a_base, b, b_base), 0.0, above=True)


def all_of(verdicts: list[str]) -> str:
    if FAILS in verdicts:
        return FAILS
    return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else INCONCLUSIVE
