"""The GPU run for claim (e) (scripts/gpu_evidence.py): its warm start's time planning, and one of its
trainer processes at a tiny size. The whole run rehearses on CPU with `bash scripts/gpu_evidence.sh
--cpu` (minutes; scripts/gpu_twin.sh runs it on the GPU image's packages)."""
import dataclasses
import time
from pathlib import Path

import pytest

from script_modules import load_script
from tools.compare.simulated_workers import BranchPlan, StepCost, warm_start_continues

REPO = Path(__file__).resolve().parents[1]


def test_the_warm_start_stops_while_the_branches_still_fit():
    plan = BranchPlan(workers=8, sync_interval=30, max_warm_steps=100, deadline=1000.0, margin=1.25)
    cost = StepCost(whole_batch_s=1.0, worker_s=0.2)
    # The reference's 30 whole-batch steps and 8 workers' 30 steps: 30 x (1 + 8 x 0.2) = 78 s, x 1.25 = 97.5 s.
    assert cost.branches_s(plan) == pytest.approx(78.0)
    assert warm_start_continues(0, cost, plan, now=1000.0 - 98.5)  # the next step (1 s) and the branches fit
    assert not warm_start_continues(0, cost, plan, now=1000.0 - 98.4)
    assert not warm_start_continues(100, cost, plan, now=0.0)  # max_warm_steps, however much time is left
    # A machine running at half the pace it was timed at: every step twice as long.
    assert cost.at_pace(2.0) == StepCost(2.0, 0.4)


@pytest.mark.trains
@pytest.mark.timeout(240)
@pytest.mark.launch
def test_one_simulated_worker_retraces_the_reference_exactly(tmp_path):
    """K=1: the one worker's branch starts from the restored start state (weights, optimizer state, lr
    schedule, RNG) on the reference's data, so its pseudogradient IS the reference's: a cosine of 1 on
    every hidden matrix, the same norm."""
    load_script("gpu_check")  # what gpu_evidence.py imports from beside it
    gpu_evidence = load_script("gpu_evidence")
    mode = dataclasses.replace(gpu_evidence.CPU, global_batch=4, micro=2, max_warm_steps=2)
    evidence = gpu_evidence.Evidence(mode, tmp_path)
    evidence.start_stage(200.0)  # a few seconds' work, on a 2-core machine that others may share
    plan = BranchPlan(workers=1, sync_interval=2, max_warm_steps=2, deadline=time.time() + 180.0, margin=1.5)
    summary = evidence.branches("muon", tmp_path / "run", plan)
    alignment = summary["alignment"]
    assert summary["warm_start"]["steps"] == 2 and summary["steps"] == 4
    assert alignment["cosine"] == pytest.approx(1.0, abs=1e-12) and alignment["norm_ratio"] == pytest.approx(1.0)
    assert len(alignment["matrix_cosines"]) == 4 * 7  # Q, K, V, output, gate, up, down in each of the 4 layers
    assert all(c == pytest.approx(1.0, abs=1e-9) for c in alignment["matrix_cosines"].values())
