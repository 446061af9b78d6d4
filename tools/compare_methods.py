"""The paper's method comparison at CPU scale: DP AdamW, DP Muon, DiLoCo and MuLoCo at K = 1, 2, 4,
with pseudogradient compression (statistical 4-bit, statistical / linear 2-bit + error feedback), with
seeds, on a corpus in Nemotron-CC layout, and the paper's alignment measure.

    python tools/compare_methods.py [--out results/compare] [--corpus DIR] [--jobs 2]
        [--max-runs N] [--deadline-minutes M] [--quick] [--steps N] [--sync-interval H] [--warmup N]
        [--seeds 0 1 2] [--methods dp_adamw muloco_k4 ...] [--no-alignment] [--report-only]
        [--work-dir runs/compare]

Each method is a ds_config in configs/compare/ and runs as the real trainer, one rank per worker.
Protocol (tools/compare/protocol.py): B sequences per step for N steps, split over the K workers;
inner lr tuned per method on the first seed over a grid that extends itself while the best lr is at
its edge; one outer-lr neighbour of the paper's tuned point; the best setting rerun with every other
seed; validation loss on the same E*B sequences (for a given seed) after every outer sync; for K > 1
the alignment of the averaged pseudogradient with the one-worker full-batch pseudogradient
(tools/compare/alignment.py).

Finished runs are appended to <out>/<corpus>/runs.jsonl (tools/compare/records.py): a rerun skips
them, so the protocol completes over several sittings (--max-runs / --deadline-minutes end a sitting
cleanly). Run directories live under --work-dir (gitignored). Every invocation ends by writing the
report from the records of every corpus under --out (tools/compare/report.py): per corpus
summary.csv, settings.json and plots, and the results section of <out>/README.md; <out>/summary.csv
and <out>/settings.json are those of the default corpus.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from tools.compare.launch import end_live_launches, prepare_data
from tools.compare.protocol import (CONFIG_DIR, DEFAULT_CORPUS, METHOD_ORDER, QUICK, QUICK_METHODS, REPO, Method,
                                    Settings)
from tools.compare.records import RecordFile
from tools.compare.report import CorpusReport, write_corpus, write_readme, write_verdict_summary
from tools.compare.sweep import Budget, Context, run_sweeps

RECORDS = "runs.jsonl"
DEFAULT_OUT = REPO / "results" / "compare"


def _config_hashes() -> dict[str, str]:
    return {p.stem: Method.load(p.stem).config_sha256 for p in sorted(CONFIG_DIR.glob("*.json"))}


def _recorded_settings(records: dict) -> Settings:
    """The settings a record was made with, for a report from the record alone."""
    protocol = next(iter(records.values())).protocol
    return Settings(**{k: protocol[k] for k in ("steps", "sync_interval", "warmup", "global_batch", "eval_batches")},
                    seeds=tuple(sorted({s.seed for s in records})),
                    methods=tuple(m for m in METHOD_ORDER if any(s.method == m for s in records)))


def _report_corpus(out: Path, corpus: str, settings: Settings | None, failures: list[str]) -> CorpusReport | None:
    records = RecordFile(out / corpus / RECORDS).load(corpus, None if settings is None else settings.protocol(),
                                                      _config_hashes())
    if settings is None:
        if not records:
            return None
        settings = _recorded_settings(records)
    methods = [Method.load(m) for m in METHOD_ORDER if m in settings.methods or any(s.method == m for s in records)]
    return write_corpus(corpus, methods, settings, records, out / corpus, failures)


def report(out: Path, current: str | None, settings: Settings | None, failures: list[str]) -> None:
    """Every corpus's report (the current one with this invocation's settings), then the README."""
    corpora = sorted({p.parent.name for p in out.glob(f"*/{RECORDS}")} | ({current} if current else set()))
    reports = [r for c in corpora if (r := _report_corpus(out, c, settings if c == current else None,
                                                           failures if c == current else [])) is not None]
    primary = next((r for r in reports if r.corpus == DEFAULT_CORPUS.name), reports[0] if reports else None)
    if primary is not None:
        for name in ("summary.csv", "settings.json"):
            shutil.copyfile(out / primary.corpus / name, out / name)
    write_readme(out / "README.md", reports)
    if out.resolve() == DEFAULT_OUT.resolve():  # the committed results: the project README shows the verdicts
        write_verdict_summary(REPO / "README.md", reports, details=str(DEFAULT_OUT.relative_to(REPO) / "README.md"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "compare")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="a corpus in Nemotron-CC layout (DIR/train, DIR/valid); its name is the folder's")
    p.add_argument("--quick", action="store_true", help=f"{QUICK.steps} steps, H={QUICK.sync_interval}, "
                   f"{QUICK.lr_grid_size} lrs, one seed, no outer-lr neighbour or alignment, {len(QUICK_METHODS)} methods")
    p.add_argument("--steps", type=int)
    p.add_argument("--sync-interval", type=int)
    p.add_argument("--warmup", type=int, help=f"warm-up steps (default {Settings.warmup}; keep it with --steps)")
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--methods", nargs="+", choices=METHOD_ORDER)
    p.add_argument("--no-alignment", action="store_true", help="skip the alignment measurement")
    p.add_argument("--jobs", type=int, default=1, help="launches at a time (different methods' sweeps)")
    p.add_argument("--max-runs", type=int, help="start no more than N launches in this sitting")
    p.add_argument("--deadline-minutes", type=float, help="start no launch after M minutes")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing")
    args = p.parse_args(argv)
    corpus_dir = args.corpus.resolve()
    corpus = corpus_dir.name
    if args.report_only:
        report(args.out, None, None, [])
        return 0
    overrides = {"steps": args.steps, "sync_interval": args.sync_interval, "warmup": args.warmup,
                 "seeds": tuple(args.seeds) if args.seeds else None,
                 "methods": tuple(args.methods) if args.methods else None, "alignment": False if args.no_alignment else None}
    try:
        settings = replace(QUICK if args.quick else Settings(), **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    records = RecordFile(args.out / corpus / RECORDS)
    done: dict = records.load(corpus, settings.protocol(), _config_hashes())
    data = prepare_data(corpus_dir, args.work_dir / corpus / "data")
    work = args.work_dir / corpus / f"steps{settings.steps}_h{settings.sync_interval}"
    budget = Budget(args.jobs, args.max_runs, None if args.deadline_minutes is None else args.deadline_minutes * 60)
    ctx = Context(corpus, settings, data, work, records)
    try:
        failures = run_sweeps([Method.load(m) for m in settings.methods], ctx, done, budget)
    except KeyboardInterrupt:
        end_live_launches()  # finished runs are recorded; the interrupted ones rerun next time
        raise SystemExit(130) from None
    report(args.out, corpus, settings, failures)
    print((args.out / corpus / "summary.csv").read_text() if (args.out / corpus / "summary.csv").exists() else "")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
