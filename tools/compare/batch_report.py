"""The report of the alignment's per-worker-batch sweep (tools/compare/batch_sweep.py), from its
records alone: `alignment_batch.md` (a table per B/K and lr multiplier, and MuLoCo's lead with the two
methods at different multipliers) and `alignment_batch.png` (MuLoCo's lead over DiLoCo against B/K).

Per method and seed, each quantity is the mean over the start steps measured on that seed; the
table shows its mean over seeds with the 95% Student-t interval (tools/compare/verdicts.py Stat), and
each gap is paired: per common seed, then over seeds. The quantities:
- cosine: the averaged K-worker pseudogradient against the K=1 reference's, over the whole model;
- hidden: the mean over the hidden matrices of the same cosine per matrix;
- loss gap: the held-out loss after the average's outer step minus after the K=1 step (lower: the
  average does as well as the K=1 step).
The gaps are MuLoCo's lead: its cosine minus DiLoCo's, and DiLoCo's loss gap minus its own. The lr
pairing grids pair MuLoCo at each of its multipliers with DiLoCo at each of its own: the selected lrs
were chosen at B/K = 2 on final loss, so a lead that changes sign across the grid hangs on the pairing.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tools.compare.records import BatchAlignmentRecord, BatchBranchKey
from tools.compare.verdicts import Stat

Quantity = Callable[[BatchAlignmentRecord], float]
QUANTITIES: dict[str, Quantity] = {
    "cosine": lambda r: r.cosine,
    "hidden": lambda r: statistics.fmean(r.matrix_cosines.values()),
    "loss gap": lambda r: r.loss_after_average - r.loss_after_reference,
}


def per_seed(records: list[BatchAlignmentRecord], quantity: Quantity) -> Stat:
    """Per seed, the mean of `quantity` over that seed's start steps."""
    by_seed: dict[int, list[float]] = {}
    for r in records:
        by_seed.setdefault(r.seed, []).append(quantity(r))
    return Stat({seed: statistics.fmean(values) for seed, values in sorted(by_seed.items())})


def paired(a: Stat, b: Stat) -> Stat:
    """a - b on the seeds both have."""
    return Stat({s: a.by_seed[s] - b.by_seed[s] for s in sorted(set(a.by_seed) & set(b.by_seed))})


def lead(quantity: str, muloco: Stat, diloco: Stat) -> Stat:
    """MuLoCo's lead in `quantity`, paired by seed: its cosine minus DiLoCo's; DiLoCo's loss gap minus its
    own (a lower gap is better)."""
    return paired(diloco, muloco) if quantity == "loss gap" else paired(muloco, diloco)


@dataclass(frozen=True)
class Row:
    """One B/K at one lr multiplier: each method's quantities and MuLoCo's lead in each."""
    per_worker_batch: int
    lr_multiplier: float
    muloco: dict[str, Stat]
    diloco: dict[str, Stat]

    @property
    def lead(self) -> dict[str, Stat]:
        return {name: lead(name, self.muloco[name], self.diloco[name]) for name in QUANTITIES}


Branch = tuple[int, float, str]  # B/K, lr multiplier, method


def by_branch(records: Mapping[BatchBranchKey, BatchAlignmentRecord]) -> dict[Branch, list[BatchAlignmentRecord]]:
    groups: dict[Branch, list[BatchAlignmentRecord]] = {}
    for key, record in records.items():
        groups.setdefault((key.per_worker_batch, key.lr_multiplier, key.method), []).append(record)
    return groups


def rows(records: Mapping[BatchBranchKey, BatchAlignmentRecord], muloco: str, diloco: str) -> list[Row]:
    groups = by_branch(records)
    return [Row(b, x, *({name: per_seed(groups.get((b, x, method), []), q) for name, q in QUANTITIES.items()}
                        for method in (muloco, diloco)))
            for b, x in sorted({(b, x) for b, x, _ in groups})]


def cell(stat: Stat, signed: bool = False) -> str:
    if not stat.n:
        return "-"
    number = "{:+.4f}" if signed else "{:.4f}"
    interval = stat.interval()
    if interval is None:
        return f"{number.format(stat.mean)} (n=1)"
    return f"{number.format(stat.mean)} [{number.format(interval[0])}, {number.format(interval[1])}] (n={stat.n})"


def table(table_rows: list[Row], seq_length: int) -> str:
    lines = ["| B/K (tokens per worker) | lr | MuLoCo cosine | DiLoCo cosine | MuLoCo − DiLoCo | MuLoCo hidden | "
             "DiLoCo hidden | MuLoCo − DiLoCo, hidden | MuLoCo loss gap | DiLoCo loss gap | DiLoCo − MuLoCo, loss gap |",
             "|" + "---|" * 11]
    for r in table_rows:
        m, d, leads = r.muloco, r.diloco, r.lead
        lines.append(f"| {r.per_worker_batch} ({r.per_worker_batch * seq_length:,}) | {r.lr_multiplier:g}x | "
                     f"{cell(m['cosine'])} | {cell(d['cosine'])} | {cell(leads['cosine'], True)} | {cell(m['hidden'])} | "
                     f"{cell(d['hidden'])} | {cell(leads['hidden'], True)} | {cell(m['loss gap'], True)} | "
                     f"{cell(d['loss gap'], True)} | {cell(leads['loss gap'], True)} |")
    return "\n".join(lines)


def pairing_table(records: Mapping[BatchBranchKey, BatchAlignmentRecord], muloco: str, diloco: str,
                  quantity: str) -> str:
    """MuLoCo's lead in `quantity` (a QUANTITIES name) with MuLoCo at each of its lr multipliers (rows) against
    DiLoCo at each of its own (columns), per B/K; empty while a single multiplier is measured."""
    groups = by_branch(records)
    multipliers = sorted({x for _, x, _ in groups})
    if len(multipliers) < 2:
        return ""
    stat = {branch: per_seed(group, QUANTITIES[quantity]) for branch, group in groups.items()}
    empty = Stat({})
    lines = ["| B/K | MuLoCo lr | " + " | ".join(f"DiLoCo {x:g}x" for x in multipliers) + " |",
             "|" + "---|" * (2 + len(multipliers))]
    for b in sorted({b for b, _, _ in groups}):
        for xm in multipliers:
            mine = stat.get((b, xm, muloco), empty)
            if not mine.n:
                continue
            leads = [lead(quantity, mine, stat.get((b, xd, diloco), empty)) for xd in multipliers]
            lines.append(f"| {b} | {xm:g}x | " + " | ".join(cell(lead, True) for lead in leads) + " |")
    return "\n".join(lines)


def plot(table_rows: list[Row], path: Path, corpus: str, workers: int) -> bool:
    """MuLoCo's lead against B/K, one line per lr multiplier; False (and no file) when nothing is measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    titles = {"cosine": "cosine, whole model", "hidden": "cosine, hidden matrices (mean)",
              "loss gap": "held-out loss gap (DiLoCo's − MuLoCo's)"}
    drawn = False
    for ax, (name, title) in zip(axes, titles.items()):
        for x, style in zip(sorted({r.lr_multiplier for r in table_rows}), (":", "-", "--")):
            points = [(r.per_worker_batch, r.lead[name]) for r in table_rows if r.lr_multiplier == x and r.lead[name].n]
            if not points:
                continue
            errors = [[0.0, 0.0] if (i := s.interval()) is None else [s.mean - i[0], i[1] - s.mean] for _, s in points]
            ax.errorbar([b for b, _ in points], [s.mean for _, s in points], yerr=list(zip(*errors)), marker="o",
                        capsize=3, linestyle="-" if x == 1 else style, label=f"{x:g}x selected lr")
            drawn = True
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="sequences per worker B/K", ylabel="MuLoCo's lead", title=title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{corpus}: MuLoCo − DiLoCo at K = {workers} against the per-worker batch (95% intervals over seeds)")
    fig.tight_layout()
    if drawn:
        fig.savefig(path, dpi=120)
    else:
        path.unlink(missing_ok=True)
    plt.close(fig)
    return drawn


def write(out: Path, corpus: str, records: Mapping[BatchBranchKey, BatchAlignmentRecord], planned: int,
          muloco: str, diloco: str, workers: int, seq_length: int, command: str) -> None:
    """`out/alignment_batch.md` and `out/alignment_batch.png` from the records."""
    table_rows = rows(records, muloco, diloco)
    drawn = plot(table_rows, out / "alignment_batch.png", corpus, workers)
    hours = sum(r.seconds for r in records.values()) / 3600
    starts = sorted({k.start_step for k in records})
    held_out = sorted({(k.per_worker_batch, r.held_out_sequences) for k, r in records.items()})
    text = "\n\n".join(filter(None, [
        f"# {corpus}: alignment against the per-worker batch (K = {workers})",
        "Written by `tools/alignment_batch_sweep.py` from `alignment_batch.jsonl` (what each column means: "
        "`tools/compare/batch_report.py`; how it is measured: `tools/compare/batch_sweep.py`).",
        f"{len(records)} of {planned} planned measurements ({hours:.1f} h of launches), from the DP runs' states at "
        f"step {', '.join(map(str, starts)) or '-'}; held-out sequences per B/K: "
        f"{', '.join(f'{b}: {n}' for b, n in held_out) or '-'}. Continue (or rewrite this report) with:",
        f"    {command}",
        table(table_rows, seq_length) if table_rows else "No measurements yet.",
        "![MuLoCo's lead against B/K](alignment_batch.png)" if drawn else "",
        *(f"{title}\n\n{grid}" for title, grid in (
            ("MuLoCo − DiLoCo whole-model cosine by lr pairing (MuLoCo at the row's multiplier of its selected lr, "
             "DiLoCo at the column's):", pairing_table(records, muloco, diloco, "cosine")),
            ("DiLoCo − MuLoCo held-out loss gap by lr pairing:", pairing_table(records, muloco, diloco, "loss gap")))
          if grid)]))
    (out / "alignment_batch.md").write_text(text + "\n")
