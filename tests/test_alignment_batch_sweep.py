"""The alignment's per-worker-batch sweep without launches: its records (round trip; the comparison's
committed records still read), the held-out arithmetic (the K workers and the K=1 reference evaluate
the same sequences), the work order, the sweep's resume and budget with fake measurements, and the
report from synthetic records with numbers worked by hand."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from tools.compare import alignment, batch_sweep, launch
from tools.compare.batch_report import cell, pairing_table, rows, table, write
from tools.compare.batch_sweep import MIN_HELD_OUT, Plan, at_batch, run_sweep
from tools.compare.protocol import OUTER_LR_GRID, Method, RunSpec, Settings
from tools.compare.records import AlignmentRecord, BatchAlignmentRecord, BatchBranchKey, RecordFile, RunRecord
from tools.compare.sweep import Budget, Context
from tools.compare.verdicts import Stat
from tools.compare_methods import config_hashes
from trainer import data as data_module
from trainer.config import BatchConfig
from trainer.data import StreamPosition, validation_batches

REPO = Path(__file__).resolve().parents[1]
SETTINGS = Settings()
HASHES = config_hashes()
DATA = "d" * 64


def batch_record(method="muloco_k8", b=2, x=1.0, seed=1, step=150, cosine=0.8, matrices=(0.7, 0.9),
                 after_average=4.5, after_reference=4.4, **changes) -> BatchAlignmentRecord:
    return replace(BatchAlignmentRecord(
        "shakespeare", DATA, method, b, x, seed, step, 0.005 * x, f"dp_muon_lr0.04_s{seed}", SETTINGS.protocol(),
        HASHES[method], cosine, 1.2, {f"m{i}": c for i, c in enumerate(matrices)}, 256, after_average,
        after_reference, 60.0, "abc"), **changes)


# -- records -------------------------------------------------------------------------------------------

def test_batch_records_round_trip_in_their_own_file(tmp_path):
    f = RecordFile(tmp_path / "alignment_batch.jsonl", BatchAlignmentRecord)
    records = [batch_record(), batch_record("diloco_k8", b=32), batch_record(seed=2)]
    for r in records:
        f.append(r)
    assert f.load("shakespeare", DATA, SETTINGS.protocol(), HASHES) == {r.key: r for r in records}
    assert records[1].key == BatchBranchKey("diloco_k8", 32, 1.0, 1, 150)
    assert records[1].key.name == "diloco_k8_bk32_x1_s1_at150"


@pytest.mark.parametrize("name, kind", [("runs.jsonl", RunRecord), ("alignment.jsonl", AlignmentRecord)])
def test_the_comparisons_committed_records_still_read(name, kind):
    path = REPO / "results" / "compare" / "shakespeare" / name
    loaded = RecordFile(path, kind).load("shakespeare", None, SETTINGS.protocol(), HASHES)
    assert len(loaded) > 50


# -- held-out sequences ------------------------------------------------------------------------------------

def _flag(flags: list[str], name: str) -> int:
    return int(flags[flags.index(name) + 1])


def _evaluated(flags: list[str], workers: int) -> tuple[int, set[int]]:
    """The validation samples a run with `flags` builds (trainer/run.py: eval-iters x per-worker batch),
    and those every one of its workers evaluates (trainer/data.py validation_batches)."""
    micro = _flag(flags, "--micro-batch-size")
    per_worker = _flag(flags, "--global-batch-size") // workers
    assert per_worker % micro == 0 and micro <= launch.MAX_MICRO_BATCH
    batch = BatchConfig(micro_batch_size=micro, gradient_accumulation_steps=per_worker // micro, workers=workers)
    samples = set()
    for worker in range(workers):
        mine = {i for indices in validation_batches(range(10 ** 6), StreamPosition(worker, 0, batch),
                                                    _flag(flags, "--eval-iters")) for i in indices}
        assert not samples or mine == samples  # every worker evaluates the same samples
        samples = mine
    return _flag(flags, "--eval-iters") * batch.per_worker, samples


@pytest.mark.parametrize("per_worker", [2, 8, 32, 128])
def test_branch_and_reference_evaluate_the_same_held_out_sequences(per_worker, tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "collate", lambda dataset, indices: indices)
    settings = at_batch(SETTINGS, per_worker, 8)
    data = launch.Data("train", "valid", ("--vocab-size", "4096"), DATA)
    spec = RunSpec("muloco_k8", 0.005, 0.7, 1)
    branch, reference = (_evaluated(launch.trainer_flags(spec, settings, data, k, tmp_path, eval_interval=30), k)
                         for k in (8, 1))
    assert branch == reference  # the same validation set built (same seed), the same samples evaluated
    held_out = alignment.held_out_sequences(settings)
    assert branch == (held_out, set(range(held_out))) and held_out == max(MIN_HELD_OUT, 8 * per_worker)


def test_the_held_out_measure_takes_a_plain_outer_step():
    config = launch.run_config(Method.load("muloco_k8"), SETTINGS, 1.0, outer_momentum=0.0)
    assert (config["muloco"]["outer_lr"], config["muloco"]["outer_momentum"]) == (1.0, 0.0)
    assert launch.run_config(Method.load("muloco_k8"), SETTINGS, 0.7)["muloco"]["outer_momentum"] == 0.9


# -- work order and the sweep ------------------------------------------------------------------------------

def test_the_work_order_gives_a_complete_small_picture_first():
    plan = Plan((150, 60), per_worker_batches=(2, 8), lr_multipliers=(0.5, 1.0, 2.0), seeds=(1, 2))
    names = [k.name for k in plan.order()]
    assert len(names) == len(set(names)) == 2 * 2 * 3 * 2 * 2
    assert names[:8] == ["muloco_k8_bk2_x1_s1_at150", "diloco_k8_bk2_x1_s1_at150", "muloco_k8_bk8_x1_s1_at150",
                         "diloco_k8_bk8_x1_s1_at150", "muloco_k8_bk2_x1_s2_at150", "diloco_k8_bk2_x1_s2_at150",
                         "muloco_k8_bk8_x1_s2_at150", "diloco_k8_bk8_x1_s2_at150"]
    assert names[8:12] == ["muloco_k8_bk2_x0.5_s1_at150", "diloco_k8_bk2_x0.5_s1_at150",
                           "muloco_k8_bk8_x0.5_s1_at150", "diloco_k8_bk8_x0.5_s1_at150"]
    assert names[12] == "muloco_k8_bk2_x2_s1_at150" and names[16] == "muloco_k8_bk2_x0.5_s2_at150"
    assert all(n.endswith("at60") for n in names[24:])


def _selection_runs() -> dict[RunSpec, RunRecord]:
    """A complete selection on seed 0 for each method (inner lrs around `best` at the paper's outer lr,
    then the outer grid at `best`, 0.7 winning), as the comparison's records hold it."""
    runs = {}

    def run(name, lr, outer, loss):
        runs[RunSpec(name, lr, outer, 0)] = RunRecord("shakespeare", DATA, name, lr, outer, 0, SETTINGS.protocol(),
                                                      HASHES[name], loss, [], [], None, 1.0, "abc")

    for name, best in (("dp_muon", 0.04), ("dp_adamw", 0.01), ("muloco_k8", 0.005), ("diloco_k8", 0.003)):
        method = Method.load(name)
        paper_outer = method.outer[0] if method.outer else None
        for lr in sorted({*SETTINGS.inner_grid(method.optimizer), best, best / 2, best * 2}):
            run(name, lr, paper_outer, 4.0 + abs(math.log(lr / best)))
        if paper_outer is not None:
            for outer in OUTER_LR_GRID.points:
                run(name, best, outer, 4.0 + abs(outer - 0.7) - (outer == 0.7))
    return runs


def test_the_sweep_resumes_from_its_records_and_stops_at_its_budget(tmp_path, monkeypatch):
    launched: list[str] = []
    states: set[str] = set()

    def start_states(dp, dp_spec, ctx, runs):
        launched.append(f"dp {dp_spec.name}")
        states.add(dp_spec.name)

    def measure(key, method, chosen, dp_run, ctx):
        assert dp_run in states and chosen.spec.method == key.method
        launched.append(key.name)
        return batch_record(key.method, key.per_worker_batch, key.lr_multiplier, key.seed, key.start_step,
                            inner_lr=chosen.spec.inner_lr * key.lr_multiplier)

    monkeypatch.setattr(batch_sweep, "_start_states", start_states)
    monkeypatch.setattr(batch_sweep, "measure", measure)
    monkeypatch.setattr(alignment, "has_start_states", lambda root, steps: root.parent.name in states)
    monkeypatch.setattr(batch_sweep.shutil, "rmtree", lambda path, ignore_errors=False: states.discard(path.parent.name))
    ctx = Context("shakespeare", SETTINGS, None, tmp_path, None, None)
    records = RecordFile(tmp_path / "alignment_batch.jsonl", BatchAlignmentRecord)
    plan = Plan((150,), per_worker_batches=(2, 8), lr_multipliers=(1.0,), seeds=(1, 2))
    runs, done = _selection_runs(), {}
    assert run_sweep(plan, ctx, runs, done, records, Budget(1, max_runs=3)) == []
    assert launched == ["dp dp_muon_lr0.04_s1", "muloco_k8_bk2_x1_s1_at150", "dp dp_adamw_lr0.01_s1"]
    launched.clear()
    assert run_sweep(plan, ctx, runs, done, records, Budget(1)) == []
    assert launched[:3] == ["diloco_k8_bk2_x1_s1_at150", "muloco_k8_bk8_x1_s1_at150", "diloco_k8_bk8_x1_s1_at150"]
    assert len(done) == 8 and states == set()  # every DP state removed once nothing needs it
    assert records.load("shakespeare", DATA, SETTINGS.protocol(), HASHES) == done
    assert done[BatchBranchKey("diloco_k8", 8, 1.0, 2, 150)].inner_lr == 0.003
    assert {r.start_run for r in done.values()} >= {"dp_muon_lr0.04_s1"}
    launched.clear()
    assert run_sweep(plan, ctx, runs, done, records, Budget(1)) == [] and launched == []


def test_a_failure_skips_the_measurements_from_its_dp_run_for_the_sitting(tmp_path, monkeypatch):
    measured: list[str] = []

    def start_states(dp, dp_spec, ctx, runs):
        if dp.name == "dp_adamw":
            raise RuntimeError(f"{dp_spec.name} reran to another val loss")

    monkeypatch.setattr(batch_sweep, "_start_states", start_states)
    monkeypatch.setattr(batch_sweep, "measure", lambda key, *_: measured.append(key.name) or batch_record(
        key.method, key.per_worker_batch, key.lr_multiplier, key.seed, key.start_step))
    monkeypatch.setattr(alignment, "has_start_states", lambda root, steps: False)
    ctx = Context("shakespeare", SETTINGS, None, tmp_path, None, None)
    plan = Plan((150,), per_worker_batches=(2, 8), lr_multipliers=(1.0,), seeds=(1,))
    failures = run_sweep(plan, ctx, _selection_runs(), {}, RecordFile(tmp_path / "a.jsonl", BatchAlignmentRecord),
                         Budget(1))
    assert failures == ["diloco_k8_bk2_x1_s1_at150: RuntimeError: dp_adamw_lr0.01_s1 reran to another val loss"]
    assert measured == ["muloco_k8_bk2_x1_s1_at150", "muloco_k8_bk8_x1_s1_at150"]


def test_the_sweep_needs_the_comparisons_selection(tmp_path):
    ctx = Context("shakespeare", SETTINGS, None, tmp_path, None, None)
    failures = run_sweep(Plan((150,)), ctx, {}, {}, None, Budget(1))
    assert failures == ["no selected lr for muloco_k8, diloco_k8, dp_muon, dp_adamw in the comparison's records: "
                        "run tools/compare_methods.py"]


@pytest.mark.parametrize("dp, apart, stops", [("dp_muon", 3e-6, False), ("dp_muon", 0.012, True),
                                                ("dp_adamw", 0.012, False), ("dp_adamw", 0.1, True)])
def test_a_dp_rerun_is_held_to_its_optimizers_reproducibility(dp, apart, stops, capsys):
    """Across machines Muon reruns its record to ~3e-6 while AdamW drifts ~0.01 (the last bits it
    amplifies); beyond its optimizer's tolerance the rerun is not the recorded run and the sweep stops."""
    method, spec = Method.load(dp), RunSpec(dp, 0.01, None, 1)
    if stops:
        with pytest.raises(RuntimeError, match="not the comparison's run"):
            batch_sweep.check_rerun(method, spec, 4.0 + apart, 4.0)
        return
    batch_sweep.check_rerun(method, spec, 4.0 + apart, 4.0)
    assert "warning: " in capsys.readouterr().err
    batch_sweep.check_rerun(method, spec, 4.0, 4.0)
    assert capsys.readouterr().err == ""


# -- report ----------------------------------------------------------------------------------------------

def test_the_report_from_synthetic_records(tmp_path):
    """B/K 2 on seeds 1 and 2 (seed 1 at two start steps), B/K 8 on seed 1 alone."""
    measured = [
        batch_record("muloco_k8", 2, seed=1, step=60, cosine=0.80, matrices=(0.6, 0.8), after_average=4.50),
        batch_record("muloco_k8", 2, seed=1, step=150, cosine=0.70, matrices=(0.5, 0.7), after_average=4.40),
        batch_record("muloco_k8", 2, seed=2, cosine=0.90, matrices=(0.8, 0.8), after_average=4.60),
        batch_record("diloco_k8", 2, seed=1, step=60, cosine=0.85, after_average=4.45),
        batch_record("diloco_k8", 2, seed=1, step=150, cosine=0.85, after_average=4.45),
        batch_record("diloco_k8", 2, seed=2, cosine=0.80, after_average=4.70),
        batch_record("muloco_k8", 8, cosine=0.95, after_average=4.41),
        batch_record("diloco_k8", 8, cosine=0.90, after_average=4.43),
    ]
    records = {r.key: r for r in measured}
    small, large = rows(records, "muloco_k8", "diloco_k8")
    # MuLoCo at B/K 2: seed 1 is the mean of its two starts (0.75), seed 2 is 0.90.
    assert small.muloco["cosine"].by_seed == pytest.approx({1: 0.75, 2: 0.90})
    assert small.muloco["hidden"].by_seed == pytest.approx({1: 0.65, 2: 0.80})
    assert small.muloco["loss gap"].by_seed == pytest.approx({1: 0.05, 2: 0.20})  # 4.45 - 4.4, 4.6 - 4.4
    lead = small.lead
    assert lead["cosine"].by_seed == pytest.approx({1: -0.10, 2: 0.10})
    assert lead["hidden"].by_seed == pytest.approx({1: -0.15, 2: 0.00})  # DiLoCo's hidden mean is 0.8
    assert lead["loss gap"].by_seed == pytest.approx({1: 0.0, 2: 0.10})  # DiLoCo's 0.05 and 0.30 minus MuLoCo's
    # Mean 0.0, sd 0.1414, n 2: the half width is t(1) = 12.706 x 0.1414 / sqrt(2) = 1.2706.
    assert cell(lead["cosine"], signed=True) == "+0.0000 [-1.2706, +1.2706] (n=2)"
    assert large.lead["cosine"].by_seed == pytest.approx({1: 0.05})
    assert cell(large.lead["cosine"], signed=True) == "+0.0500 (n=1)" and cell(Stat({})) == "-"
    text = table([small, large], 128)
    assert "| 2 (256) | 1x | 0.8250 [-0.1280, 1.7779] (n=2) |" in text  # sd 0.1061: half width 0.9530
    assert "| 8 (1,024) | 1x | 0.9500 (n=1) | 0.9000 (n=1) | +0.0500 (n=1) |" in text
    write(tmp_path, "shakespeare", records, 16, "muloco_k8", "diloco_k8", 8, 128, "python tools/alignment_batch_sweep.py")
    report = (tmp_path / "alignment_batch.md").read_text()
    assert "8 of 16 planned measurements (0.1 h of launches), from the DP runs' states at step 60, 150" in report
    assert "held-out sequences per B/K: 2: 256, 8: 256" in report
    assert (tmp_path / "alignment_batch.png").stat().st_size > 0


def test_the_lr_pairing_grids_pair_each_multiplier_of_one_method_with_each_of_the_other(tmp_path):
    """MuLoCo at 1x and 2x, DiLoCo at 0.5x and 1x, seeds 1 and 2 (DiLoCo 0.5x on seed 1 alone)."""
    measured = [
        batch_record("muloco_k8", 2, 1.0, seed=1, cosine=0.80, after_average=4.50),
        batch_record("muloco_k8", 2, 1.0, seed=2, cosine=0.84, after_average=4.46),
        batch_record("muloco_k8", 2, 2.0, seed=1, cosine=0.90, after_average=4.42),
        batch_record("muloco_k8", 2, 2.0, seed=2, cosine=0.86, after_average=4.48),
        batch_record("diloco_k8", 2, 0.5, seed=1, cosine=0.85, after_average=4.45),
        batch_record("diloco_k8", 2, 1.0, seed=1, cosine=0.82, after_average=4.60),
        batch_record("diloco_k8", 2, 1.0, seed=2, cosine=0.80, after_average=4.40),
    ]
    records = {r.key: r for r in measured}
    grid = pairing_table(records, "muloco_k8", "diloco_k8", "cosine").splitlines()
    assert grid[0] == "| B/K | MuLoCo lr | DiLoCo 0.5x | DiLoCo 1x | DiLoCo 2x |"
    # MuLoCo 1x - DiLoCo 1x: seed 1 -0.02, seed 2 +0.04: mean +0.01, sd 0.0424, half width 12.706 x 0.03 = 0.3812.
    assert grid[2] == "| 2 | 1x | -0.0500 (n=1) | +0.0100 [-0.3712, +0.3912] (n=2) | - |"
    # MuLoCo 2x - DiLoCo 0.5x on seed 1: 0.90 - 0.85; against DiLoCo 1x: +0.08 and +0.06.
    assert grid[3] == "| 2 | 2x | +0.0500 (n=1) | +0.0700 [-0.0571, +0.1971] (n=2) | - |"
    assert len(grid) == 4  # no MuLoCo row at 0.5x: it has no measurement there
    # The loss gap's lead is DiLoCo's gap minus MuLoCo's (every reference here is 4.4): MuLoCo 2x against
    # DiLoCo 1x: seed 1 0.20 - 0.02, seed 2 0.00 - 0.08.
    loss = pairing_table(records, "muloco_k8", "diloco_k8", "loss gap").splitlines()
    assert loss[3].startswith("| 2 | 2x | +0.0300 (n=1) | +0.0500 [")
    single = {k: r for k, r in records.items() if k.lr_multiplier == 1.0}
    assert pairing_table(single, "muloco_k8", "diloco_k8", "cosine") == ""
    write(tmp_path, "shakespeare", records, 16, "muloco_k8", "diloco_k8", 8, 128, "python tools/alignment_batch_sweep.py")
    report = (tmp_path / "alignment_batch.md").read_text()
    assert "\n".join(grid) in report and "\n".join(loss) in report
