"""Per-method results on the test seeds, from the records: the final val loss of the selected
setting, and the alignment (mean cosine over the start steps) at a learning-rate multiplier. The
selection seed never enters them (it chose the setting, so it would favour it)."""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from tools.compare.protocol import Method, RunSpec, Selection, Settings, selection
from tools.compare.records import AlignmentRecord, BranchKey, RunRecord
from tools.compare.verdicts import Stat


def losses(runs: Mapping[RunSpec, RunRecord]) -> dict[RunSpec, float]:
    return {s: r.final_val_loss for s, r in runs.items()}


def selected(methods: list[Method], settings: Settings, runs: Mapping[RunSpec, RunRecord]) -> dict[str, Selection]:
    by_spec = losses(runs)
    return {m.name: chosen for m in methods if (chosen := selection(m, settings, by_spec)) is not None}


def runs_on_test_seeds(chosen: Selection, runs: Mapping[RunSpec, RunRecord]) -> list[RunRecord]:
    """The runs of the selected setting on seeds other than the selection seed, by seed."""
    spec = chosen.spec
    return sorted((r for s, r in runs.items() if (s.method, s.inner_lr, s.outer_lr) ==
                   (spec.method, spec.inner_lr, spec.outer_lr) and s.seed != spec.seed), key=lambda r: r.seed)


def loss_stats(chosen: Mapping[str, Selection], runs: Mapping[RunSpec, RunRecord], seeds=None) -> dict[str, Stat]:
    """Final val loss per test seed (only `seeds`, when given) of each selected setting that has any."""
    stats = {}
    for name, c in chosen.items():
        by_seed = {r.seed: r.final_val_loss for r in runs_on_test_seeds(c, runs) if seeds is None or r.seed in seeds}
        if by_seed:
            stats[name] = Stat(by_seed)
    return stats


@dataclass(frozen=True)
class AlignmentSummary:
    """One method at one lr multiplier, over its measured seeds and start steps."""
    method: str
    lr_multiplier: float
    cosine: Stat  # per seed: mean over the start steps (seeds with every start step measured)
    by_start: dict[int, float]  # start step -> mean cosine over seeds
    norm_ratio: float
    matrix_mean: float  # per-matrix cosines: mean over matrices, averaged over measurements
    matrix_spread: float  # their standard deviation over matrices, averaged over measurements
    matrix_min: float  # the lowest matrix cosine of any measurement


def alignment_summaries(alignments: Mapping[BranchKey, AlignmentRecord], steps: tuple[int, ...],
                        seeds=None) -> dict[tuple[str, float], AlignmentSummary]:
    groups: dict[tuple[str, float], list[AlignmentRecord]] = {}
    for key, record in alignments.items():
        if seeds is None or key.seed in seeds:
            groups.setdefault((key.method, key.lr_multiplier), []).append(record)
    out = {}
    for (method, multiplier), records in sorted(groups.items()):
        per_seed: dict[int, dict[int, float]] = {}
        for r in records:
            per_seed.setdefault(r.seed, {})[r.start_step] = r.cosine
        complete = {seed: statistics.fmean(v.values()) for seed, v in per_seed.items() if set(v) >= set(steps)}
        matrices = [list(r.matrix_cosines.values()) for r in records if r.matrix_cosines]
        out[method, multiplier] = AlignmentSummary(
            method, multiplier, Stat(complete),
            {step: statistics.fmean(r.cosine for r in records if r.start_step == step)
             for step in sorted({r.start_step for r in records})},
            statistics.fmean(r.norm_ratio for r in records),
            statistics.fmean(statistics.fmean(m) for m in matrices) if matrices else float("nan"),
            statistics.fmean(statistics.pstdev(m) for m in matrices) if matrices else float("nan"),
            min(min(m) for m in matrices) if matrices else float("nan"))
    return out


def alignment_stats(summaries: Mapping[tuple[str, float], AlignmentSummary], multiplier: float = 1.0) -> dict[str, Stat]:
    """Per method, the per-seed cosine at `multiplier` x its selected lr (seeds with every start step)."""
    return {m: s.cosine for (m, x), s in summaries.items() if x == multiplier and s.cosine.n}
