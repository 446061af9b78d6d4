"""What a run does when the user says nothing: its logs follow --save, the logged training loss is the
mean over the log interval, validation is filed under valid/ in TensorBoard, the newest checkpoints,
latest and the best stay, and a warm-up longer than the run is said in one line. Two short runs in one
process (a world of one)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _ckpt_runs import REPO_ROOT, dataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.metrics import tensorboard_tag
from trainer.schedule import ScheduleConfig

pytestmark = pytest.mark.launch  # every test here starts processes (tests/launch_tier.py)

PROBE = textwrap.dedent("""
    import sys
    from tools.trainer_runs import init_distributed, run_trainer
    from muloco.core.comm import close_distributed

    init_distributed()
    common = sys.argv[2:]
    run_trainer([*common, "--run-dir", f"{sys.argv[1]}/every_step", "--log-interval", "1", "--eval-interval", "0"])
    run_trainer([*common, "--save", f"{sys.argv[1]}/ckpt", "--save-interval", "1", "--keep-last", "1",
                 "--log-interval", "4", "--eval-interval", "2", "--eval-iters", "1"])
    close_distributed()
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("defaults")
    flags = ["--ds_config", "ds_configs/cpu_tiny_muon.json", "--model", "tiny", "--data-path", dataset(work),
             "--vocab-size", "1000", "--train-iters", "4", "--lr-warmup-iters", "6", "--hang-timeout-s", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", PROBE, str(work), *flags], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return work, result.stdout


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_logs_follow_save_without_run_dir(runs):
    work, _ = runs
    assert (work / "ckpt" / "metrics.jsonl").is_file() and (work / "ckpt" / "config.json").is_file()


def test_the_logged_loss_is_the_mean_over_the_log_interval(runs):
    work, _ = runs
    every_step = [r["loss"] for r in _records(work / "every_step") if "loss" in r]
    (logged,) = [r for r in _records(work / "ckpt") if "loss" in r]
    assert logged["step"] == 4 and logged["loss_steps"] == 4 and len(every_step) == 4
    assert logged["loss"] == pytest.approx(sum(every_step) / 4, rel=1e-6)
    assert logged["loss"] != pytest.approx(every_step[-1], rel=1e-6)  # not the last step's alone


def test_validation_is_filed_under_valid_in_tensorboard(runs):
    work, _ = runs
    events = EventAccumulator(str(work / "ckpt" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "valid/loss" in tags and "train/loss" in tags and "train/val_loss" not in tags
    assert [e.step for e in events.Scalars("valid/loss")] == [2, 4]
    assert tensorboard_tag("outer", "pseudograd_norm") == "outer/pseudograd_norm"


def test_the_newest_checkpoints_and_the_best_stay(runs):
    work, _ = runs
    # --keep-last 1 with saves at 1-4 and validation at 2 and 4: 4 is latest, 2 the best known when 4 was saved
    assert sorted(p.name for p in (work / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000004"]


def test_a_warm_up_longer_than_the_run_is_said_in_one_line(runs):
    _, output = runs
    line = ("warning: the warm-up (6 steps, --lr-warmup-iters) is longer than the run (4 steps, --train-iters): "
            "the lr ends at 67% of its peak")
    assert output.count(line) == 2  # once per run
    assert ScheduleConfig(train_iters=6, warmup_iters=6).warmup_warning() is None
