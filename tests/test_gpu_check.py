"""The prepared device check runs on CPU (`--cpu`: gloo, fp32, the tiny preset, the same stages and
steps), so that it cannot rot between the sessions that have a GPU. One run of the whole script."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1200)
def test_gpu_check_passes_on_cpu(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1100)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result.returncode == 0 and report["result"] == "passed", \
        (tmp_path / "gpu_check.md").read_text() + result.stdout[-3000:] + result.stderr[-3000:]
    stages = {s["stage"]: s for s in report["stages"]}
    assert [s["status"] for s in report["stages"]] == ["passed"] * 5 and sorted(stages) == list("abcde")
    a, b, d = stages["a"]["results"], stages["b"]["results"], stages["d"]["results"]
    assert a["loss_steps_36_40"] < a["loss_steps_1_5"] - 0.5 and a["tokens_per_s"] > 0
    assert b["identical"] is True  # fp32 on CPU: the resumed steps are bit-identical
    assert d["max_weight_difference_after_sync"] == {"10": 0.0, "20": 0.0}
    assert "verify passed" in stages["c"]["results"]["verify"][-1]
    assert (tmp_path / "gpu_check.md").read_text().startswith("# Device check (cpu)")
    assert not (REPO / "results" / "gpu_check.json").exists() or \
        json.loads((REPO / "results" / "gpu_check.json").read_text())["mode"] == "gpu", "the GPU report is kept"
