"""MuLoCo in Hugging Face's Trainer (muloco/hook/hf_trainer.py), run as its example shows it
(examples/hf_trainer_muloco.py: a transformers Llama, the Trainer's own loop and checkpoints, DeepSpeed
ZeRO 1, K=2 workers x D=2 ranks): the workers end with one model, and a run resumed from a Trainer
checkpoint ends where the run that was not stopped ended, bit for bit."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from tools.trainer_runs import REPO_ROOT, launch_ranks, shared_memory_files

EXAMPLE = REPO_ROOT / "examples" / "hf_trainer_muloco.py"
RESULT_LINE = re.compile(r'\{"worker": [^{}\n]*\}')


def run_example(*args: str) -> list[dict]:
    result = launch_ranks(EXAMPLE, 4, ["--workers", "2", "--steps", "6", "--sync-interval", "3", *args], timeout_s=600)
    for path in shared_memory_files(result.master_port):
        path.unlink(missing_ok=True)
    result.check("the Hugging Face Trainer example")
    # each first rank prints its line in one write, but another rank's unfinished line may precede it
    return sorted((json.loads(found) for found in RESULT_LINE.findall(result.output)), key=lambda line: line["worker"])


@pytest.mark.launch
def test_the_trainers_workers_agree_and_a_trainer_checkpoint_resumes_exactly(tmp_path):
    output = str(tmp_path / "out")
    uninterrupted = run_example("--save-steps", "3", "--output", output)
    assert [line["worker"] for line in uninterrupted] == [0, 1] and {line["outer_steps"] for line in uninterrupted} == {2}
    assert len({line["global_weights_sha256"] for line in uninterrupted}) == 1
    for worker in (0, 1):  # as if the run had stopped after step 3's checkpoint
        shutil.rmtree(tmp_path / "out" / f"worker_{worker}" / "checkpoint-6")
    resumed = run_example("--save-steps", "3", "--output", output, "--resume")
    assert [line["global_weights_sha256"] for line in resumed] == [line["global_weights_sha256"] for line in uninterrupted]
