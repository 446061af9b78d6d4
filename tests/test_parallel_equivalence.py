"""Tensor, pipeline and inner-data parallelism change nothing but speed: the tiny model trained on the
same global batch at T=2, P=2, P=3 (uneven stages) or D=2 starts from the same full weights as at T=1, computes the same
loss and gradient norm, and after one and two optimizer steps (Muon, and AdamW) holds the same full
weights, compared logical matrix by logical matrix (Q, K, V, gate, up separately).

One real `deepspeed` launch per layout; tests/_parallel_probe.py records everything on rank 0.
"""
from functools import cache
from pathlib import Path

import pytest
import torch

from tools.synthetic_data import write_markov_dataset
from trainer.model.sharding import logical_matrices
from trainer.model.presets import PRESETS
from tools.trainer_runs import LaunchResult, launch_ranks
from tools.trainer_runs import REPO_ROOT, TINY_VOCAB

pytestmark = pytest.mark.launch  # every test here starts processes (tests/launch_tier.py)

PROBE = REPO_ROOT / "tests" / "_parallel_probe.py"
# (ranks, flags): every layout trains the same 4 sequences per step in micro-batches of 2, so T=1
# accumulates 2 micro-batches where D=2 gives one to each replica.
LAYOUTS = {
    "T1": (1, []),
    "T2": (2, ["--tensor-model-parallel-size", "2"]),
    "P2": (2, ["--pipeline-model-parallel-size", "2"]),
    "P3": (3, ["--pipeline-model-parallel-size", "3"]),  # uneven stages: 1 + 2 + 1 of the 4 layers
    "D2": (2, []),
}
PARALLEL = [name for name in LAYOUTS if name != "T1"]
OPTIMIZERS = ["muon", "adamw"]
STEPS = 2
SHAPE = PRESETS["tiny"]
# fp32 forward/backward with different reduction orders: relative differences are ~1e-6.
LOSS_RTOL = 1e-5
# ||update difference|| / ||update||, per logical matrix. Measured up to ~2e-4 (AdamW's first step
# divides tiny gradients by their own size); a wrong split or per-shard Newton-Schulz gives O(1).
UPDATE_RTOL = 1e-3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parallel")
    write_markov_dataset(str(root / "markov"), vocab_size=TINY_VOCAB)
    return root


@cache
def _launch(layout: str, root: Path) -> LaunchResult:
    """One launch per layout, kept even when it failed so that later tests do not relaunch it."""
    ranks, flags = LAYOUTS[layout]
    return launch_ranks(PROBE, ranks, [
        str(root / layout), "--model", "tiny", "--data-path", str(root / "markov"), "--vocab-size", str(TINY_VOCAB),
        "--train-iters", str(STEPS), "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr-warmup-iters", "0", "--eval-interval", "0", *flags])


@cache
def _records(layout: str, root: Path) -> dict:
    _launch(layout, root).check(f"probe at {layout}")
    return {opt: torch.load(root / layout / opt / "probe.pt") for opt in OPTIMIZERS}


@pytest.fixture(scope="module")
def probe(root):
    return lambda layout: _records(layout, root)


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("layout", PARALLEL)
def test_same_initial_full_weights(layout, probe):
    for opt in OPTIMIZERS:
        ref, got = probe("T1")[opt]["initial"]["weights"], probe(layout)[opt]["initial"]["weights"]
        assert sorted(got) == sorted(ref)
        different = [name for name in ref if not torch.equal(got[name], ref[name])]
        assert not different, f"{layout} {opt}: initial weights differ from T=1 in {different}"


@pytest.mark.parametrize("layout", PARALLEL)
def test_same_loss_and_gradient_norm(layout, probe):
    for opt in OPTIMIZERS:
        for step, (ref, got) in enumerate(zip(probe("T1")[opt]["steps"], probe(layout)[opt]["steps"]), 1):
            assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), f"{layout} {opt} step {step} loss"
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL), \
                f"{layout} {opt} step {step} gradient norm"


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("layout", PARALLEL)
def test_same_weights_after_steps(layout, opt, step, probe):
    ref_run, run = probe("T1")[opt], probe(layout)[opt]
    initial = ref_run["initial"]["weights"]
    ref, got = ref_run["steps"][step - 1]["model"], run["steps"][step - 1]["model"]
    assert got["replica_gap"] == 0.0, f"{layout}: copies of a parameter disagree by {got['replica_gap']}"
    failures = []
    for name, start in initial.items():
        for part, ref_update in logical_matrices(name, ref["weights"][name] - start, SHAPE).items():
            update = logical_matrices(name, got["weights"][name] - start, SHAPE)[part]
            assert torch.linalg.norm(ref_update) > 0, f"{name} {part} did not move: the check would be vacuous"
            gap = _relative_gap(update, ref_update)
            if gap > UPDATE_RTOL:
                failures.append(f"{name} {part or '(whole)'}: relative update difference {gap:.2e}")
    assert not failures, f"{layout} {opt} after step {step} differs from T=1:\n" + "\n".join(failures)
