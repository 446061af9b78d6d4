"""Single-process Muon math: Newton-Schulz, the Muon step against torch.optim.Muon, and ownership."""
import json

import pytest
import torch

from trainer.optim.muon import Muon, MuonConfig, apply_update, lr_scale, update_momentum
from trainer.optim import newton_schulz
from trainer.optim.newton_schulz import (
    KELLER_SCHEDULE,
    PAPER_SCHEDULE,
    newton_schulz_flops,
    newton_schulz_workspace_numel,
    orthogonalize,
    resolve_form,
    resolve_schedule,
)
from muloco.core.ownership import OwnershipPlan, assign_owners

SHAPES = [(24, 40), (40, 24), (32, 32)]  # wide, tall, square; small enough for CPU bf16 matmuls
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _step_both(our_opt, their_opt, ours, theirs, g: torch.Generator, steps: int = 4) -> None:
    """Both optimizers take `steps` steps on the same random gradients."""
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        our_opt.step()
        their_opt.step()


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These matrices are tiny: one thread avoids OpenMP spin-waits on a busy, shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def torch_muon_in_fp32(monkeypatch):
    """torch.optim.Muon always casts to bfloat16 before Newton-Schulz (`grad.bfloat16()`); lifting
    that cast lets its own algorithm be compared with ours to fp32 tolerance."""
    # A copy, as the real cast makes: torch divides the result in place, and without Nesterov the
    # input is its momentum buffer.
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self: self.to(torch.float32, copy=True))


def _reference_newton_schulz(M: torch.Tensor, triples, eps: float = 1e-7) -> torch.Tensor:
    """Independent float64 loop: normalize, transpose tall to wide, iterate, transpose back."""
    X = M.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.linalg.norm(X) + eps)
    for a, b, c in triples:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def _polynomial_map(sigma: torch.Tensor, triples) -> torch.Tensor:
    """Newton-Schulz acts on each singular value by the scalar map s -> a s + b s^3 + c s^5."""
    for a, b, c in triples:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


def _matrix_with_singular_values(shape, sigma: torch.Tensor, seed: int) -> torch.Tensor:
    m, n = shape
    g = _generator(seed)
    U, _ = torch.linalg.qr(torch.randn(m, len(sigma), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, len(sigma), generator=g, dtype=torch.float64))
    return (U * sigma) @ V.T


# ---------------------------------------------------------------- Newton-Schulz vs torch.optim.Muon


def _first_steps_from_zero(G: torch.Tensor, ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step from W = 0 with lr 1 and no momentum or decay: torch.optim.Muon on gradient G, and
    our orthogonalized G through the same ('original') lr scaling."""
    W = torch.nn.Parameter(torch.zeros_like(G))
    W.grad = G.clone()
    torch.optim.Muon([W], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0).step()
    expected = torch.zeros_like(G)
    apply_update(expected, ours, lr=1.0, weight_decay=0.0, scale=lr_scale(G.shape, "torch_original"))
    return W.detach(), expected


@pytest.mark.parametrize("shape", SHAPES)
def test_keller_bf16_is_bitwise_torch(shape):
    G = torch.randn(shape, generator=_generator(1))
    ours = orthogonalize(G, schedule="keller", steps=5, dtype=torch.bfloat16)
    torch.testing.assert_close(*_first_steps_from_zero(G, ours), rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_keller_fp32_matches_torch_algorithm(shape, torch_muon_in_fp32):
    G = torch.randn(shape, generator=_generator(2))
    ours = orthogonalize(G, schedule="keller", steps=5, dtype=torch.float32)
    torch.testing.assert_close(*_first_steps_from_zero(G, ours), **FP32_TOL)


@pytest.mark.parametrize(
    "momentum, nesterov, torch_adjust, our_scaling, weight_decay",
    [
        (0.95, True, "match_rms_adamw", "match_rms_adamw", 0.1),
        (0.9, False, "original", "torch_original", 0.01),
        (0.9, True, None, "torch_original", 0.0),
    ],
)
def test_muon_matches_torch_over_steps(momentum, nesterov, torch_adjust, our_scaling, weight_decay, torch_muon_in_fp32):
    g = _generator(3)
    init = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    theirs = [torch.nn.Parameter(w.clone()) for w in init]
    config = MuonConfig(momentum=momentum, nesterov=nesterov, ns_schedule="keller", lr_scaling=our_scaling)
    our_opt = Muon(ours, config, lr=0.02, weight_decay=weight_decay)
    their_opt = torch.optim.Muon(
        theirs, lr=0.02, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, adjust_lr_fn=torch_adjust
    )
    _step_both(our_opt, their_opt, ours, theirs, g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), **FP32_TOL)
        # torch keeps the moving average (1-mu)*M where we keep the sum M.
        torch.testing.assert_close(
            our_opt.state[a]["momentum_buffer"] * (1 - momentum), their_opt.state[b]["momentum_buffer"], **FP32_TOL
        )


def test_muon_bf16_tracks_stock_torch():
    # Stock torch runs Newton-Schulz in bf16 on the averaged buffer (1-mu)*M: bf16 rounds that
    # differently from M, so agreement is to bf16 level (lr 0.02 moves weights ~4e-3 per step).
    g = _generator(17)
    init = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    theirs = [torch.nn.Parameter(w.clone()) for w in init]
    config = MuonConfig(momentum=0.95, nesterov=True, ns_schedule="keller", ns_dtype="bfloat16",
                        lr_scaling="torch_original")
    our_opt, their_opt = Muon(ours, config, lr=0.02, weight_decay=0.1), torch.optim.Muon(theirs, lr=0.02)  # torch's defaults
    _step_both(our_opt, their_opt, ours, theirs, g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-3)


# ---------------------------------------------------------------- Newton-Schulz properties


@pytest.mark.parametrize("shape", SHAPES + [(8, 64), (64, 8)])
def test_paper_schedule_matches_reference_loop(shape):
    M = torch.randn(shape, generator=_generator(4))
    torch.testing.assert_close(orthogonalize(M).double(), _reference_newton_schulz(M, PAPER_SCHEDULE), **FP32_TOL)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("schedule", ["paper", "keller"])
def test_singular_values_follow_the_scalar_polynomial(shape, schedule):
    sigma_in = torch.logspace(-2.5, 0, min(shape), dtype=torch.float64)
    M = _matrix_with_singular_values(shape, sigma_in, seed=5).float()
    normalized = sigma_in / torch.linalg.norm(sigma_in)
    expected = _polynomial_map(normalized, resolve_schedule(schedule, 5)).sort().values
    got = torch.linalg.svdvals(orthogonalize(M, schedule=schedule).double()).sort().values
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule, band", [("paper", (0.9, 1.15)), ("keller", (0.5, 1.25))])
def test_output_singular_values_near_one(schedule, band):
    # Every input singular value >= 3e-3 of the Frobenius norm lands in the band (from the
    # scalar map); the paper's schedule is much tighter than Keller's (0.68..1.2 in practice).
    sigma_in = torch.linspace(1.0, 0.1, 24, dtype=torch.float64)
    M = _matrix_with_singular_values((40, 64), sigma_in, seed=6).float()
    s = torch.linalg.svdvals(orthogonalize(M, schedule=schedule))[: len(sigma_in)]  # rank 24
    assert band[0] <= s.min() and s.max() <= band[1], (s.min(), s.max())


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_close_to_fp32(shape):
    M = torch.randn(shape, generator=_generator(7))
    fp32 = orthogonalize(M, dtype=torch.float32)
    bf16 = orthogonalize(M, dtype="bfloat16")
    assert bf16.dtype == torch.float32
    assert torch.linalg.norm(bf16 - fp32) / torch.linalg.norm(fp32) < 0.02


def test_batched_equals_per_matrix():
    batch = torch.randn(3, 40, 24, generator=_generator(8))
    expected = torch.stack([orthogonalize(m) for m in batch])
    torch.testing.assert_close(orthogonalize(batch), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_input_untouched_and_dtype_kept(dtype):
    # float32 input needs no cast, so this also checks nothing is done in place on the input
    # (without Nesterov the input is the momentum buffer).
    M = torch.randn(24, 16, generator=_generator(9)).to(dtype)
    before = M.clone()
    out = orthogonalize(M)
    assert out.dtype == dtype and out.shape == M.shape
    assert torch.equal(M, before)


def test_schedule_repeats_last_triple():
    assert resolve_schedule("paper", 7) == list(PAPER_SCHEDULE) + [PAPER_SCHEDULE[-1]] * 2
    assert resolve_schedule("keller", 3) == list(KELLER_SCHEDULE) * 3
    assert resolve_schedule("paper", 2) == list(PAPER_SCHEDULE[:2])
    M = torch.randn(16, 24, generator=_generator(10))
    explicit = [list(t) for t in PAPER_SCHEDULE] + [list(PAPER_SCHEDULE[-1])]
    torch.testing.assert_close(orthogonalize(M, steps=6), orthogonalize(M, schedule=explicit, steps=6))


def test_flops():
    assert newton_schulz_flops((64, 16), 5) == 5 * (4 * 16 * 16 * 64 + 2 * 16**3)
    assert newton_schulz_flops((16, 64), 5) == newton_schulz_flops((64, 16), 5)
    assert newton_schulz_flops((3, 16, 64), 5) == 3 * newton_schulz_flops((16, 64), 5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(M=torch.randn(8)), "matrix or a batch"),
        (dict(schedule="nope"), "unknown Newton-Schulz schedule"),
        (dict(schedule=[(1.0, 2.0)]), r"\(a, b, c\)"),
        (dict(schedule=[]), "at least one"),
        (dict(steps=0), "positive int"),
        (dict(dtype=torch.float16), "float32 or bfloat16"),
        (dict(dtype="fp8"), "unknown Newton-Schulz dtype"),
        (dict(eps=0.0), "eps must be positive"),
    ],
)
def test_orthogonalize_validation(kwargs, message):
    kwargs.setdefault("M", torch.randn(4, 6))
    with pytest.raises(ValueError, match=message):
        orthogonalize(**kwargs)


# ---------------------------------------------------------------- the Gram form

GRAM_SHAPES = SHAPES + [(8, 64), (64, 8), (48, 128), (96, 96)]


def _relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.norm(x.double() - reference.double()) / torch.linalg.norm(reference.double()))


def _ill_conditioned(shape, seed: int) -> torch.Tensor:
    """Singular values from 1 down to 1e-4: Q reaches the schedule's full gain on the small ones."""
    return _matrix_with_singular_values(shape, torch.logspace(0, -4, min(shape), dtype=torch.float64), seed).float()


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("schedule, steps", [("paper", 5), ("keller", 5), ("paper", 1), ("paper", 3), ("paper", 7)])
def test_gram_equals_standard_in_fp32(shape, schedule, steps):
    # Steps 1, 3 and 7 end a segment early, exactly at a restart, and after two restarts.
    M = torch.randn(shape, generator=_generator(20))
    standard = orthogonalize(M, schedule=schedule, steps=steps, form="standard")
    torch.testing.assert_close(orthogonalize(M, schedule=schedule, steps=steps, form="gram"), standard, **FP32_TOL)
    assert _relative(orthogonalize(_ill_conditioned(shape, 21), steps=steps, form="gram"),
                     orthogonalize(_ill_conditioned(shape, 21), steps=steps)) < 1e-4


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("make", [lambda s: torch.randn(s, generator=_generator(22)), lambda s: _ill_conditioned(s, 23)],
                         ids=["gaussian", "ill_conditioned"])
def test_gram_in_bf16_is_as_close_to_fp32_as_standard(shape, make):
    # bf16 rounding moves either form's result off the fp32 one; the Gram form's distance stays
    # within a small factor of the standard form's (measured: 0.9x to 2x).
    M = make(shape)
    exact = orthogonalize(M, dtype="float32")
    standard = _relative(orthogonalize(M, dtype="bfloat16"), exact)
    gram = _relative(orthogonalize(M, dtype="bfloat16", form="gram"), exact)
    assert gram <= 3 * standard, (gram, standard)


def test_gram_in_bf16_needs_its_restarts(monkeypatch):
    # Without restarts (one segment of 5 steps) bf16 cannot hold Q's gain of ~500: the result is
    # wrong by more than its own size; with them it is within bf16's reach of the fp32 result.
    M = _ill_conditioned((48, 128), seed=24)
    exact = orthogonalize(M)
    assert _relative(orthogonalize(M, dtype="bfloat16", form="gram"), exact) < 0.2
    monkeypatch.setattr(newton_schulz, "GRAM_RESTART_STEPS", 5)
    assert _relative(orthogonalize(M, dtype="bfloat16", form="gram"), exact) > 1.0


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_matches_torch_muon_in_fp32(shape, torch_muon_in_fp32):
    G = torch.randn(shape, generator=_generator(25))
    ours = orthogonalize(G, schedule="keller", steps=5, form="gram")
    torch.testing.assert_close(*_first_steps_from_zero(G, ours), **FP32_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_in_bf16_tracks_stock_torch_muon(shape):
    # torch.optim.Muon's own (bf16) step: ours in bf16 Gram form is no further from it than a small
    # multiple of torch's own distance from the exact (fp32) result.
    G = torch.randn(shape, generator=_generator(26))
    torch_step, gram_step = _first_steps_from_zero(G, orthogonalize(G, schedule="keller", dtype="bfloat16", form="gram"))
    _, exact_step = _first_steps_from_zero(G, orthogonalize(G, schedule="keller"))
    assert _relative(gram_step, torch_step) <= 3 * _relative(torch_step, exact_step)


def test_gram_batched_equals_per_matrix():
    batch = torch.randn(3, 40, 24, generator=_generator(27))
    expected = torch.stack([orthogonalize(m, form="gram") for m in batch])
    torch.testing.assert_close(orthogonalize(batch, form="gram"), expected, rtol=1e-6, atol=1e-6)


def test_gram_flops_and_auto():
    m, n = 16, 64  # one segment of 3 steps and one of 2: 4 m^2 n each, 9 + 5 m x m matmuls
    assert newton_schulz_flops((n, m), 5, "gram") == 2 * 4 * m * m * n + 2 * (9 + 5) * m**3
    assert newton_schulz_flops((2, m, n), 3, "gram") == 2 * (4 * m * m * n + 2 * 9 * m**3)
    # Gram wins once the long side exceeds 1.5 x the short one at 5 steps: every preset's MLP
    # matrices (aspect 2.75), not its square ones.
    assert resolve_form("auto", (1408, 512), 5) == resolve_form("auto", (512, 1408), 5) == "gram"
    assert resolve_form("auto", (512, 512), 5) == resolve_form("auto", (512, 700), 5) == "standard"
    assert newton_schulz_flops((512, 512), 5, "auto") == newton_schulz_flops((512, 512), 5)
    assert newton_schulz_flops((1408, 512), 5, "auto") == newton_schulz_flops((1408, 512), 5, "gram")
    # Workspace: X's cast, normalized copy and next iterate, plus A, B (standard) or R, P, Q, P R, P R P (Gram).
    assert newton_schulz_workspace_numel((1408, 512), 5, "standard") == 3 * 1408 * 512 + 2 * 512**2
    assert newton_schulz_workspace_numel((1408, 512), 5, "auto") == 3 * 1408 * 512 + 5 * 512**2
    assert newton_schulz_workspace_numel((512, 512), 5, "auto") == 3 * 512 * 512 + 2 * 512**2
    with pytest.raises(ValueError, match="unknown Newton-Schulz form 'fast'"):
        orthogonalize(torch.randn(4, 6), form="fast")


# ---------------------------------------------------------------- Muon step pieces


def test_update_momentum_sum_form_and_nesterov():
    g1, g2 = torch.randn(2, 4, 6, generator=_generator(11))
    buf = torch.zeros(4, 6)
    assert update_momentum(buf, g1, 0.9, nesterov=False) is buf
    direction = update_momentum(buf, g2, 0.9, nesterov=False)
    torch.testing.assert_close(direction, 0.9 * g1 + g2)
    buf = g1.clone()
    direction = update_momentum(buf, g2, 0.9, nesterov=True)
    torch.testing.assert_close(buf, 0.9 * g1 + g2)
    torch.testing.assert_close(direction, g2 + 0.9 * (0.9 * g1 + g2))


def test_update_momentum_stored_in_bf16_sums_in_fp32():
    g1, g2 = torch.randn(2, 4, 6, generator=_generator(18))
    buf = g1.to(torch.bfloat16)
    total = buf.float() * 0.9 + g2  # the fp32 sum from the stored (rounded) buffer
    direction = update_momentum(buf, g2, 0.9, nesterov=False)
    assert direction.dtype == torch.float32 and torch.equal(direction, total)
    assert buf.dtype == torch.bfloat16 and torch.equal(buf, total.to(torch.bfloat16))  # rounded to nearest
    buf = g1.to(torch.bfloat16)
    torch.testing.assert_close(update_momentum(buf, g2, 0.9, nesterov=True), g2 + 0.9 * total)


def test_muon_with_bf16_momentum_stays_near_fp32_momentum():
    # The buffer's rounding (2^-9 relative) is the only difference; Newton-Schulz dampens it.
    g = _generator(19)
    init = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon(params, MuonConfig(momentum_dtype=dtype), lr=0.02, weight_decay=0.1)
        grads = torch.Generator().manual_seed(0)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            opt.step()
        assert all(opt.state[p]["momentum_buffer"].dtype == getattr(torch, dtype) for p in params)
        runs[dtype] = params
    for a, b, w0 in zip(runs["float32"], runs["bfloat16"], init):
        assert 0 < _relative(b.detach() - w0, a.detach() - w0) < 1e-2


def test_lr_scale_modes():
    assert lr_scale((2048, 512), "spectral_norm") == 2.0
    assert lr_scale((512, 2048), "spectral_norm") == 0.5
    assert lr_scale((512, 2048), "match_rms_adamw") == pytest.approx(0.2 * 2048**0.5)
    assert lr_scale((2048, 512), "torch_original") == 2.0
    assert lr_scale((512, 2048), "torch_original") == 1.0
    assert lr_scale((512, 2048), "none") == 1.0
    with pytest.raises(ValueError, match="unknown lr scaling"):
        lr_scale((4, 4), "bogus")


def test_apply_update_identities():
    W0 = torch.randn(4, 6, generator=_generator(12))
    O = torch.randn(4, 6, generator=_generator(13))
    W = W0.clone()
    apply_update(W, torch.zeros_like(O), lr=0.1, weight_decay=0.5, scale=3.0)  # decay uses unscaled lr
    torch.testing.assert_close(W, W0 * (1 - 0.05))
    W = W0.clone()
    apply_update(W, O, lr=0.1, weight_decay=0.0, scale=3.0)
    torch.testing.assert_close(W, W0 - 0.3 * O)
    W = W0.clone()
    apply_update(W, O, lr=0.1, weight_decay=0.5, scale=3.0)  # decay first, then the step
    torch.testing.assert_close(W, W0 * 0.95 - 0.3 * O)


def test_muon_first_step_is_scaled_orthogonalized_gradient():
    W = torch.nn.Parameter(torch.randn(40, 24, generator=_generator(14)))
    W0 = W.detach().clone()
    W.grad = torch.randn(40, 24, generator=_generator(15))
    Muon([W], MuonConfig(), lr=0.05, weight_decay=0.1).step()
    expected = W0 * (1 - 0.05 * 0.1) - 0.05 * (40 / 24) ** 0.5 * orthogonalize(W.grad)
    torch.testing.assert_close(W.detach(), expected, **FP32_TOL)


def test_muon_param_group_overrides():
    a = torch.nn.Parameter(torch.zeros(8, 8))
    b = torch.nn.Parameter(torch.zeros(8, 8))
    opt = Muon([{"params": [a]}, {"params": [b], "lr": 0.0}], MuonConfig(), lr=0.1)
    a.grad = torch.randn(8, 8, generator=_generator(16))
    b.grad = a.grad.clone()
    opt.step()
    assert a.abs().sum() > 0 and torch.equal(b.detach(), torch.zeros(8, 8))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(momentum=1.0), r"^momentum must be in \[0, 1\), got 1\.0$"),
        (dict(nesterov=1), r"^nesterov must be a boolean, got 1$"),
        (dict(ns_schedule="fast"), r"^ns_schedule must be one of 'paper', 'keller' or a list, got 'fast'$"),
        (dict(ns_schedule=[(1.0, 2.0)]), r"^ns_schedule\[0\] must be a list of 3, got \[1\.0, 2\.0\]$"),
        (dict(ns_steps=0), r"^ns_steps must be >= 1, got 0$"),
        (dict(ns_dtype="float16"), r"^ns_dtype must be one of 'float32', 'bfloat16', got 'float16'$"),
        (dict(ns_form="fast"), r"^ns_form must be one of 'standard', 'gram', 'auto', got 'fast'$"),
        (dict(momentum_dtype="float16"), r"^momentum_dtype must be one of 'float32', 'bfloat16', got 'float16'$"),
        (dict(lr_scaling="sqrt"), r"^lr_scaling must be one of 'spectral_norm', "),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        MuonConfig(**overrides)


def test_explicit_schedule_triples_become_tuples():
    assert MuonConfig(ns_schedule=[[1, 2, 3]]).ns_schedule == ((1.0, 2.0, 3.0),)


def test_muon_rejects_non_matrices_and_bad_groups():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(8))], MuonConfig(), lr=0.1)
    with pytest.raises(ValueError, match="lr_scaling"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "lr_scaling": "x"}], MuonConfig(), lr=0.1)
    with pytest.raises(ValueError, match="lr and weight_decay must be >= 0"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], MuonConfig(), lr=-0.1)


# ---------------------------------------------------------------- ownership


def test_assign_owners_known_answers():
    assert assign_owners([5, 4, 3, 3, 3], 2) == [0, 1, 1, 0, 1]
    assert assign_owners([1.0] * 6, 3) == [0, 1, 2, 0, 1, 2]  # equal costs: round robin by index
    assert assign_owners([], 4) == []
    assert assign_owners([2.0, 1.0], 4) == [0, 1]
    # Ties in this round go to the owner that carries least from earlier rounds, then the lowest rank.
    assert assign_owners([2.0, 1.0], 4, tie_loads=[5.0, 0.0, 3.0, 0.0]) == [1, 3]
    assert assign_owners([5, 4, 3, 3, 3], 2, tie_loads=[1.0, 1.0]) == [0, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="tie_loads"):
        assign_owners([1.0], 2, tie_loads=[0.0])


@pytest.mark.parametrize("num_owners", [1, 2, 3, 8])
def test_assign_owners_balanced_complete_deterministic(num_owners):
    costs = [newton_schulz_flops(s, 5) for s in [(512, 512)] * 4 + [(1408, 512)] * 2 + [(512, 1408)]] * 6
    owners = assign_owners(costs, num_owners)
    assert owners == assign_owners(list(costs), num_owners)
    plan = OwnershipPlan.build(costs, num_owners)
    assert plan.owners == owners
    assert sorted(i for r in range(num_owners) for i in plan.items_of(r)) == list(range(len(costs)))
    assert sum(plan.loads) == pytest.approx(sum(costs))
    assert max(plan.loads) <= sum(costs) / num_owners + max(costs)
    assert plan.imbalance >= 1.0


def test_ownership_plan_round_trip():
    plan = OwnershipPlan.build([3.0, 1.0, 2.0, 2.5], 3)
    restored = OwnershipPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert restored == plan and restored.imbalance == plan.imbalance
    assert OwnershipPlan.build([0.0, 0.0], 2).imbalance == 1.0
    with pytest.raises(ValueError, match="outside"):
        OwnershipPlan.from_dict({"owners": [0, 3], "loads": [1.0, 1.0]})


@pytest.mark.parametrize("costs, num_owners", [([1.0], 0), ([-1.0], 2), ([float("nan")], 2), ([1.0], True)])
def test_assign_owners_validation(costs, num_owners):
    with pytest.raises(ValueError):
        assign_owners(costs, num_owners)
