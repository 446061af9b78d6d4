"""The alignment measure of the method comparison (tools/compare/alignment.py) on real launches: at
K = 1 the averaged pseudogradient recovered from the outer momentum IS the one-worker full-batch
pseudogradient, so the reference launch started with --load-worker must reproduce it (cosine 1 to
fp32 rounding), where another sync's pseudogradient does not."""
from __future__ import annotations

import pytest
from _ckpt_runs import dataset

from tools.compare import alignment
from tools.compare.launch import Data, launch, run_config, trainer_flags
from tools.compare.protocol import Method, RunSpec, Settings

SETTINGS = Settings(steps=6, sync_interval=2, warmup=1, global_batch=4, eval_batches=1, seeds=(0,))


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("alignment")
    prefix = dataset(base)
    data = Data(prefix, prefix, ("--vocab-size", "1000"))
    method = Method.load("muloco_k1")
    spec = RunSpec(method.name, 0.02, method.outer[0], 0)
    run_dir = base / "run"
    flags = trainer_flags(spec, SETTINGS, data, 1, run_dir, eval_interval=0)
    flags += alignment.checkpoint_flags(SETTINGS, run_dir / "ckpt")
    launch(run_config(method, SETTINGS, spec.outer_lr), flags, 1, run_dir, timeout_s=600)
    return method, spec, data, run_dir


def test_k1_averaged_pseudogradient_is_the_full_batch_one(k1_run):
    method, spec, data, run_dir = k1_run
    measured = alignment.measure(method, spec, SETTINGS, data, run_dir / "ckpt", run_dir / "alignment", syncs=(2,))
    assert measured.syncs == [2]
    assert measured.cosines[0] == pytest.approx(1.0, abs=1e-6)
    assert measured.norm_ratios[0] == pytest.approx(1.0, abs=1e-4)
    # A cosine of 1 is not automatic at this scale: consecutive syncs' pseudogradients differ.
    ckpt, H, mu = run_dir / "ckpt", SETTINGS.sync_interval, method.outer[1]
    other = alignment.compare(alignment.averaged_pseudogradient(ckpt, 2, H, mu),
                              alignment.averaged_pseudogradient(ckpt, 3, H, mu))
    assert other.cosine < 0.999


def test_syncs_measured():
    assert alignment.alignment_syncs(10) == (2, 5, 9)
    assert alignment.alignment_syncs(2) == (2,)
    assert alignment.alignment_syncs(1) == ()
