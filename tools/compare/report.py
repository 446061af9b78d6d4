"""The report from the record alone: per corpus summary.csv, settings.json, plots and a results
section with the claims' verdicts (tools/compare/verdicts.py); the README's results section is
regenerated between its markers."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path

from tools.compare.protocol import (LR_GRIDS, LR_STEP, MAX_EXTENSIONS, OUTER_LR_NEIGHBOUR, Method, Settings,
                                    best_spec)
from tools.compare.records import RunRecord
from tools.compare.verdicts import (CONFIDENCE, FAILS, HOLDS, INCONCLUSIVE, LOSSLESS_TOLERANCE, MIN_SEEDS, NOT_RUN,
                                    Stat, all_of, at_most, less, smaller_increase, within)

# The paper's 150M column (arXiv 2505.23725) for the methods it reports; K=16 there, not K=4.
PAPER_150M = {"dp_adamw": 3.158, "dp_muon": 3.124, "muloco_k1": 3.120, "diloco_k1": 3.142}
BEGIN, END = "<!-- results:begin (tools/compare_methods.py writes this section) -->", "<!-- results:end -->"
SUMMARY_BEGIN = "<!-- compare-verdicts:begin (tools/compare_methods.py writes this table) -->"
SUMMARY_END = "<!-- compare-verdicts:end -->"
KS = (1, 2, 4)


@dataclass(frozen=True)
class Summary:
    method: str
    workers: int
    inner: str
    compression: str
    inner_lr: float
    outer: str
    val_loss: Stat
    mb_sent_per_worker: float
    worker_cosine: float | None
    alignment: Stat | None
    lr_at_edge: bool  # the best lr is still at an edge of the lrs tried (after the extensions)
    paper_150m: float | None

    COLUMNS = ("method", "workers", "inner", "compression", "inner_lr", "outer", "val_loss_mean", "val_loss_std",
               "seeds", "mb_sent_per_worker", "worker_cosine", "alignment_mean", "alignment_std",
               "alignment_seeds", "lr_at_edge", "paper_150m")

    def row(self) -> list:
        a = self.alignment
        return [self.method, self.workers, self.inner, self.compression, self.inner_lr, self.outer,
                f"{self.val_loss.mean:.4f}", f"{self.val_loss.std:.4f}", self.val_loss.n, f"{self.mb_sent_per_worker:.3f}",
                "" if self.worker_cosine is None else f"{self.worker_cosine:.4f}",
                "" if a is None else f"{a.mean:.4f}", "" if a is None else f"{a.std:.4f}", 0 if a is None else a.n,
                self.lr_at_edge, "" if self.paper_150m is None else self.paper_150m]


def summarize(method: Method, settings: Settings, records: dict) -> Summary | None:
    """The best setting of `method` on the first seed, over every seed run with it."""
    mine = {s: r for s, r in records.items() if s.method == method.name}
    best = best_spec(method, settings, {s: r.final_val_loss for s, r in mine.items()})
    if best is None:
        return None
    runs = [r for s, r in sorted(mine.items(), key=lambda kv: kv[0].seed)
            if (s.inner_lr, s.outer_lr) == (best.inner_lr, best.outer_lr)]
    tried = sorted({s.inner_lr for s in mine if s.seed == best.seed and s.outer_lr == best.outer_lr})
    aligned = {r.seed: r.alignment.mean for r in runs if r.alignment is not None}
    cosines = [r.worker_cosine for r in runs if r.worker_cosine is not None]
    return Summary(method.name, method.workers, method.optimizer, method.compression, best.inner_lr,
                   "-" if best.outer_lr is None else f"{best.outer_lr:g}/{method.outer[1]:g}",
                   Stat({r.seed: r.final_val_loss for r in runs}), sum(r.bytes_per_worker for r in runs) / len(runs) / 1e6,
                   sum(cosines) / len(cosines) if cosines else None, Stat(aligned) if aligned else None,
                   len(tried) > 1 and best.inner_lr in (tried[0], tried[-1]), PAPER_150M.get(method.name))


@dataclass(frozen=True)
class Claim:
    key: str
    text: str
    paper: str
    ours: str
    verdict: str
    needs: tuple[str, ...]  # the methods it compares: a corpus that ran fewer has NOT_RUN


def claims(s: dict[str, Summary]) -> list[Claim]:
    def loss(name: str) -> Stat | None:
        return s[name].val_loss if name in s else None

    def align(name: str) -> Stat | None:
        return s[name].alignment if name in s else None

    def show(*names: str, of=loss) -> str:
        return "; ".join(f"{n} {of(n) if of(n) is not None else 'not run'}" for n in names)

    def delta(base: str, other: str) -> str:
        if loss(base) is None or loss(other) is None:
            return "n/a"
        return f"{loss(other).mean - loss(base).mean:+.4f}"

    def compared(ks: tuple[int, ...]) -> list[int]:
        """The Ks at which both methods ran (a corpus may run a subset); all of them when neither did."""
        return [k for k in ks if f"muloco_k{k}" in s and f"diloco_k{k}" in s] or list(ks)

    def pairs(ks: list[int]) -> tuple[str, ...]:
        return tuple(f"{m}_k{k}" for k in ks for m in ("muloco", "diloco"))

    degradation = {m: delta(f"{m}_k1", f"{m}_k4") for m in ("muloco", "diloco")}
    beats, aligned = compared(KS), compared(KS[1:])
    rows = [
        Claim("a", "MuLoCo K=1 ≤ DP Muon < DP AdamW",
              "150M: MuLoCo K=1 3.120, DP Muon 3.124, DP AdamW 3.158",
              show("muloco_k1", "dp_muon", "dp_adamw"),
              all_of([at_most(loss("muloco_k1"), loss("dp_muon")), less(loss("dp_muon"), loss("dp_adamw"))]),
              ("muloco_k1", "dp_muon", "dp_adamw")),
        Claim("b", "MuLoCo beats DiLoCo at every K",
              "150M: K=1 MuLoCo 3.120 vs DiLoCo 3.142; K=16 MuLoCo 3.222 vs DiLoCo 3.326",
              show(*pairs(beats)),
              all_of([less(loss(f"muloco_k{k}"), loss(f"diloco_k{k}")) for k in beats]), pairs(beats)),
        Claim("c", "MuLoCo degrades less from K=1 to K=4 than DiLoCo",
              "150M K=1 → K=16: MuLoCo +0.102 (3.120 → 3.222), DiLoCo +0.184 (3.142 → 3.326)",
              f"K=1 → K=4: MuLoCo {degradation['muloco']}, DiLoCo {degradation['diloco']}",
              smaller_increase(loss("muloco_k1"), loss("muloco_k4"), loss("diloco_k1"), loss("diloco_k4")),
              ("muloco_k1", "muloco_k4", "diloco_k1", "diloco_k4")),
        Claim("d1", f"4-bit statistical is effectively lossless (within {LOSSLESS_TOLERANCE:.0%})",
              "qualitative: 4-bit quantization matches the uncompressed loss",
              f"MuLoCo {delta('muloco_k4', 'muloco_k4_stat4')}, DiLoCo {delta('diloco_k4', 'diloco_k4_stat4')} "
              "vs uncompressed K=4",
              all_of([within(loss("muloco_k4_stat4"), loss("muloco_k4")),
                      within(loss("diloco_k4_stat4"), loss("diloco_k4"))]),
              ("muloco_k4_stat4", "muloco_k4", "diloco_k4_stat4", "diloco_k4")),
        Claim("d2", f"2-bit statistical + EF works (MuLoCo, within {LOSSLESS_TOLERANCE:.0%})",
              "qualitative: 2-bit statistical quantization with error feedback stays close to uncompressed",
              f"MuLoCo {delta('muloco_k4', 'muloco_k4_stat2ef')} vs uncompressed K=4",
              within(loss("muloco_k4_stat2ef"), loss("muloco_k4")), ("muloco_k4_stat2ef", "muloco_k4")),
        Claim("d3", "2-bit linear + EF degrades (worse than 2-bit statistical + EF, MuLoCo)",
              "qualitative: 2-bit linear quantization degrades the loss",
              f"linear − statistical: {delta('muloco_k4_stat2ef', 'muloco_k4_lin2ef')}",
              less(loss("muloco_k4_stat2ef"), loss("muloco_k4_lin2ef")), ("muloco_k4_stat2ef", "muloco_k4_lin2ef")),
        Claim("e", "MuLoCo's pseudogradients are better aligned with the K=1 pseudogradient (K=2, 4)",
              "Fig. 4: higher cosine with the K=1 pseudogradient for MuLoCo than DiLoCo",
              show(*pairs(aligned), of=align),
              all_of([less(align(f"diloco_k{k}"), align(f"muloco_k{k}")) for k in aligned]), pairs(aligned)),
    ]
    # A claim whose methods this corpus did not run says so, and does not count across corpora.
    return [c if all(n in s for n in c.needs) else replace(c, ours="-", verdict=NOT_RUN) for c in rows]


RULE = (f"Verdict rule: every method runs the same seeds, and a seed fixes the initial weights, the data "
        f"order and the validation sample, so each test is paired: over the seeds both sides ran, the "
        f"per-seed margin in the claim's direction (for a < b: b − a; for 'within "
        f"{LOSSLESS_TOLERANCE:.0%}': 1% of the uncompressed loss minus the excess; for the degradation claim: "
        f"the difference of the two methods' K=4 − K=1 increases) and its {CONFIDENCE:.0%} Student-t "
        f"interval. A claim **holds** when the interval lies above 0 and **does not hold** when it lies "
        f"below 0; a ≤ b does not hold only when b < a holds. Everything else is **inconclusive**, and so "
        f"is any test with fewer than {MIN_SEEDS} common seeds. A claim of several parts holds when all "
        f"hold and does not hold when one does not; a corpus that did not run a claim's methods shows "
        f"**not run**, and the verdict across corpora is over those that did. The ± columns are the spread "
        f"over seeds, which the pairing removes from the tests.")


def _plot(summaries: dict[str, Summary], out: Path, corpus: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, ax, name: str, **labels) -> None:
        ax.set(**labels)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("muloco", "diloco"):
        points = [(k, summaries[f"{m}_k{k}"].val_loss) for k in KS if f"{m}_k{k}" in summaries]
        if points:
            ax.errorbar([k for k, _ in points], [s.mean for _, s in points], yerr=[s.std for _, s in points],
                        marker="o", capsize=3, label=m)
    for dp in ("dp_muon", "dp_adamw"):
        if dp in summaries:
            ax.axhline(summaries[dp].val_loss.mean, linestyle=":", color="grey" if dp == "dp_adamw" else "black",
                       label=f"{dp} (K=1)")
    ax.set_xticks(KS)
    save(fig, ax, "val_loss_vs_K.png", xlabel="workers K", ylabel="final val loss (mean ± std over seeds)",
         title=f"{corpus}: val loss vs K")

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries.values():
        if s.workers > 1:
            ax.errorbar([s.mb_sent_per_worker], [s.val_loss.mean], yerr=[s.val_loss.std], marker="o" if
                        s.inner == "muon" else "s", capsize=3, label=s.method)
    save(fig, ax, "val_loss_vs_bytes.png", xscale="log", xlabel="MB sent per worker over the run",
         ylabel="final val loss (mean ± std)", title=f"{corpus}: val loss vs bytes (K > 1)")

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("muloco", "diloco"):
        points = [(k, summaries[f"{m}_k{k}"].alignment) for k in KS[1:]
                  if f"{m}_k{k}" in summaries and summaries[f"{m}_k{k}"].alignment is not None]
        if points:
            ax.errorbar([1] + [k for k, _ in points], [1.0] + [a.mean for _, a in points],
                        yerr=[0.0] + [a.std for _, a in points], marker="o", capsize=3, label=m)
    ax.set_xticks(KS)
    save(fig, ax, "alignment_vs_K.png", xlabel="workers K (K=1: 1 by construction)",
         ylabel="cos(averaged, full-batch pseudogradient)", title=f"{corpus}: alignment with K=1")
    return written


def _summary_table(summaries: list[Summary]) -> str:
    lines = ["| method | K | inner | compression | inner lr | outer lr/mom | final val loss (mean ± std, n) | "
             "MB sent per worker | alignment with K=1 (mean ± std, n) | paper 150M |", "|" + "---|" * 10]
    for s in sorted(summaries, key=lambda s: s.val_loss.mean):
        edge = " (edge)" if s.lr_at_edge else ""
        lines.append(f"| {s.method} | {s.workers} | {s.inner} | {s.compression} | {s.inner_lr:g}{edge} | {s.outer} | "
                     f"{s.val_loss} | {s.mb_sent_per_worker:.2f} | {s.alignment if s.alignment else '-'} | "
                     f"{'-' if s.paper_150m is None else f'{s.paper_150m:.3f}'} |")
    return "\n".join(lines)


def _claims_table(rows: list[Claim]) -> str:
    lines = ["| claim | paper | ours | verdict |", "|---|---|---|---|"]
    lines += [f"| ({c.key}) {c.text} | {c.paper} | {c.ours} | {c.verdict} |" for c in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class CorpusReport:
    corpus: str
    summaries: list[Summary]
    claims: list[Claim]
    runs: int
    markdown: str


def write_corpus(corpus: str, methods: list[Method], settings: Settings, records: dict[object, RunRecord],
                 out: Path, failures: list[str]) -> CorpusReport:
    out.mkdir(parents=True, exist_ok=True)
    summaries = [s for m in methods if (s := summarize(m, settings, records)) is not None]
    by_name = {s.method: s for s in summaries}
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["corpus", *Summary.COLUMNS])
        w.writerows([corpus, *s.row()] for s in summaries)
    seconds = sum(r.seconds for r in records.values())
    (out / "settings.json").write_text(json.dumps(
        {"corpus": corpus, **settings.protocol(), "seeds": list(settings.seeds), "methods": list(settings.methods),
         "lr_grid_size": settings.lr_grid_size, "lr_grids": LR_GRIDS, "lr_extension_step": LR_STEP,
         "max_lr_extensions": MAX_EXTENSIONS, "outer_neighbours": settings.outer_neighbours,
         "outer_lr_neighbour": OUTER_LR_NEIGHBOUR, "alignment": settings.alignment, "runs": len(records),
         "run_seconds_total": round(seconds), "failures": failures}, indent=2) + "\n")
    rows = claims(by_name)
    plots = _plot(by_name, out, corpus) if summaries else []
    markdown = "\n\n".join([
        f"### {corpus}",
        f"{len(records)} runs recorded in `{corpus}/runs.jsonl` ({seconds / 3600:.1f} h of launches), "
        f"{settings.steps} steps, H={settings.sync_interval}. Best setting per method on seed "
        f"{settings.seeds[0]}, mean ± std over the seeds run with it; '(edge)' marks a best lr still at the edge "
        f"of the lrs tried.",
        _summary_table(summaries) if summaries else "No runs recorded yet.",
        _claims_table(rows),
        " ".join(f"![{p}]({corpus}/{p})" for p in plots)])
    return CorpusReport(corpus, summaries, rows, len(records), markdown)


def combined_verdict(verdicts: list[str]) -> str:
    """Across the corpora that ran the claim's methods: holds where it holds on every one, fails
    where it fails on every one that decides it."""
    verdicts = [v for v in verdicts if v != NOT_RUN]
    if not verdicts:
        return NOT_RUN
    decided = [v for v in verdicts if v != INCONCLUSIVE]
    if FAILS in decided:
        return FAILS if all(v == FAILS for v in decided) else "mixed"
    return HOLDS if decided and len(decided) == len(verdicts) else INCONCLUSIVE


def _verdicts_table(reports: list[CorpusReport], evidence: bool) -> str:
    """One row per claim: the paper's numbers, per corpus (our numbers and) the verdict, and the verdict
    across corpora."""
    per_corpus = [f"{r.corpus}: ours | {r.corpus}: verdict" if evidence else r.corpus for r in reports]
    lines = ["| claim | paper | " + " | ".join(per_corpus) + " | verdict |",
             "|" + "---|" * (3 + (2 if evidence else 1) * len(reports))]
    for i, claim in enumerate(reports[0].claims if reports else []):
        row = [r.claims[i] for r in reports]
        lines.append(f"| ({claim.key}) {claim.text} | {claim.paper} | "
                     + " | ".join(f"{c.ours} | {c.verdict}" if evidence else c.verdict for c in row)
                     + f" | {combined_verdict([c.verdict for c in row])} |")
    return "\n".join(lines)


def _replace_section(path: Path, begin: str, end: str, body: str, new_file: str) -> None:
    """Rewrite what stands between the markers (appended with them where they are missing)."""
    section = "\n\n".join([begin, body, end])
    text = path.read_text() if path.exists() else new_file
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def write_readme(readme: Path, reports: list[CorpusReport]) -> None:
    body = "\n\n".join(["## Results", RULE, "### Verdicts (all corpora)", _verdicts_table(reports, evidence=True),
                         *[r.markdown for r in reports]])
    _replace_section(readme, BEGIN, END, body, "# Method comparison at CPU scale\n")


def write_verdict_summary(readme: Path, reports: list[CorpusReport], details: str) -> None:
    """The project README's short form: the verdicts alone, and where the evidence is."""
    runs = ", ".join(f"{r.runs} on {r.corpus}" for r in reports)
    body = "\n\n".join([f"Verdicts of the paper's claims from the committed runs ({runs}; numbers, plots and "
                         f"the paired-seed rule in `{details}`):", _verdicts_table(reports, evidence=False)])
    _replace_section(readme, SUMMARY_BEGIN, SUMMARY_END, body, "")
