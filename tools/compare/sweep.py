"""Running the protocol: rounds of three phases (tools/compare/protocol.py), each phase's tasks
concurrently, at most `jobs` launches at a time:
1. selection, one task per method;
2. test seeds, one task per method, with the seeds each needs (3; 5 for the methods of a claim that is
   inconclusive on the first 3, decided at the start of the round from the records);
3. alignment, one task per DP baseline and seed: its branches (tools/compare/alignment.py) at the
   selected lr, and on the first `control_seeds` test seeds also at 0.5x and 2x, after rerunning the
   DP run with checkpoints if its start states are gone.
A round that launches nothing ends the protocol; so does a spent budget (`max_runs` launches or
`deadline_s` seconds this sitting). Every finished run is recorded at once; a failed launch ends its
task for the sitting."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from tools.compare import alignment
from tools.compare.claims import claims, undecided
from tools.compare.launch import Data, launch, read_curves, run_config, trainer_flags
from tools.compare.protocol import (REPO, Launch, Method, RunSpec, Selection, Settings, seed_launch, selection,
                                    selection_launch)
from tools.compare.records import AlignmentRecord, BranchKey, RecordFile, RunRecord
from tools.compare.stats import alignment_stats, alignment_summaries, loss_stats, losses, selected


@dataclass
class Budget:
    """Launch slots of one sitting."""
    jobs: int
    max_runs: int | None = None
    deadline_s: float | None = None
    started: int = 0
    _start: float = field(default_factory=time.monotonic)
    _slots: threading.Semaphore = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self._slots = threading.Semaphore(self.jobs)

    @property
    def exhausted(self) -> bool:
        over_time = self.deadline_s is not None and time.monotonic() - self._start >= self.deadline_s
        return over_time or (self.max_runs is not None and self.started >= self.max_runs)

    @contextmanager
    def slot(self):
        """Yields whether a launch may start (False once the sitting's budget is spent)."""
        with self._slots:
            with self._lock:
                allowed = not self.exhausted
                self.started += allowed
            yield allowed


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


@dataclass(frozen=True)
class Context:
    corpus: str
    settings: Settings
    data: Data
    work: Path  # run directories (gitignored)
    runs: RecordFile
    alignments: RecordFile


class Progress:
    """The records so far, shared by the tasks' threads (read and extended under `lock`)."""

    def __init__(self, runs: dict, alignments: dict):
        self.runs, self.alignments = runs, alignments
        self.lock = threading.Lock()

    def add(self, record: RunRecord | AlignmentRecord, ctx: Context) -> None:
        if isinstance(record, AlignmentRecord):
            ctx.alignments.append(record)
            with self.lock:
                self.alignments[record.key] = record
            return
        ctx.runs.append(record)
        with self.lock:
            previous = self.runs.get(record.key)
            if previous is not None and previous.final_val_loss != record.final_val_loss:
                # A DP run repeated for its start states reproduces its record bit for bit on one CPU;
                # on another machine Muon's within ~3e-6, AdamW's within ~0.01 (it amplifies last-bit
                # differences). The new run's start states are the ones used.
                print(f"warning: {record.key.name} reran to val loss {record.final_val_loss:.6f}, recorded "
                      f"{previous.final_val_loss:.6f} (not deterministic here?)", file=sys.stderr, flush=True)
            self.runs[record.key] = record


def start_root(ctx: Context, dp_run_name: str) -> Path:
    return ctx.work / dp_run_name / "ckpt"


def execute_run(method: Method, job: Launch, ctx: Context) -> RunRecord:
    spec, settings = job.spec, ctx.settings
    run_dir = ctx.work / spec.name
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted earlier attempt
    flags = trainer_flags(spec, settings, ctx.data, method.workers, run_dir, eval_interval=settings.sync_interval)
    if job.start_states:
        flags += alignment.start_state_flags(settings, start_root(ctx, spec.name))
    start = time.time()
    print(f"[{ctx.corpus}] run {spec.name} (K={method.workers}{', start states' if job.start_states else ''})",
          flush=True)
    launch(run_config(method, settings, spec.outer_lr), flags, method.workers, run_dir, settings.run_timeout_s)
    seconds = time.time() - start
    if job.start_states:
        alignment.keep_only(start_root(ctx, spec.name), alignment.start_steps(settings))
    curves = read_curves(run_dir, method.workers)
    return RunRecord(ctx.corpus, ctx.data.sha256, spec.method, spec.inner_lr, spec.outer_lr, spec.seed, settings.protocol(),
                     method.config_sha256, curves.val[-1][1], curves.val, curves.sent, curves.worker_cosine,
                     round(seconds, 1), commit())


def execute_branch(method: Method, chosen: Selection, key: BranchKey, ctx: Context, dp_run: str) -> AlignmentRecord:
    spec = branch_spec(chosen, key)
    start = time.time()
    print(f"[{ctx.corpus}] alignment {key.name} (K={method.workers}, lr {spec.inner_lr:g}, from {dp_run})", flush=True)
    result = alignment.measure(method, spec, ctx.settings, ctx.data, start_root(ctx, dp_run), key.start_step,
                               ctx.work / "alignment" / key.name).alignment
    return AlignmentRecord(ctx.corpus, ctx.data.sha256, key.method, key.lr_multiplier, key.seed, key.start_step, spec.inner_lr, dp_run,
                           ctx.settings.protocol(), method.config_sha256, result.cosine, result.norm_ratio,
                           result.matrix_cosines, round(time.time() - start, 1), commit())


def branch_spec(chosen: Selection, key: BranchKey) -> RunSpec:
    """The branch's run: the selected setting at the multiplied inner lr, on the branch's seed."""
    return replace(chosen.spec, inner_lr=chosen.spec.inner_lr * key.lr_multiplier, seed=key.seed)


Job = Callable[[], RunRecord | AlignmentRecord]
Task = Callable[[], Job | None]  # the task's next job given the records so far, None when it is done


def wanted_seeds(methods: list[Method], settings: Settings, progress: Progress) -> tuple[dict[str, tuple], tuple]:
    """Test seeds per method, and for the alignment: the first test seeds, plus the more_test_seeds
    where a claim is inconclusive on the first ones."""
    first = settings.test_seeds
    with progress.lock:
        runs, aligned = dict(progress.runs), dict(progress.alignments)
    summaries = alignment_summaries(aligned, alignment.start_steps(settings), seeds=first)
    on_first = claims(loss_stats(selected(methods, settings, runs), runs, first), alignment_stats(summaries),
                      tuple(m.name for m in methods))
    pending = undecided(on_first)
    more = {n for c in pending if not c.on_alignment for n in c.needs}
    extra = settings.more_test_seeds
    return ({m.name: first + (extra if m.name in more else ()) for m in methods},
            first + (extra if any(c.on_alignment for c in pending) else ()))


def _selection_tasks(methods: list[Method], ctx: Context, progress: Progress) -> dict[str, Task]:
    def task(method: Method) -> Task:
        def next_job() -> Job | None:
            job = selection_launch(method, ctx.settings, losses(progress.runs))
            return None if job is None else lambda: execute_run(method, job, ctx)
        return next_job
    return {m.name: task(m) for m in methods}


def _seed_tasks(methods: list[Method], ctx: Context, progress: Progress) -> dict[str, Task]:
    seeds, aligned_seeds = wanted_seeds(methods, ctx.settings, progress)

    def task(method: Method) -> Task:
        keeps_states = ctx.settings.alignment and method.spec.workers is None  # the alignment's start states

        def next_job() -> Job | None:
            job = seed_launch(method, ctx.settings, losses(progress.runs), seeds[method.name],
                              aligned_seeds if keeps_states else ())
            return None if job is None else lambda: execute_run(method, job, ctx)
        return next_job
    return {m.name: task(m) for m in methods}


def _alignment_tasks(methods: list[Method], ctx: Context, progress: Progress) -> dict[str, Task]:
    if not ctx.settings.alignment:
        return {}
    _, seeds = wanted_seeds(methods, ctx.settings, progress)
    steps = alignment.start_steps(ctx.settings)
    tasks = {}
    for dp in [m for m in methods if m.spec.workers is None]:
        family = [m for m in methods if m.spec.start_method == dp.name and m.workers > 1 and m.spec.compression is None]
        for seed in seeds:
            tasks[f"{dp.name}_s{seed}"] = _alignment_task(dp, family, seed, steps, ctx, progress)
    return tasks


def _alignment_task(dp: Method, family: list[Method], seed: int, steps: tuple[int, ...], ctx: Context,
                    progress: Progress) -> Task:
    def next_job() -> Job | None:
        by_spec = losses(progress.runs)
        dp_chosen = selection(dp, ctx.settings, by_spec)
        chosen = {m.name: c for m in family if (c := selection(m, ctx.settings, by_spec)) is not None}
        if dp_chosen is None or not chosen:
            return None
        dp_spec = replace(dp_chosen.spec, seed=seed)
        controls = seed in ctx.settings.test_seeds[:ctx.settings.control_seeds]
        todo = [(m, BranchKey(m.name, x, seed, step)) for m in family if m.name in chosen
                for x in (alignment.LR_MULTIPLIERS if controls else (1.0,)) for step in steps]
        todo = [(m, key) for m, key in todo if key not in progress.alignments]
        root = start_root(ctx, dp_spec.name)
        if not todo:
            if len(chosen) == len(family):  # every branch from these states is measured
                shutil.rmtree(root, ignore_errors=True)
            return None
        if not alignment.has_start_states(root, steps):
            return lambda: execute_run(dp, Launch(dp_spec, start_states=True), ctx)
        method, key = todo[0]
        return lambda: execute_branch(method, chosen[method.name], key, ctx, dp_spec.name)
    return next_job


def _run_phase(tasks: dict[str, Task], ctx: Context, progress: Progress, budget: Budget, failed: set[str],
               failures: list[str]) -> int:
    """Every task's jobs until it is done, fails or the budget is spent; returns the launches made."""
    launched = [0]

    def work(name: str, next_job: Task) -> None:
        while True:
            with progress.lock:
                job = next_job()
            if job is None:
                return
            with budget.slot() as allowed:
                if not allowed:
                    return
                try:
                    record = job()
                except Exception as err:  # a failed launch, or a checkpoint the alignment cannot read
                    message = f"{name}: {type(err).__name__}: {err}"
                    print(message, file=sys.stderr, flush=True)
                    with progress.lock:
                        failures.append(message)
                        failed.add(name)
                    return
            progress.add(record, ctx)
            with progress.lock:
                launched[0] += 1

    # Daemons: an interrupted tool ends its launches (launch.end_live_launches) and exits without them.
    threads = [threading.Thread(target=work, args=item, name=item[0], daemon=True)
               for item in tasks.items() if item[0] not in failed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return launched[0]


def run_protocol(methods: list[Method], ctx: Context, progress: Progress, budget: Budget) -> list[str]:
    """Advance the protocol as far as the budget allows; `progress` gains the new records. Returns the
    failures."""
    failures: list[str] = []
    failed: set[str] = set()
    while not budget.exhausted:
        launched = sum(_run_phase(phase(methods, ctx, progress), ctx, progress, budget, failed, failures)
                       for phase in (_selection_tasks, _seed_tasks, _alignment_tasks))
        if launched == 0:
            break
    return failures
