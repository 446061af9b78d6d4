"""Newton-Schulz orthogonalization: the matrix function at the heart of Muon.

Maps a matrix M = U S V^T to approximately U V^T (singular values pushed towards 1) with a few
quintic polynomial steps, using only matmuls so it runs fast in low precision on accelerators.

Two forms compute the same polynomial of M. The standard form iterates on the m x n matrix X
(m <= n); the Gram form iterates on the m x m Gram matrix R = X X^T and accumulates the polynomial
Q of R, applying it to X once: since each step's factor P = a + b R + c R^2 is a polynomial of R,
X_k = Q_k X_0 and R_{k+1} = P R P. That trades 4 m^2 n per step for about 8 m^3, a gain for
rectangular matrices and a loss for square ones (`newton_schulz_flops`). Q grows up to the product
of the steps' a (about 500 for the paper's schedule) on the small singular directions, which half
precision cannot hold against the large ones: in bf16 a 5-step Gram iteration without restarts
returns errors of order 1 on ill-conditioned inputs. So the Gram form restarts every
GRAM_RESTART_STEPS steps (X = Q X and R recomputed from it), which bounds Q by 3 steps' a and keeps
its bf16 result about as close to the fp32 one as the standard form's: closer on ill-conditioned
inputs, within 2x on Gaussian ones (docs/performance.md has the measurements).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Coefficients = tuple[float, float, float]

# Per-step (a, b, c) triples used by the MuLoCo paper's runs.
PAPER_SCHEDULE: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
# Keller Jordan's fixed triple, applied at every step (what torch.optim.Muon uses).
KELLER_SCHEDULE: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

ScheduleName = Literal["paper", "keller"]
NAMED_SCHEDULES: dict[ScheduleName, tuple[Coefficients, ...]] = {
    "paper": PAPER_SCHEDULE,
    "keller": KELLER_SCHEDULE,
}

NSDtype = Literal["float32", "bfloat16"]
NS_DTYPES: dict[NSDtype, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# `auto`: per matrix, the form with fewer matmul FLOPs (Gram for rectangular, standard for square).
NSForm = Literal["standard", "gram", "auto"]
NS_FORMS: tuple[NSForm, ...] = ("standard", "gram", "auto")
# Steps of one Gram segment before X is re-formed: 3 measured best in bf16 among 2, 3, 4 and 5 (none
# in 5 steps; benchmarks/newton_schulz_forms.py --restart-sweep).
GRAM_RESTART_STEPS = 3

Schedule = str | Sequence[Sequence[float]]
# The paper's runs: its 5-step schedule; eps as torch.optim.Muon's.
DEFAULT_SCHEDULE: ScheduleName = "paper"
DEFAULT_STEPS = 5
EPS = 1e-7


def resolve_schedule(schedule: Schedule, steps: int) -> list[Coefficients]:
    """The (a, b, c) triple for each of `steps` iterations.

    `schedule` is a name from NAMED_SCHEDULES or an explicit list of triples. When `steps` exceeds
    the schedule's length the last triple is repeated (so a one-triple schedule is a fixed one);
    when it is shorter, only the first `steps` triples are used.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Newton-Schulz steps must be a positive int, got {steps!r}")
    if isinstance(schedule, str):
        if schedule not in NAMED_SCHEDULES:
            raise ValueError(
                f"unknown Newton-Schulz schedule {schedule!r}; "
                f"expected one of {sorted(NAMED_SCHEDULES)} or a list of (a, b, c) triples"
            )
        triples = list(NAMED_SCHEDULES[schedule])
    else:
        triples = []
        for triple in schedule:
            if len(triple) != 3:
                raise ValueError(f"each Newton-Schulz coefficient entry must be (a, b, c), got {triple!r}")
            triples.append(tuple(float(x) for x in triple))
        if not triples:
            raise ValueError("Newton-Schulz schedule must hold at least one (a, b, c) triple")
    return [triples[min(i, len(triples) - 1)] for i in range(steps)]


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The compute dtype, from a torch dtype or its config name ("float32" | "bfloat16")."""
    if isinstance(dtype, str):
        if dtype not in NS_DTYPES:
            raise ValueError(f"unknown Newton-Schulz dtype {dtype!r}; expected one of {sorted(NS_DTYPES)}")
        return NS_DTYPES[dtype]
    if dtype not in NS_DTYPES.values():
        raise ValueError(f"Newton-Schulz runs in float32 or bfloat16, got {dtype}")
    return dtype


def orthogonalize(
    M: Tensor,
    schedule: Schedule = DEFAULT_SCHEDULE,
    steps: int = DEFAULT_STEPS,
    eps: float = EPS,
    dtype: torch.dtype | str = torch.float32,
    form: NSForm = "standard",
) -> Tensor:
    """Approximately orthogonalize M (2-D), or each matrix of a batch of same-shaped matrices (3-D).

    X = M / (||M||_F + eps), computed in `dtype`, transposed first when rows > cols so the Gram
    matrix X X^T is the smaller one; then per step `A = X X^T; X = a X + (b A + c A A) X`, in the
    standard or the Gram `form` (the module docstring; `auto` picks per shape by `newton_schulz_flops`).
    Returns a new tensor of M's shape and dtype; M is not modified.

    With schedule="keller", steps=5, dtype=bfloat16 the standard form performs the same operations in
    the same order as torch.optim.Muon (which always computes in bfloat16). torch divides by
    max(||M||, eps) instead of ||M|| + eps; the two differ only when ||M|| is within a few eps of 0.
    """
    if M.dim() not in (2, 3):
        raise ValueError(f"orthogonalize expects a matrix or a batch of matrices, got shape {tuple(M.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    triples = resolve_schedule(schedule, steps)
    form = resolve_form(form, tuple(M.shape), steps)
    X = M.to(resolve_dtype(dtype))
    transposed = M.size(-2) > M.size(-1)
    if transposed:
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    X = _gram_iterate(X, triples) if form == "gram" else _standard_iterate(X, triples)
    if transposed:
        X = X.mT
    return X.to(M.dtype)


def _fused_matmul_add(X: Tensor):
    """addmm / baddbmm: the scale-and-add fused into the matmul (same signature for 2-D and 3-D)."""
    return torch.addmm if X.dim() == 2 else torch.baddbmm


def _standard_iterate(X: Tensor, triples: Sequence[Coefficients]) -> Tensor:
    mm_add = _fused_matmul_add(X)
    for a, b, c in triples:
        A = X @ X.mT
        B = mm_add(A, A, A, beta=b, alpha=c)
        X = mm_add(X, B, X, beta=a)
    return X


def _gram_iterate(X: Tensor, triples: Sequence[Coefficients]) -> Tensor:
    """The same iterates as `_standard_iterate`, on the Gram matrix, in segments of GRAM_RESTART_STEPS."""
    mm_add = _fused_matmul_add(X)
    for start in range(0, len(triples), GRAM_RESTART_STEPS):
        segment = triples[start:start + GRAM_RESTART_STEPS]
        R = X @ X.mT
        Q = None  # the segment's accumulated polynomial: X_now = Q X
        for k, (a, b, c) in enumerate(segment):
            P = mm_add(R, R, R, beta=b, alpha=c)
            P.diagonal(dim1=-2, dim2=-1).add_(a)  # P = a I + b R + c R^2
            Q = P if Q is None else P @ Q
            if k + 1 < len(segment):  # R of the next iterate: P R P
                R = P @ R @ P
        X = Q @ X
    return X


def resolve_form(form: str, shape: Sequence[int], steps: int) -> NSForm:
    """`standard` or `gram` for a matrix of `shape`: `auto` is the one with fewer matmul FLOPs."""
    if form not in NS_FORMS:
        raise ValueError(f"unknown Newton-Schulz form {form!r}; expected one of {list(NS_FORMS)}")
    if form != "auto":
        return form
    gram_cheaper = newton_schulz_flops(shape, steps, "gram") < newton_schulz_flops(shape, steps, "standard")
    return "gram" if gram_cheaper else "standard"


def newton_schulz_flops(shape: Sequence[int], steps: int, form: NSForm = "standard") -> float:
    """Matmul FLOPs of `orthogonalize` on a matrix (or batch of matrices) of `shape`.

    With m <= n the short and long side, an m x m matmul costs 2 m^3 and X X^T or Q X 2 m^2 n.
    Standard, per step: X X^T, A A and B X. Gram, per segment of L steps: X X^T and Q X once, and
    4 L - 3 m x m matmuls (R R every step, P Q after the first, P R P before the last). Elementwise work
    is ignored (it is O(m n) against O(m^2 n)); `auto` counts the form it picks.
    """
    if len(shape) < 2 or any(d < 0 for d in shape):
        raise ValueError(f"expected a matrix shape (optionally with leading batch dims), got {tuple(shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    m, n = sorted(shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= d
    if form == "auto":
        form = resolve_form(form, shape, steps) if steps else "standard"
    if form == "standard":
        return float(batch * steps * (4 * m * m * n + 2 * m**3))
    if form != "gram":
        raise ValueError(f"unknown Newton-Schulz form {form!r}; expected one of {list(NS_FORMS)}")
    segments = [min(GRAM_RESTART_STEPS, steps - s) for s in range(0, steps, GRAM_RESTART_STEPS)]
    return float(batch * sum(4 * m * m * n + 2 * (4 * L - 3) * m**3 for L in segments))


def newton_schulz_workspace_numel(shape: Sequence[int], steps: int, form: NSForm) -> int:
    """Peak elements `orthogonalize` allocates for one matrix (m <= n its sides), in its dtype:
    standard, X (the cast), its normalized copy and the next iterate (3 m n) and A, B (2 m^2);
    Gram, the same 3 m n (the next iterate is Q X) and R, P, Q with P R and the next R (5 m^2)."""
    m, n = sorted(shape[-2:])
    small = 5 if resolve_form(form, shape, steps) == "gram" else 2
    return 3 * m * n + small * m * m
