"""The report from the records alone: per corpus summary.csv, alignment.csv, settings.json, plots and
a results section with the claims' verdicts (tools/compare/claims.py) and the numbers behind them;
the README's results section and docs/performance.md's verdict table are regenerated between their
markers, beside the first protocol's verdicts (PROTOCOL1_VERDICTS, frozen with its records)."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from tools.compare import alignment
from tools.compare.claims import PAPER_150M, Claim, claims
from tools.compare.methods import KS, METHOD_ORDER
from tools.compare.protocol import LR_GRIDS, MAX_EXTENSIONS, OUTER_LR_GRID, Method, RunSpec, Selection, Settings
from tools.compare.records import AlignmentRecord, BranchKey, RunRecord
from tools.compare.stats import (AlignmentSummary, alignment_stats, alignment_summaries, loss_stats,
                                 runs_on_test_seeds, selected)
from tools.compare.verdicts import (CONFIDENCE, FAILS, HOLDS, INCONCLUSIVE, LOSSLESS_MARGIN, MIN_SEEDS,
                                    NON_INFERIORITY_MARGIN, NOT_RUN, PENDING, Stat)

BEGIN, END = "<!-- results:begin (tools/compare_methods.py writes this section) -->", "<!-- results:end -->"
SUMMARY_BEGIN = "<!-- compare-verdicts:begin (tools/compare_methods.py writes this table) -->"
SUMMARY_END = "<!-- compare-verdicts:end -->"
PROTOCOL1 = "protocol1"  # the first protocol's records, report and frozen verdicts, under the results folder
PROTOCOL1_VERDICTS = f"{PROTOCOL1}/verdicts.json"


@dataclass(frozen=True)
class Summary:
    method: str
    workers: int
    inner: str
    compression: str
    selection: Selection
    outer_momentum: float | None
    val_loss: Stat | None  # on the test seeds
    mb_sent_per_worker: float | None
    paper_150m: float | None

    COLUMNS = ("method", "workers", "inner", "compression", "inner_lr", "inner_lr_at_edge", "outer_lr",
               "outer_momentum", "outer_lr_at_edge", "selection_seed_val_loss", "val_loss_mean", "val_loss_std",
               "test_seeds", "mb_sent_per_worker", "paper_150m")

    def row(self) -> list:
        c, v = self.selection, self.val_loss
        return [self.method, self.workers, self.inner, self.compression, c.spec.inner_lr, c.inner_at_edge,
                "" if c.spec.outer_lr is None else c.spec.outer_lr, "" if self.outer_momentum is None else
                self.outer_momentum, c.outer_at_edge, f"{c.loss:.4f}", "" if v is None else f"{v.mean:.4f}",
                "" if v is None else f"{v.std:.4f}", 0 if v is None else v.n,
                "" if self.mb_sent_per_worker is None else f"{self.mb_sent_per_worker:.3f}",
                "" if self.paper_150m is None else self.paper_150m]


def summaries(methods: list[Method], chosen: dict[str, Selection], runs: dict[RunSpec, RunRecord]) -> list[Summary]:
    stats = loss_stats(chosen, runs)
    out = []
    for m in methods:
        if m.name not in chosen:
            continue
        tested = runs_on_test_seeds(chosen[m.name], runs)
        out.append(Summary(m.name, m.workers, m.optimizer, m.compression, chosen[m.name],
                           m.outer[1] if m.outer else None, stats.get(m.name),
                           sum(r.bytes_per_worker for r in tested) / len(tested) / 1e6 if tested else None,
                           PAPER_150M.get(m.name)))
    return out


RULE = (f"Verdict rule: a setting is chosen on the selection seed alone and every verdict uses only the "
        f"test seeds (at least {MIN_SEEDS}; more where a claim is inconclusive on the first {MIN_SEEDS}), so "
        f"the seed that chose a setting never tests it. A seed fixes the initial weights, the data order and "
        f"the validation sample for every method, so each test is paired: per common test seed the quantity "
        f"shown, and its {CONFIDENCE:.0%} Student-t interval. 'a < b' **holds** when the interval of b − a "
        f"lies above 0 and **does not hold** when it lies below 0. 'a ≤ b' is non-inferiority with a stated "
        f"margin ({NON_INFERIORITY_MARGIN:.1%} of b; {LOSSLESS_MARGIN:.0%} for 'effectively lossless'): it "
        f"holds when the interval of a − b lies below the margin and does not hold when it lies above it. "
        f"Everything else is **inconclusive**, and so is a test with fewer than {MIN_SEEDS} common test "
        f"seeds. A claim of several tests holds when all hold and does not hold when one does not. A corpus "
        f"that does not run a claim's methods shows **not run**, one that has not yet run them on the test "
        f"seeds **pending**; the verdict across corpora is over those that ran them, and says 'so far' while "
        f"another corpus is pending.")


def _plot(table: list[Summary], aligned: dict[tuple[str, float], AlignmentSummary], out: Path, corpus: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {s.method: s for s in table if s.val_loss is not None}
    written = []

    def save(fig, ax, name: str, **labels) -> None:
        if not ax.has_data():  # nothing measured for this plot yet
            plt.close(fig)
            (out / name).unlink(missing_ok=True)
            return
        ax.set(**labels)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("muloco", "diloco"):
        points = [(k, by_name[f"{m}_k{k}"].val_loss) for k in KS if f"{m}_k{k}" in by_name]
        if points:
            ax.errorbar([k for k, _ in points], [s.mean for _, s in points], yerr=[s.std for _, s in points],
                        marker="o", capsize=3, label=m)
    for dp, colour in (("dp_muon", "black"), ("dp_adamw", "grey")):
        if dp in by_name:
            ax.axhline(by_name[dp].val_loss.mean, linestyle=":", color=colour, label=f"{dp} (K=1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(KS, [str(k) for k in KS])
    save(fig, ax, "val_loss_vs_K.png", xlabel="workers K", ylabel="final val loss (test seeds, mean ± std)",
         title=f"{corpus}: val loss vs K")

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in by_name.values():
        if s.workers > 1 and s.mb_sent_per_worker:
            ax.errorbar([s.mb_sent_per_worker], [s.val_loss.mean], yerr=[s.val_loss.std],
                        marker="o" if s.inner == "muon" else "s", capsize=3, label=s.method)
    save(fig, ax, "val_loss_vs_bytes.png", xscale="log", xlabel="MB sent per worker over the run",
         ylabel="final val loss (test seeds, mean ± std)", title=f"{corpus}: val loss vs bytes (K > 1)")

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, colour in (("muloco", "tab:blue"), ("diloco", "tab:orange")):
        for x, style in zip(alignment.LR_MULTIPLIERS, (":", "-", "--")):
            points = [(k, aligned[f"{m}_k{k}", x].cosine) for k in KS[1:]
                      if (f"{m}_k{k}", x) in aligned and aligned[f"{m}_k{k}", x].cosine.n]
            if points:
                ax.errorbar([k for k, _ in points], [a.mean for _, a in points], yerr=[a.std for _, a in points],
                            marker="o", capsize=3, linestyle=style, color=colour, label=f"{m}, {x:g}x lr")
    ax.set_xscale("log", base=2)
    ax.set_xticks(KS[1:], [str(k) for k in KS[1:]])
    save(fig, ax, "alignment_vs_K.png", xlabel="workers K",
         ylabel="cos(averaged, K=1 pseudogradient)", title=f"{corpus}: alignment from shared DP states")
    return written


def _edge(value: str, at_edge: bool) -> str:
    return value + (" (edge)" if at_edge else "")


def _summary_table(table: list[Summary]) -> str:
    lines = ["| method | K | inner | compression | inner lr | outer lr/mom | selection seed | test seeds (mean ± std, n) "
             "| MB sent per worker | paper 150M |", "|" + "---|" * 10]
    for s in sorted(table, key=lambda s: (s.val_loss is None, s.val_loss.mean if s.val_loss else s.selection.loss)):
        c = s.selection
        outer = "-" if c.spec.outer_lr is None else _edge(f"{c.spec.outer_lr:g}", c.outer_at_edge) + f"/{s.outer_momentum:g}"
        lines.append(f"| {s.method} | {s.workers} | {s.inner} | {s.compression} | "
                     f"{_edge(f'{c.spec.inner_lr:g}', c.inner_at_edge)} | {outer} | {c.loss:.4f} | "
                     f"{s.val_loss if s.val_loss else 'not yet'} | "
                     f"{'-' if s.mb_sent_per_worker is None else f'{s.mb_sent_per_worker:.2f}'} | "
                     f"{'-' if s.paper_150m is None else f'{s.paper_150m:.3f}'} |")
    return "\n".join(lines)


def _selection_progress(methods: list[Method], chosen: dict[str, Selection], runs: dict[RunSpec, RunRecord],
                        seed: int) -> str:
    """The selection seed's runs of each method whose setting is not chosen yet: where its sweep stands."""
    lines = []
    for m in methods:
        tried = sorted((s for s in runs if s.method == m.name and s.seed == seed),
                       key=lambda s: (s.outer_lr or 0.0, s.inner_lr))
        if m.name in chosen or not tried:
            continue
        points = ", ".join(f"{s.inner_lr:g}" + ("" if s.outer_lr is None else f"/{s.outer_lr:g}")
                           + f": {runs[s].final_val_loss:.4f}" for s in tried)
        lines.append(f"| {m.name} | {m.workers} | {points} |")
    if not lines:
        return ""
    return "\n".join([f"Selection still under way on seed {seed} (the runs so far; inner lr, or inner/outer lr: final "
                      "val loss):", "", "| method | K | runs |", "|---|---|---|", *lines])


def _alignment_table(aligned: dict[tuple[str, float], AlignmentSummary], lrs: dict[str, float]) -> str:
    lines = ["| method | lr (x selected) | cosine, whole model (per seed: mean over starts; mean ± std, n) | by start "
             "step | norm ratio | per hidden matrix: mean, spread, min |", "|" + "---|" * 6]
    for (method, x), a in sorted(aligned.items(), key=lambda kv: (METHOD_ORDER.index(kv[0][0]), kv[0][1])):
        by_start = ", ".join(f"{step}: {c:.3f}" for step, c in a.by_start.items())
        lr = f"{lrs[method] * x:g} ({x:g}x)" if method in lrs else f"{x:g}x"
        lines.append(f"| {method} | {lr} | {a.cosine if a.cosine.n else '-'} | {by_start} | {a.norm_ratio:.3f} | "
                     f"{a.matrix_mean:.3f}, ±{a.matrix_spread:.3f}, {a.matrix_min:.3f} |")
    return "\n".join(lines)


def _claims_table(rows: list[Claim]) -> str:
    lines = ["| claim | paper | ours (test seeds) | verdict |", "|---|---|---|---|"]
    for c in rows:
        evidence = "-" if c.verdict in (NOT_RUN, PENDING) else "; ".join(str(t) for t in c.tests)
        lines.append(f"| ({c.key}) {c.text} | {c.paper} | {evidence} | {c.verdict} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class CorpusReport:
    corpus: str
    claims: list[Claim]
    runs: int
    measurements: int
    markdown: str


def write_corpus(corpus: str, methods: list[Method], settings: Settings, runs: dict[RunSpec, RunRecord],
                 aligned_records: dict[BranchKey, AlignmentRecord], out: Path, failures: list[str]) -> CorpusReport:
    out.mkdir(parents=True, exist_ok=True)
    chosen = selected(methods, settings, runs)
    table = summaries(methods, chosen, runs)
    aligned = alignment_summaries(aligned_records, alignment.start_steps(settings))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["corpus", *Summary.COLUMNS])
        w.writerows([corpus, *s.row()] for s in table)
    with open(out / "alignment.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["corpus", "method", "lr_multiplier", "cosine_mean", "cosine_std", "seeds", "norm_ratio",
                    "matrix_mean", "matrix_spread", "matrix_min"])
        w.writerows([corpus, a.method, a.lr_multiplier, f"{a.cosine.mean:.4f}" if a.cosine.n else "",
                     f"{a.cosine.std:.4f}" if a.cosine.n else "", a.cosine.n, f"{a.norm_ratio:.4f}",
                     f"{a.matrix_mean:.4f}", f"{a.matrix_spread:.4f}", f"{a.matrix_min:.4f}"] for a in aligned.values())
    seconds = sum(r.seconds for r in runs.values()) + sum(r.seconds for r in aligned_records.values())
    data_sha256 = next((r.data_sha256 for r in runs.values()), None)  # the same on every line (RecordFile.load)
    (out / "settings.json").write_text(json.dumps(
        {"corpus": corpus, "data_sha256": data_sha256, **settings.protocol(), "test_seeds": list(settings.test_seeds),
         "more_test_seeds": list(settings.more_test_seeds), "methods": list(settings.methods),
         "lr_grid_size": settings.lr_grid_size, "lr_grids": {k: g.points for k, g in LR_GRIDS.items()},
         "lr_extension_steps": {k: g.step for k, g in LR_GRIDS.items()}, "outer_lr_grid": OUTER_LR_GRID.points,
         "outer_lr_extension_step": OUTER_LR_GRID.step, "max_lr_extensions": MAX_EXTENSIONS,
         "outer_tuning": settings.outer_tuning, "alignment": settings.alignment, "control_seeds": settings.control_seeds,
         "alignment_start_steps": list(alignment.start_steps(settings)),
         "alignment_lr_multipliers": list(alignment.LR_MULTIPLIERS), "runs": len(runs),
         "alignment_measurements": len(aligned_records), "seconds_total": round(seconds),
         "failures": failures}, indent=2) + "\n")
    rows = claims(loss_stats(chosen, runs), alignment_stats(aligned), tuple(m.name for m in methods))
    plots = _plot(table, aligned, out, corpus)
    lrs = {name: c.spec.inner_lr for name, c in chosen.items()}
    markdown = "\n\n".join(filter(None, [
        f"### {corpus}",
        f"{len(runs)} runs in `{corpus}/runs.jsonl` and {len(aligned_records)} alignment measurements in "
        f"`{corpus}/alignment.jsonl` ({seconds / 3600:.1f} h of launches)"
        f"{f', prepared data sha256 `{data_sha256[:12]}`' if data_sha256 else ''}, {settings.steps} steps, "
        f"H={settings.sync_interval}, B={settings.global_batch}. The setting of each method is chosen on seed "
        f"{settings.selection_seed} (its loss there is shown); the test seeds' mean ± std is what the verdicts use. "
        "'(edge)' marks an lr still at the edge of those tried after the extensions.",
        _summary_table(table) if table else ("" if runs else "No runs recorded yet."),
        _selection_progress(methods, chosen, runs, settings.selection_seed),
        f"Alignment from the DP baselines' states at steps {', '.join(map(str, alignment.start_steps(settings)))}, "
        f"each method at its selected inner lr and at {', '.join(f'{x:g}x' for x in alignment.LR_MULTIPLIERS if x != 1)} "
        "of it (the control):" if aligned else "",
        _alignment_table(aligned, lrs) if aligned else "",
        _claims_table(rows),
        " ".join(f"![{p}]({corpus}/{p})" for p in plots)]))
    return CorpusReport(corpus, rows, len(runs), len(aligned_records), markdown)


def combined_verdict(verdicts: list[str]) -> str:
    """Across the corpora that ran the claim's methods: holds where it holds on every one, fails
    where it fails on every one that decides it; 'so far' while another corpus is pending."""
    planned = [v for v in verdicts if v != NOT_RUN]
    verdicts = [v for v in planned if v != PENDING]
    if not verdicts:
        return PENDING if planned else NOT_RUN
    if len(verdicts) < len(planned):
        return f"{combined_verdict(verdicts)} so far"
    decided = [v for v in verdicts if v != INCONCLUSIVE]
    if FAILS in decided:
        return FAILS if all(v == FAILS for v in decided) else "mixed"
    return HOLDS if decided and len(decided) == len(verdicts) else INCONCLUSIVE


def _first_protocol(out: Path) -> dict[str, dict]:
    path = out / PROTOCOL1_VERDICTS
    return json.loads(path.read_text()) if path.exists() else {}


def _verdicts_table(reports: list[CorpusReport], first: dict[str, dict], first_link: str, evidence: bool) -> str:
    """One row per claim: the paper's numbers, per corpus (our numbers and) the verdict, across corpora,
    and the first protocol's verdict."""
    per_corpus = [f"{r.corpus}: ours | {r.corpus}: verdict" if evidence else r.corpus for r in reports]
    lines = ["| claim | paper | " + " | ".join(per_corpus) + f" | verdict | [first protocol]({first_link}) |",
             "|" + "---|" * (4 + (2 if evidence else 1) * len(reports))]
    for i, claim in enumerate(reports[0].claims if reports else []):
        row = [r.claims[i] for r in reports]
        old = first.get(claim.key)
        before = "-" if old is None else (old["verdict"] if old["claim"] == claim.text else
                                          f"{old['verdict']} ({old['claim']})")
        cells = [f"{'-' if c.verdict in (NOT_RUN, PENDING) else '; '.join(map(str, c.tests))} | {c.verdict}" if evidence
                 else c.verdict for c in row]
        lines.append(f"| ({claim.key}) {claim.text} | {claim.paper} | " + " | ".join(cells)
                     + f" | {combined_verdict([c.verdict for c in row])} | {before} |")
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


def write_readme(out: Path, reports: list[CorpusReport]) -> None:
    first = _first_protocol(out)
    body = "\n\n".join(["## Results", RULE, "### Verdicts (all corpora)",
                        _verdicts_table(reports, first, f"{PROTOCOL1}/README.md", evidence=True),
                        *[r.markdown for r in reports]])
    _replace_section(out / "README.md", BEGIN, END, body, "# Method comparison at CPU scale\n")


def write_verdict_summary(readme: Path, out: Path, reports: list[CorpusReport], details: str) -> None:
    """The project documentation's short form (docs/performance.md): the verdicts alone, where the evidence is, and the first
    protocol's verdicts beside them."""
    done = ", ".join(f"{r.runs} runs and {r.measurements} alignment measurements on {r.corpus}" for r in reports)
    body = "\n\n".join([f"Verdicts of the paper's claims at its recipe ({done or 'no runs yet'}; numbers, plots and "
                        f"the rule in `{details}`; the first protocol, before issue 28, in "
                        f"`{Path(details).parent / PROTOCOL1}/README.md`):",
                        _verdicts_table(reports, _first_protocol(out), f"{Path(details).parent / PROTOCOL1}/README.md",
                                        evidence=False)])
    _replace_section(readme, SUMMARY_BEGIN, SUMMARY_END, body, "")
