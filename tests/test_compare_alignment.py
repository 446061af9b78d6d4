"""The alignment measure of the method comparison (tools/compare/alignment.py) on real launches,
branching from a DP Muon run's start states: at K = 1 the averaged pseudogradient (the outer momentum
after one sync from zero) IS the reference's full-batch pseudogradient, so the cosine is 1 to fp32
rounding over the whole model and every matrix."""
from __future__ import annotations

import pytest
from _ckpt_runs import dataset

from tools.compare import alignment
from tools.compare.launch import Data, launch, run_config, trainer_flags
from tools.compare.protocol import Method, RunSpec, Settings
from trainer.checkpoint.format import complete_iterations

pytestmark = pytest.mark.launch  # every test here starts processes (tests/launch_tier.py)

SETTINGS = Settings(steps=6, sync_interval=2, warmup=1, global_batch=4, eval_batches=1)


@pytest.fixture(scope="module")
def dp_states(tmp_path_factory):
    """A DP Muon run of 6 steps keeping its states at the start steps (2 and 4)."""
    base = tmp_path_factory.mktemp("alignment")
    prefix = dataset(base)
    data = Data(prefix, prefix, ("--vocab-size", "1000"), "0" * 64)  # records are not written here
    dp = Method.load("dp_muon")
    run_dir, root = base / "dp", base / "dp" / "ckpt"
    flags = trainer_flags(RunSpec(dp.name, 0.02, None, 1), SETTINGS, data, 1, run_dir, eval_interval=0)
    launch(run_config(dp, SETTINGS, None), flags + alignment.start_state_flags(SETTINGS, root), 1, run_dir,
           timeout_s=600)
    steps = alignment.start_steps(SETTINGS)
    assert steps == (2, 4) and complete_iterations(root) == [2, 4, 6]
    # A cosine of 1 is not automatic at this scale: consecutive H-step pseudogradients differ.
    theta = {step: alignment.worker0_state(root, step)["model"] for step in (2, 4, 6)}
    shape = alignment.CheckpointReader(root, 2).meta.model
    assert alignment.compare(*({n: theta[a][n] - theta[a + 2][n] for n in theta[a]} for a in (2, 4)), shape).cosine < 0.999
    alignment.keep_only(root, steps)
    assert complete_iterations(root) == [2, 4] and alignment.has_start_states(root, steps)
    return data, root, base


def test_k1_branch_reproduces_the_full_batch_reference(dp_states):
    data, root, base = dp_states
    method = Method.load("muloco_k1")
    measured = alignment.measure(method, RunSpec(method.name, 0.01, 0.7, 1), SETTINGS, data, root, 2, base / "k1")
    assert measured.losses is None  # held-out losses only where asked for
    result = measured.alignment
    assert result.cosine == pytest.approx(1.0, abs=1e-6)
    assert result.norm_ratio == pytest.approx(1.0, abs=1e-4)
    assert len(result.matrix_cosines) == 4 * 7  # per layer q, k, v, proj, gate, up, fc2
    assert min(result.matrix_cosines.values()) == pytest.approx(1.0, abs=1e-5)
    assert not (base / "k1").exists()  # its checkpoints are removed once measured
