"""The GPU run for claim (e) (scripts/gpu_evidence.py): its warm start's time planning, and one of its
trainer processes at a tiny size. The whole run rehearses on CPU with `bash scripts/gpu_evidence.sh
--cpu` (minutes; scripts/gpu_twin.sh runs it on the GPU image's packages)."""
import dataclasses
import time
from pathlib import Path

import pytest

from script_modules import load_script
from tools.compare.simulated_workers import (MIN_MARGIN, BranchPlan, StepCost, measured_margin,
                                             warm_start_continues)

REPO = Path(__file__).resolve().parents[1]


def test_the_warm_start_stops_while_the_branches_still_fit():
    plan = BranchPlan(workers=8, sync_interval=30, max_warm_steps=100, deadline=1000.0)
    cost = StepCost(whole_batch_s=1.0, worker_s=0.2)
    # The reference's 30 whole-batch steps and 8 workers' 30 steps: 30 x (1 + 8 x 0.2) = 78 s, x 1.25 = 97.5 s.
    assert cost.branches_s(plan) == pytest.approx(78.0)
    assert warm_start_continues(5, cost, plan, 1.25, now=1000.0 - 98.5)  # the next step (1 s) and the branches fit
    assert not warm_start_continues(5, cost, plan, 1.25, now=1000.0 - 98.4)
    assert not warm_start_continues(100, cost, plan, 1.25, now=0.0)  # max_warm_steps, however much time is left
    # A machine running at half the pace it was timed at: every step twice as long.
    assert cost.at_pace(2.0) == StepCost(2.0, 0.4)


def test_a_stage_whose_branches_fit_its_time_is_never_stopped_by_the_margin():
    """The loaded CPU rehearsal's false stop: the branches' predicted 191 s fitted the 247 s left, but not
    with a x1.5 margin, and the stage stopped with no measurement. The first warm step needs no margin;
    only a stage that would not finish at all stops."""
    plan = BranchPlan(workers=8, sync_interval=30, max_warm_steps=30, deadline=1000.0)
    loaded = StepCost(whole_batch_s=2.0, worker_s=(191.0 / 30 - 2.0) / 8)
    assert loaded.branches_s(plan) == pytest.approx(191.0)
    assert warm_start_continues(0, loaded, plan, 1.5, now=1000.0 - 247.0)  # one step, then the branches
    assert not warm_start_continues(1, loaded, plan, 1.5, now=1000.0 - 245.0)  # further steps keep the margin
    assert not warm_start_continues(0, loaded, plan, 1.5, now=1000.0 - 192.9)  # it would not finish: stop


def test_the_margin_is_the_spread_of_the_steps_timed_on_this_machine():
    assert measured_margin([1.00, 1.01, 1.02]) == MIN_MARGIN  # a device of its own: steady steps
    assert measured_margin([2.0, 2.2, 5.0, 2.1]) == pytest.approx(5.0 / 2.15)  # a shared machine: as slow as its worst


@pytest.mark.trains
@pytest.mark.timeout(240)
@pytest.mark.launch
def test_one_simulated_worker_retraces_the_reference_exactly(tmp_path):
    """K=1: the one worker's branch starts from the restored start state (weights, optimizer state, lr
    schedule, RNG) on the reference's data, so its pseudogradient IS the reference's: a cosine of 1 on
    every hidden matrix, the same norm."""
    gpu_evidence = load_script("gpu_evidence")
    mode = dataclasses.replace(gpu_evidence.CPU, global_batch=4, micro=2, max_warm_steps=2)
    evidence = gpu_evidence.Evidence(mode, tmp_path)
    evidence.start_stage(200.0)  # a few seconds' work, on a 2-core machine that others may share
    plan = BranchPlan(workers=1, sync_interval=2, max_warm_steps=2, deadline=time.time() + 180.0)
    summary = evidence.branches("muon", tmp_path / "run", plan)
    alignment = summary["alignment"]
    assert summary["warm_start"]["steps"] == 2 and summary["steps"] == 4
    assert alignment["cosine"] == pytest.approx(1.0, abs=1e-12) and alignment["norm_ratio"] == pytest.approx(1.0)
    assert len(alignment["matrix_cosines"]) == 4 * 7  # Q, K, V, output, gate, up, down in each of the 4 layers
    assert all(c == pytest.approx(1.0, abs=1e-9) for c in alignment["matrix_cosines"].values())
