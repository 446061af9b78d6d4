"""Multi-process tests of the outer-group collectives: one torchrun launch per K (gloo backend), the
checks themselves run inside tests/_collectives_worker.py on every rank."""
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "tests" / "_collectives_worker.py"
LAUNCH_TIMEOUT_S = 120


@cache
def launch(workers: int, out_dir: Path) -> dict:
    """Run the worker on `workers` ranks; returns rank 0's byte summary."""
    summary = out_dir / f"summary_k{workers}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
         str(WORKER), str(summary)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, f"K={workers} worker failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("collectives")


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_collectives_agree_bitwise_match_reference_and_count_bytes(workers, out_dir):
    launch(workers, out_dir)


def test_reduce_scatter_bytes_stay_flat_while_all_gather_grows(out_dir):
    k2, k4 = launch(2, out_dir), launch(4, out_dir)
    payload = k2["payload"]
    # all-gather: (K-1) payloads; reduce-scatter: about 2 (K-1)/K payloads.
    assert k2["all_gather_sent"] == payload and k4["all_gather_sent"] == 3 * payload
    assert k4["reduce_scatter_sent"] <= 1.55 * payload
    assert k4["reduce_scatter_sent"] / k2["reduce_scatter_sent"] < 1.6
