"""The paper's method comparison at its recipe, at CPU scale: DP AdamW, DP Muon, DiLoCo and MuLoCo at
K = 1, 2, 4, 8, pseudogradient compression at K = 4 (statistical 4-bit, statistical / linear 2-bit +
error feedback), the paper's alignment measure, on a corpus in Nemotron-CC form.

    python tools/compare_methods.py [--out results/compare] [--corpus DIR] [--jobs 2]
        [--max-runs N] [--deadline-minutes M] [--quick] [--steps N] [--sync-interval H] [--warmup N]
        [--test-seeds 1 2 3] [--more-seeds 4 5] [--methods dp_adamw muloco_k4 ...] [--no-alignment]
        [--control-seeds 1]
        [--report-only] [--work-dir runs/compare]

Each method is a ds_config in configs/compare/ (written from the recipe by
tools/write_compare_configs.py) and runs as the real trainer, one rank per worker, tiny shape with
--arch paper. Protocol (tools/compare/protocol.py): lrs chosen on the selection seed alone (inner,
then outer, grids that extend at an edge), verdicts from the test seeds alone (tools/compare/claims.py);
alignment branches from the DP baselines' states (tools/compare/alignment.py).

Finished work is appended to <out>/<corpus>/runs.jsonl and alignment.jsonl (tools/compare/records.py):
a rerun skips it, so the protocol completes over several sittings (--max-runs / --deadline-minutes end
a sitting cleanly). Run directories live under --work-dir (gitignored). Every invocation ends by
writing the report from the records of every corpus under --out (tools/compare/report.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from tools.compare.launch import end_live_launches, prepare_data
from tools.compare.methods import METHOD_ORDER
from tools.compare.protocol import (CONFIG_DIR, DEFAULT_CORPUS, QUICK, REPO, SECOND_CORPUS_METHODS, Method,
                                    Settings)
from tools.compare.records import AlignmentRecord, RecordFile, RunRecord
from tools.compare.report import CorpusReport, write_corpus, write_readme, write_verdict_summary
from tools.compare.sweep import Budget, Context, Progress, run_protocol

RUNS, ALIGNMENTS = "runs.jsonl", "alignment.jsonl"
DEFAULT_OUT = REPO / "results" / "compare"
PERFORMANCE_DOC = REPO / "docs" / "performance.md"


def config_hashes() -> dict[str, str]:
    return {p.stem: Method.load(p.stem).config_sha256 for p in sorted(CONFIG_DIR.glob("*.json"))}


def _record_files(out: Path, corpus: str) -> tuple[RecordFile, RecordFile]:
    return RecordFile(out / corpus / RUNS, RunRecord), RecordFile(out / corpus / ALIGNMENTS, AlignmentRecord)


def default_methods(corpus: str) -> tuple[str, ...]:
    """Every method on the default corpus; elsewhere the ones whose claims need no compression."""
    return METHOD_ORDER if corpus == DEFAULT_CORPUS.name else SECOND_CORPUS_METHODS


def _recorded_settings(corpus: str, runs: dict) -> Settings:
    """The settings the records were made with, for a report from the records alone: the corpus's
    methods are its default ones and any other it has records of; the test seeds are the defaults
    until records name others (a sweep still selecting has none)."""
    default = Settings(methods=default_methods(corpus))
    if not runs:
        return default
    protocol = next(iter(runs.values())).protocol
    seeds = sorted({s.seed for s in runs} - {protocol["selection_seed"]})
    return Settings(**{k: protocol[k] for k in ("steps", "sync_interval", "warmup", "global_batch", "eval_batches",
                                                "selection_seed")},
                    test_seeds=tuple(seeds[:3]) or default.test_seeds,
                    more_test_seeds=tuple(seeds[3:]) or default.more_test_seeds,
                    methods=tuple(m for m in METHOD_ORDER if m in default.methods or any(s.method == m for s in runs)))


def _report_corpus(out: Path, corpus: str, settings: Settings | None, failures: list[str]) -> CorpusReport:
    runs_file, alignments_file = _record_files(out, corpus)
    protocol, hashes = None if settings is None else settings.protocol(), config_hashes()
    # Every line of both files must share the first run's data; a sitting checked it against the prepared
    # data before it ran.
    runs = runs_file.load(corpus, None, protocol, hashes)
    data_sha256 = next((r.data_sha256 for r in runs.values()), None)
    aligned = alignments_file.load(corpus, data_sha256, protocol, hashes)
    settings = settings or _recorded_settings(corpus, runs)
    methods = [Method.load(m) for m in METHOD_ORDER if m in settings.methods]
    return write_corpus(corpus, methods, settings, runs, aligned, out / corpus, failures)


def report(out: Path, current: str | None, settings: Settings | None, failures: list[str]) -> None:
    """Every corpus's report (the current one with this invocation's settings), then the READMEs."""
    corpora = sorted({p.parent.name for p in out.glob(f"*/{RUNS}")} | {current or DEFAULT_CORPUS.name}
                     | {DEFAULT_CORPUS.name}, key=lambda c: (c != DEFAULT_CORPUS.name, c))
    reports = [_report_corpus(out, c, settings if c == current else None, failures if c == current else [])
               for c in corpora]
    for name in ("summary.csv", "settings.json"):  # the default corpus's, at the top
        shutil.copyfile(out / reports[0].corpus / name, out / name)
    write_readme(out, reports)
    if out.resolve() == DEFAULT_OUT.resolve():  # the committed results: docs/performance.md shows the verdicts
        write_verdict_summary(PERFORMANCE_DOC, out, reports,
                              details=os.path.relpath(DEFAULT_OUT / "README.md", PERFORMANCE_DOC.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "compare")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="a corpus in Nemotron-CC form (DIR/train, DIR/valid); its name is the folder's")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK.steps} steps, H={QUICK.sync_interval}, "
                   f"{QUICK.lr_grid_size} inner lrs on the selection seed only, {len(QUICK.methods)} methods")
    p.add_argument("--steps", type=int)
    p.add_argument("--sync-interval", type=int)
    p.add_argument("--warmup", type=int, help=f"warm-up steps (default {Settings.warmup}; keep it with --steps)")
    p.add_argument("--test-seeds", type=int, nargs="*", help=f"default {' '.join(map(str, Settings.test_seeds))}")
    p.add_argument("--more-seeds", type=int, nargs="*", help="test seeds added where a claim is inconclusive on "
                   f"the test seeds (default {' '.join(map(str, Settings.more_test_seeds))})")
    p.add_argument("--methods", nargs="+", choices=METHOD_ORDER,
                   help="default: all on the default corpus, the uncompressed ones on another")
    p.add_argument("--no-alignment", action="store_true", help="skip the alignment measurement")
    p.add_argument("--control-seeds", type=int, help="test seeds on which the alignment's 0.5x / 2x lr controls run "
                   f"(default {Settings.control_seeds})")
    p.add_argument("--jobs", type=int, default=1, help="launches at a time")
    p.add_argument("--max-runs", type=int, help="start no more than N launches in this sitting")
    p.add_argument("--deadline-minutes", type=float, help="start no launch after M minutes")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing")
    args = p.parse_args(argv)
    if args.report_only:
        report(args.out, None, None, [])
        return 0
    corpus_dir = args.corpus.resolve()
    corpus = corpus_dir.name
    overrides = {"steps": args.steps, "sync_interval": args.sync_interval, "warmup": args.warmup,
                 "test_seeds": None if args.test_seeds is None else tuple(args.test_seeds),
                 "more_test_seeds": None if args.more_seeds is None else tuple(args.more_seeds),
                 "methods": tuple(args.methods) if args.methods else None if args.quick else default_methods(corpus),
                 "alignment": False if args.no_alignment else None, "control_seeds": args.control_seeds}
    try:
        settings = replace(QUICK if args.quick else Settings(), **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    data = prepare_data(corpus_dir, args.work_dir / corpus / "data")
    runs_file, alignments_file = _record_files(args.out, corpus)
    hashes = config_hashes()
    progress = Progress(runs_file.load(corpus, data.sha256, settings.protocol(), hashes),
                        alignments_file.load(corpus, data.sha256, settings.protocol(), hashes))
    work = args.work_dir / corpus / f"steps{settings.steps}_h{settings.sync_interval}_b{settings.global_batch}"
    budget = Budget(args.jobs, args.max_runs, None if args.deadline_minutes is None else args.deadline_minutes * 60)
    ctx = Context(corpus, settings, data, work, runs_file, alignments_file)
    print(f"[{corpus}] methods: {' '.join(settings.methods)}", flush=True)
    try:
        failures = run_protocol([Method.load(m) for m in settings.methods], ctx, progress, budget)
    except KeyboardInterrupt:
        end_live_launches()  # finished work is recorded; the interrupted launches rerun next time
        raise SystemExit(130) from None
    report(args.out, corpus, settings, failures)
    print((args.out / corpus / "summary.csv").read_text())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
