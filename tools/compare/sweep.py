"""Running the sweeps: each method's sweep is sequential (protocol.next_launch), different methods'
sweeps run concurrently, at most `jobs` launches at a time; a sitting stops starting launches after
`max_runs` of them or `deadline_s` seconds, and every finished run is recorded at once."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.compare import alignment
from tools.compare.launch import Data, launch, read_curves, run_config, trainer_flags
from tools.compare.protocol import REPO, Launch, Method, RunSpec, Settings, next_launch
from tools.compare.records import RecordFile, RunRecord


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


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


@dataclass(frozen=True)
class Context:
    corpus: str
    settings: Settings
    data: Data
    work: Path  # run directories (gitignored)
    records: RecordFile


def execute(method: Method, job: Launch, ctx: Context) -> RunRecord:
    """One launch (and its alignment references), as a record."""
    spec, settings = job.spec, ctx.settings
    run_dir = ctx.work / spec.name
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted earlier attempt
    checkpoints = run_dir / "ckpt"
    flags = trainer_flags(spec, settings, ctx.data, method.workers, run_dir, eval_interval=settings.sync_interval)
    if job.alignment:
        flags += alignment.checkpoint_flags(settings, checkpoints)
    start = time.time()
    print(f"[{ctx.corpus}] run {spec.name} (K={method.workers}{', alignment' if job.alignment else ''})", flush=True)
    launch(run_config(method, settings, spec.outer_lr), flags, method.workers, run_dir, settings.run_timeout_s)
    seconds = time.time() - start
    curves = read_curves(run_dir, method.workers)
    measured = None
    if job.alignment:
        syncs = alignment.alignment_syncs(settings.steps // settings.sync_interval)
        measured = alignment.measure(method, spec, settings, ctx.data, checkpoints, run_dir / "alignment", syncs)
        shutil.rmtree(checkpoints)  # ~35 MB per rank per sync
        shutil.rmtree(run_dir / "alignment")
    return RunRecord(ctx.corpus, spec.method, spec.inner_lr, spec.outer_lr, spec.seed, settings.protocol(),
                     method.config_sha256, curves.val[-1][1], curves.val, curves.sent, curves.worker_cosine,
                     measured, round(seconds, 1), _commit())


def run_sweeps(methods: list[Method], ctx: Context, done: dict[RunSpec, RunRecord], budget: Budget) -> list[str]:
    """Advance every method's sweep as far as the budget allows; `done` gains the new records. Returns
    the failures (a failed launch ends its method's sweep for this sitting)."""
    lock = threading.Lock()
    failures: list[str] = []

    def sweep(method: Method) -> None:
        while True:
            with lock:
                losses = {s: r.final_val_loss for s, r in done.items()}
                aligned = {s for s, r in done.items() if r.alignment is not None}
            job = next_launch(method, ctx.settings, losses, aligned)
            if job is None:
                return
            with budget.slot() as allowed:
                if not allowed:
                    return
                try:
                    record = execute(method, job, ctx)
                except Exception as err:  # a failed launch, or a checkpoint the alignment cannot read
                    message = f"{job.spec.name}: {type(err).__name__}: {err}"
                    print(message, file=sys.stderr, flush=True)
                    with lock:
                        failures.append(message)
                    return
            ctx.records.append(record)
            with lock:
                previous = done.get(record.spec)
                if previous is not None and previous.final_val_loss != record.final_val_loss:
                    # The alignment rerun repeats a recorded run: on CPU it reproduces it bit for bit.
                    print(f"warning: {record.spec.name} reran to val loss {record.final_val_loss:.6f}, recorded "
                          f"{previous.final_val_loss:.6f} (not deterministic here?)", file=sys.stderr, flush=True)
                done[record.spec] = record

    # Daemons: an interrupted tool ends its launches (launch.end_live_launches) and exits without them.
    threads = [threading.Thread(target=sweep, args=(m,), name=m.name, daemon=True) for m in methods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
