"""What the MuLoCo paper fixes, pinned by literal values (not the code's own constants, which a test
built from them would follow into any mistake): its five Newton-Schulz triples, the learning-rate
schedule (linear warm-up, cosine to 10% of the peak) and the defaults a config may leave out."""
from __future__ import annotations

import json

import pytest
import torch

from trainer.config import build_parser, resolve
from trainer.optim.newton_schulz import orthogonalize
from trainer.schedule import ScheduleConfig, lr_multiplier

# The paper's per-step (a, b, c) quintic coefficients, in order.
PAPER_TRIPLES = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def _plain_newton_schulz(M: torch.Tensor) -> torch.Tensor:
    """X <- a X + b (X X^T) X + c (X X^T)^2 X from the Frobenius-normalized wide matrix, in float64."""
    X = M.double()
    X = X / (X.norm() + 1e-7)
    for a, b, c in PAPER_TRIPLES:
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ A @ X)
    return X


@pytest.mark.parametrize("shape", [(16, 48), (32, 32)])
def test_the_paper_schedule_applies_its_five_literal_triples(shape):
    M = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    expected = _plain_newton_schulz(M).float()
    # float32 against float64: far tighter than the change of any coefficient in its fourth digit.
    torch.testing.assert_close(orthogonalize(M, schedule="paper", steps=5), expected, atol=2e-5, rtol=0)
    assert not torch.allclose(orthogonalize(M, schedule="keller", steps=5), expected, atol=1e-3)


def test_the_schedule_warms_up_linearly_then_decays_by_cosine_to_a_tenth_of_the_peak():
    schedule = ScheduleConfig(train_iters=20, warmup_iters=10)  # min_lr_ratio left at its default
    # The multiplier for the step after `step` steps: the value logged at step `step`.
    assert [round(lr_multiplier(s, schedule), 12) for s in (0, 4, 9, 10, 15, 19, 20, 25)] == \
        [0.1, 0.5, 1.0, 1.0, 0.55, round(0.1 + 0.45 * (1 - 0.9510565162951535), 12), 0.1, 0.1]
    assert lr_multiplier(5, ScheduleConfig(train_iters=10, warmup_iters=0, min_lr_ratio=0.0)) == pytest.approx(0.5)


def test_a_config_without_a_scheduler_block_gets_the_papers_defaults(tmp_path):
    ds = {"optimizer": {"type": "muon", "params": {"lr": 0.02}}, "muloco": {"workers": 1}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    config = resolve(build_parser().parse_args(["--ds_config", str(path), "--vocab-size", "64"]), 1)
    assert (config.schedule.train_iters, config.schedule.warmup_iters, config.schedule.min_lr_ratio) == (100, 10, 0.1)
    assert lr_multiplier(config.schedule.train_iters, config.schedule) == 0.1  # the last logged lr: 10% of peak
    assert config.clip_grad == 1.0
    muon = config.optimizer.params
    assert (muon.ns_schedule, muon.ns_steps, muon.nesterov, muon.momentum) == ("paper", 5, False, 0.9)
    # K = 1: the paper's outer Nesterov SGD, lr 0.7 and momentum 0.6.
    assert (config.muloco.outer_lr, config.muloco.outer_momentum, config.muloco.nesterov) == (0.7, 0.6, True)
