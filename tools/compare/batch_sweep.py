"""The alignment against the per-worker batch (issue 44): is (e)'s "does not hold" the noise of the
comparison's tiny per-worker batches? MuLoCo's and DiLoCo's K = 8 branches and their K = 1
references (tools/compare/alignment.py) from the comparison's DP start states, at B/K = 2 (the
protocol's batch), 8, 32 and 128 sequences per worker, each at its selected inner lr and at 0.5x and
2x of it, on the test seeds; each also takes the functional measure (alignment.HeldOutLosses).

The work runs in an order that gives a complete small picture early (`Plan.order`): every B/K at the
selected lr on the first seed, then the other seeds, then the lr controls; each measurement is
recorded at once (`<out>/<corpus>/alignment_batch.jsonl`), so the sweep resumes from its records over
several sittings. A DP run's start states (gitignored, under the comparison's work directory) are made
again where they are gone, and removed once no planned measurement needs them.
"""
from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, replace

from tools.compare import alignment
from tools.compare.protocol import Launch, Method, RunSpec, Selection, Settings
from tools.compare.records import BatchAlignmentRecord, BatchBranchKey, RecordFile, RunRecord
from tools.compare.stats import selected
from tools.compare.sweep import Budget, Context, branch_spec, commit, execute_run, start_root

METHODS = ("muloco_k8", "diloco_k8")
PER_WORKER_BATCHES = (2, 8, 32, 128)
# Validation sequences a functional measure evaluates at least: about shakespeare's whole valid split
# (its ~35k tokens), so the measure's own noise stays below the gaps it compares.
MIN_HELD_OUT = 256


def at_batch(settings: Settings, per_worker_batch: int, workers: int) -> Settings:
    """The protocol at B = K x `per_worker_batch`, evaluating E x B >= MIN_HELD_OUT sequences: the
    K workers' E x K batches of B/K and the reference's E batches of B are the same E x B sequences
    (every worker evaluates the same samples, trainer/data.py validation_indices)."""
    batch = workers * per_worker_batch
    return replace(settings, global_batch=batch, eval_batches=-(-MIN_HELD_OUT // batch))


@dataclass(frozen=True)
class Plan:
    start_steps: tuple[int, ...]  # of alignment.start_steps()
    methods: tuple[str, ...] = METHODS
    per_worker_batches: tuple[int, ...] = PER_WORKER_BATCHES
    lr_multipliers: tuple[float, ...] = alignment.LR_MULTIPLIERS
    seeds: tuple[int, ...] = (1, 2, 3)

    def order(self) -> list[BatchBranchKey]:
        """Every measurement, in the order a sitting runs them: per start step (in the order given),
        the selected lr on the first seed, then on the others, then the lr controls (first seed first);
        within each, B/K from small to large, both methods at each."""
        keys = [BatchBranchKey(m, b, x, s, step) for step in self.start_steps for x in self.lr_multipliers
                for s in self.seeds for b in self.per_worker_batches for m in self.methods]
        return sorted(keys, key=lambda k: (self.start_steps.index(k.start_step), k.lr_multiplier != 1.0,
                                           k.seed != self.seeds[0], self.seeds.index(k.seed), k.lr_multiplier,
                                           self.per_worker_batches.index(k.per_worker_batch),
                                           self.methods.index(k.method)))


# How far a DP rerun's final val loss may lie from its record, by inner optimizer: bit for bit on one
# CPU; across machines floating point differs in the last bits, which Muon's orthogonalized steps keep
# at ~3e-6 but AdamW at lr 0.01 amplifies (dp_adamw seed 1: 4.0555 against a record of 4.0677 on
# another machine of the same packages, its tokenizer, data and config identical). More says the
# rerun is not the recorded run (other data, code or settings).
RERUN_TOLERANCE = {"muon": 1e-4, "adamw": 0.03}


def check_rerun(dp: Method, dp_spec: RunSpec, rerun_loss: float, recorded: float) -> None:
    """Stops where the DP rerun is not the recorded run; warns where it is, with other last bits."""
    if abs(rerun_loss - recorded) > RERUN_TOLERANCE[dp.spec.optimizer]:
        raise RuntimeError(f"{dp_spec.name} reran to val loss {rerun_loss:.6f}, recorded {recorded:.6f}: "
                           f"not the comparison's run (more than {RERUN_TOLERANCE[dp.spec.optimizer]:g} apart)")
    if rerun_loss != recorded:
        print(f"warning: {dp_spec.name} reran to val loss {rerun_loss:.6f}, recorded {recorded:.6f}",
              file=sys.stderr, flush=True)


def _start_states(dp: Method, dp_spec: RunSpec, ctx: Context, runs: dict[RunSpec, RunRecord]) -> None:
    """The DP run again, keeping its start states; it must reproduce its record, which makes them the
    start states of the comparison's alignment (and shows the data is the records' data)."""
    rerun = execute_run(dp, Launch(dp_spec, start_states=True), ctx)
    check_rerun(dp, dp_spec, rerun.final_val_loss, runs[dp_spec].final_val_loss)


def measure(key: BatchBranchKey, method: Method, chosen: Selection, dp_run: str, ctx: Context) -> BatchAlignmentRecord:
    spec = branch_spec(chosen, key)
    settings = at_batch(ctx.settings, key.per_worker_batch, method.workers)
    began = time.time()
    result = alignment.measure(method, spec, settings, ctx.data, start_root(ctx, dp_run), key.start_step,
                               ctx.work / "alignment_batch" / key.name, held_out=True)
    a, losses = result.alignment, result.losses
    return BatchAlignmentRecord(ctx.corpus, ctx.data.sha256, key.method, key.per_worker_batch, key.lr_multiplier,
                                key.seed, key.start_step, spec.inner_lr, dp_run, ctx.settings.protocol(),
                                method.config_sha256, a.cosine, a.norm_ratio, a.matrix_cosines, losses.sequences,
                                losses.after_average, losses.after_reference, round(time.time() - began, 1), commit())


def run_sweep(plan: Plan, ctx: Context, runs: dict[RunSpec, RunRecord], done: dict[BatchBranchKey, BatchAlignmentRecord],
              records: RecordFile, budget: Budget) -> list[str]:
    """Measure what `plan` asks and `done` lacks, in order, until the budget is spent; `done` gains the
    new records. Returns the failures: a failure skips, for the sitting, every measurement from the
    same DP run."""
    methods = {m: Method.load(m) for m in plan.methods}
    baselines = {m.spec.start_method: Method.load(m.spec.start_method) for m in methods.values()}
    chosen = selected([*methods.values(), *baselines.values()], ctx.settings, runs)
    missing = [m for m in (*methods, *baselines) if m not in chosen]
    if missing:
        return [f"no selected lr for {', '.join(missing)} in the comparison's records: run tools/compare_methods.py"]
    todo = [k for k in plan.order() if k not in done]
    print(f"[{ctx.corpus}] alignment vs per-worker batch: {len(done)} recorded, {len(todo)} to measure", flush=True)
    failures: list[str] = []
    failed_starts: set[str] = set()
    for number, key in enumerate(todo, start=1):
        method = methods[key.method]
        dp = baselines[method.spec.start_method]
        dp_spec = replace(chosen[dp.name].spec, seed=key.seed)
        if dp_spec.name in failed_starts:
            continue
        root = start_root(ctx, dp_spec.name)
        try:
            if not alignment.has_start_states(root, alignment.start_steps(ctx.settings)):
                with budget.slot() as allowed:
                    if not allowed:
                        break
                    _start_states(dp, dp_spec, ctx, runs)
            with budget.slot() as allowed:
                if not allowed:
                    break
                print(f"[{ctx.corpus}] {number}/{len(todo)} {key.name} (B={key.per_worker_batch * method.workers})",
                      flush=True)
                record = measure(key, method, chosen[method.name], dp_spec.name, ctx)
        except Exception as err:  # a failed launch, a rerun that is not the recorded run, an unreadable checkpoint
            failures.append(f"{key.name}: {type(err).__name__}: {err}")
            print(failures[-1], file=sys.stderr, flush=True)
            failed_starts.add(dp_spec.name)
            continue
        records.append(record)
        done[key] = record
        print(f"[{ctx.corpus}]   cosine {record.cosine:.4f}, loss after average {record.loss_after_average:.4f} "
              f"vs after K=1 {record.loss_after_reference:.4f} ({record.seconds:.0f} s)", flush=True)
        if not any(k not in done and k.seed == key.seed and methods[k.method].spec.start_method == dp.name
                   for k in todo):
            shutil.rmtree(root, ignore_errors=True)  # no planned measurement starts there any more
    return failures
