"""Newton-Schulz orthogonalization: the matrix function at the heart of Muon.

Maps a matrix M = U S V^T to approximately U V^T (singular values pushed towards 1) with a few
quintic polynomial steps, using only matmuls so it runs fast in low precision on accelerators.
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
) -> Tensor:
    """Approximately orthogonalize M (2-D), or each matrix of a batch of same-shaped matrices (3-D).

    X = M / (||M||_F + eps), computed in `dtype`, transposed first when rows > cols so the Gram
    matrix X X^T is the smaller one; then per step `A = X X^T; X = a X + (b A + c A A) X`.
    Returns a new tensor of M's shape and dtype; M is not modified.

    With schedule="keller", steps=5, dtype=bfloat16 this performs the same operations in the same
    order as torch.optim.Muon (which always computes in bfloat16). torch divides by
    max(||M||, eps) instead of ||M|| + eps; the two differ only when ||M|| is within a few eps of 0.
    """
    if M.dim() not in (2, 3):
        raise ValueError(f"orthogonalize expects a matrix or a batch of matrices, got shape {tuple(M.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    triples = resolve_schedule(schedule, steps)
    X = M.to(resolve_dtype(dtype))
    transposed = M.size(-2) > M.size(-1)
    if transposed:
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    # addmm / baddbmm fuse the scale-and-add into the matmul (same signature for 2-D and 3-D).
    fused_matmul_add = torch.addmm if X.dim() == 2 else torch.baddbmm
    for a, b, c in triples:
        A = X @ X.mT
        B = fused_matmul_add(A, A, A, beta=b, alpha=c)
        X = fused_matmul_add(X, B, X, beta=a)
    if transposed:
        X = X.mT
    return X.to(M.dtype)


def newton_schulz_flops(shape: Sequence[int], steps: int) -> float:
    """Matmul FLOPs of `orthogonalize` on a matrix (or batch of matrices) of `shape`.

    Per step, with m <= n the short and long side: X X^T and B X cost 2 m^2 n each, A A costs
    2 m^3. Elementwise work is ignored (it is O(m n) against O(m^2 n)).
    """
    if len(shape) < 2 or any(d < 0 for d in shape):
        raise ValueError(f"expected a matrix shape (optionally with leading batch dims), got {tuple(shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    m, n = sorted(shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return float(batch * steps * (4 * m * m * n + 2 * m**3))
