"""The alignment's gap against the per-worker batch (issue 44; tools/compare/batch_sweep.py): MuLoCo's
and DiLoCo's K = 8 alignment and held-out loss gap at B/K = 2, 8, 32, 128 sequences, from the
comparison's DP start states, resuming from its records over several sittings.

    python tools/alignment_batch_sweep.py [--corpus corpus/shakespeare] [--out results/compare]
        [--deadline-minutes M] [--per-worker-batches 2 8 32 128] [--seeds 1 2 3]
        [--lr-multipliers 0.5 1 2] [--start-steps 150] [--methods muloco_k8 diloco_k8] [--report-only]
        [--work-dir runs/compare]

It needs the comparison's records (tools/compare_methods.py) for the selected lrs and the DP runs;
it appends to <out>/<corpus>/alignment_batch.jsonl and ends by writing alignment_batch.md and
alignment_batch.png beside it (tools/compare/batch_report.py).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from tools.compare import alignment
from tools.compare.batch_report import write
from tools.compare.batch_sweep import METHODS, PER_WORKER_BATCHES, Plan, run_sweep
from tools.compare.launch import end_live_launches, prepare_data
from tools.compare.protocol import DEFAULT_CORPUS, MODEL, REPO, Method, Settings
from tools.compare.records import AlignmentRecord, BatchAlignmentRecord, RecordFile, RunRecord
from tools.compare.sweep import Budget, Context
from tools.compare_methods import ALIGNMENTS, DEFAULT_OUT, RUNS, config_hashes
from trainer.model.presets import PRESETS

RECORDS = "alignment_batch.jsonl"


def _shown(path: Path) -> str:
    """`path` as the command to rerun names it: relative to the repository where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    settings = Settings()
    starts = alignment.start_steps(settings)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "compare")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--deadline-minutes", type=float, help="start no launch after M minutes")
    p.add_argument("--per-worker-batches", type=int, nargs="+", default=list(PER_WORKER_BATCHES))
    p.add_argument("--seeds", type=int, nargs="+", default=list(settings.test_seeds))
    p.add_argument("--lr-multipliers", type=float, nargs="+", default=list(alignment.LR_MULTIPLIERS))
    p.add_argument("--start-steps", type=int, nargs="+", default=[starts[len(starts) // 2]],
                   help=f"of the comparison's {' '.join(map(str, starts))} (default: the middle one)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="measure only these this sitting (the report shows both)")
    p.add_argument("--report-only", action="store_true", help="write the report from the records; run nothing")
    args = p.parse_args(argv)
    if not set(args.start_steps) <= set(starts):
        raise SystemExit(f"--start-steps must be of {starts}, got {args.start_steps}")
    if settings.selection_seed in args.seeds:
        raise SystemExit(f"the selection seed {settings.selection_seed} chose the lrs: it cannot be measured here")
    plan = Plan(tuple(args.start_steps), methods=tuple(m for m in METHODS if m in args.methods),
                per_worker_batches=tuple(args.per_worker_batches), lr_multipliers=tuple(args.lr_multipliers),
                seeds=tuple(args.seeds))
    corpus_dir = args.corpus.resolve()
    corpus = corpus_dir.name
    hashes = config_hashes()
    runs_file = RecordFile(args.out / corpus / RUNS, RunRecord)
    records = RecordFile(args.out / corpus / RECORDS, BatchAlignmentRecord)
    failures: list[str] = []
    # The comparison's records may carry another digest of the same data (its tokenizer file once held the
    # path it was prepared at); each DP rerun here must reproduce its recorded loss (batch_sweep._start_states).
    runs = runs_file.load(corpus, None, settings.protocol(), hashes)
    if args.report_only:
        done = records.load(corpus, None, settings.protocol(), hashes)
    else:
        data = prepare_data(corpus_dir, args.work_dir / corpus / "data")
        done = records.load(corpus, data.sha256, settings.protocol(), hashes)
        work = args.work_dir / corpus / f"steps{settings.steps}_h{settings.sync_interval}_b{settings.global_batch}"
        # The comparison's work directory and files (its DP reruns here are not recorded again).
        ctx = Context(corpus, settings, data, work, runs_file, RecordFile(args.out / corpus / ALIGNMENTS, AlignmentRecord))
        budget = Budget(1, deadline_s=None if args.deadline_minutes is None else args.deadline_minutes * 60)
        try:
            failures = run_sweep(plan, ctx, runs, done, records, budget)
        except KeyboardInterrupt:
            end_live_launches()  # finished measurements are recorded; the interrupted one reruns next time
            raise SystemExit(130) from None
    command = (f"python tools/alignment_batch_sweep.py --corpus {_shown(args.corpus)} --out {_shown(args.out)}"
               " --per-worker-batches " + " ".join(map(str, plan.per_worker_batches)) + " --seeds "
               + " ".join(map(str, plan.seeds)) + " --lr-multipliers " + " ".join(f"{x:g}" for x in plan.lr_multipliers)
               + " --start-steps " + " ".join(map(str, plan.start_steps)) + " [--deadline-minutes M]")
    write(args.out / corpus, corpus, done, len(replace(plan, methods=METHODS).order()), *METHODS,
          Method.load(METHODS[0]).workers, PRESETS[MODEL].seq_length, command)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
