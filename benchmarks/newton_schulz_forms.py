"""Newton-Schulz time, Gram form over standard form, per matrix shape class of model presets.

Each preset's Muon matrices fall in three shape classes (multi-head attention, the paper's presets):
square (Q, K, V, O: h x h), tall (gate, up: f x h) and wide (down: h x f). For one matrix of each
class, both forms orthogonalize the same random matrix (Gaussian, like an early gradient; the error
columns also take an ill-conditioned one, singular values 1 down to 1e-4, where bf16 hurts most);
the time is the minimum over --repeats calls, both forms timed in turn in this one process: on CPU
the process's CPU time (one intra-op thread by default, so a machine shared with other work does not
stretch one form's calls more than the other's), on CUDA wall time between synchronizations. Printed
per row: seconds of each form, gram / standard, the FLOP ratio of trainer.optim.newton_schulz's
count, the form `auto` picks, and ||gram - standard|| / ||standard|| (and for bf16 each form's
distance from the fp32 standard result, which says whether the Gram form's bf16 error is the
standard form's).

    python benchmarks/newton_schulz_forms.py [--presets 150m 15b] [--dtype bfloat16] [--repeats 3]
        [--device cuda]
    python benchmarks/newton_schulz_forms.py --restart-sweep [--presets 150m]

--restart-sweep measures why the Gram form restarts: per shape class and Gram segment length (2, 3,
4, and 5 = no restart in 5 steps), the bf16 Gram result's distance from the fp32 standard one, on a
Gaussian and an ill-conditioned matrix, next to the bf16 standard form's distance.

At 15b one fp32 call takes about a minute and a half on one CPU core, so rows of presets at least
LARGE_HIDDEN wide run --repeats-large times (1 by default) and, on CPU, skip the ill-conditioned and
fp32-reference columns (three more calls each; the 150m rows have them). The last line printed is a
JSON summary.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch


from trainer.model.presets import PRESETS, ModelShape
from trainer.optim import newton_schulz
from trainer.optim.newton_schulz import (
    DEFAULT_SCHEDULE,
    DEFAULT_STEPS,
    NS_DTYPES,
    newton_schulz_flops,
    orthogonalize,
    resolve_form,
)

# Presets at least this wide are timed --repeats-large times (a call takes seconds to minutes on CPU).
LARGE_HIDDEN = 4096


@dataclass
class FormTiming:
    preset: str
    shape_class: str
    shape: tuple[int, int]
    dtype: str
    repeats: int
    standard_s: float
    gram_s: float
    gram_over_standard: float
    flop_ratio: float  # gram FLOPs / standard FLOPs
    auto_picks: str
    relative_difference: float  # ||gram - standard|| / ||standard||, Gaussian input
    relative_difference_ill_conditioned: float | None  # None: skipped (a large preset on CPU)
    standard_error_vs_fp32: float | None  # bf16 only: each form's distance from the fp32 standard result
    gram_error_vs_fp32: float | None

    def seconds(self, form: str) -> float:
        """One call's seconds in `form` (`auto`: the form it picks for this shape)."""
        form = self.auto_picks if form == "auto" else form
        return self.standard_s if form == "standard" else self.gram_s


def shape_classes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """One (rows, cols) per shape class of the preset's logical Muon matrices."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return {"square": (h, shape.num_attention_heads * shape.kv_channels), "tall": (f, h), "wide": (h, f)}


def ill_conditioned(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Singular values log-spaced from 1 to 1e-4 (random singular vectors)."""
    m, n = shape
    k = min(shape)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=generator))
    return (U * torch.logspace(0, -4, k)) @ V.T


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.norm(x.double() - reference.double()) / torch.linalg.norm(reference.double()))


def timed(M: torch.Tensor, dtype: torch.dtype, form: str) -> tuple[torch.Tensor, float]:
    """The result and its seconds: CPU time of this process on CPU, wall time on CUDA."""
    clock = time.perf_counter if M.is_cuda else time.process_time
    if M.is_cuda:
        torch.cuda.synchronize(M.device)
    start = clock()
    out = orthogonalize(M, DEFAULT_SCHEDULE, DEFAULT_STEPS, dtype=dtype, form=form)
    if M.is_cuda:
        torch.cuda.synchronize(M.device)
    return out, clock() - start


def benchmark_shape(preset: str, shape_class: str, shape: tuple[int, int], dtype: str, repeats: int,
                    device: torch.device, accuracy: bool = True) -> FormTiming:
    """Both forms timed on one Gaussian matrix; with `accuracy` also the ill-conditioned difference
    and, in bf16, each form's distance from the fp32 result."""
    generator = torch.Generator().manual_seed(0)
    M = torch.randn(shape, generator=generator).to(device)
    compute = NS_DTYPES[dtype]
    best = {"standard": float("inf"), "gram": float("inf")}
    outs = {}
    for _ in range(repeats):
        for form in best:  # in turn, so both see the same machine load
            outs[form], seconds = timed(M, compute, form)
            best[form] = min(best[form], seconds)
    ill_difference, errors = None, (None, None)
    if accuracy:
        ill = ill_conditioned(shape, generator).to(device)
        ill_difference = round(relative(orthogonalize(ill, dtype=compute, form="gram"),
                                        orthogonalize(ill, dtype=compute, form="standard")), 6)
    if accuracy and dtype != "float32":
        exact = orthogonalize(M, dtype=torch.float32, form="standard")
        errors = (round(relative(outs["standard"], exact), 5), round(relative(outs["gram"], exact), 5))
    flops = {form: newton_schulz_flops(shape, DEFAULT_STEPS, form) for form in best}
    return FormTiming(
        preset=preset, shape_class=shape_class, shape=shape, dtype=dtype, repeats=repeats,
        standard_s=round(best["standard"], 4), gram_s=round(best["gram"], 4),
        gram_over_standard=round(best["gram"] / best["standard"], 3),
        flop_ratio=round(flops["gram"] / flops["standard"], 3),
        auto_picks=resolve_form("auto", shape, DEFAULT_STEPS),
        relative_difference=round(relative(outs["gram"], outs["standard"]), 6),
        relative_difference_ill_conditioned=ill_difference,
        standard_error_vs_fp32=errors[0], gram_error_vs_fp32=errors[1])


def restart_sweep(presets: list[str], device: torch.device) -> list[dict]:
    """bf16 distance from the fp32 standard result per Gram segment length (see the module docstring)."""
    rows = []
    print("| preset | class | input | standard bf16 | " + " | ".join(f"gram bf16, segments of {n}" for n in (2, 3, 4, 5))
          + " |\n" + "|---" * 8 + "|")
    for preset in presets:
        for shape_class, shape in shape_classes(PRESETS[preset]).items():
            generator = torch.Generator().manual_seed(0)
            for kind, M in (("gaussian", torch.randn(shape, generator=generator)),
                            ("ill-conditioned", ill_conditioned(shape, generator))):
                M = M.to(device)
                exact = orthogonalize(M, dtype=torch.float32)
                row = {"preset": preset, "shape_class": shape_class, "input": kind,
                       "standard": round(relative(orthogonalize(M, dtype=torch.bfloat16), exact), 5)}
                kept = newton_schulz.GRAM_RESTART_STEPS
                try:
                    for steps in (2, 3, 4, 5):
                        newton_schulz.GRAM_RESTART_STEPS = steps
                        row[f"gram_segments_of_{steps}"] = round(
                            relative(orthogonalize(M, dtype=torch.bfloat16, form="gram"), exact), 5)
                finally:
                    newton_schulz.GRAM_RESTART_STEPS = kept
                rows.append(row)
                print(f"| {preset} | {shape_class} | {kind} | {row['standard']:.2e} | "
                      + " | ".join(f"{row[f'gram_segments_of_{n}']:.2e}" for n in (2, 3, 4, 5)) + " |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["150m", "15b"], choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32", choices=sorted(NS_DTYPES))
    parser.add_argument("--repeats", type=int, default=3, help="calls per form and shape; the fastest counts")
    parser.add_argument("--repeats-large", type=int, default=1,
                        help=f"the same for presets of hidden size >= {LARGE_HIDDEN}")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--restart-sweep", action="store_true", help="bf16 error per Gram segment length instead")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.restart_sweep:
        print(json.dumps({"device": str(device), "restart_sweep": restart_sweep(args.presets, device)}))
        return

    for form in ("standard", "gram"):  # warm the matmul backend and each form's first call
        timed(torch.randn(64, 160, device=device), NS_DTYPES[args.dtype], form)
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} CPU threads, {args.dtype}, "
          f"{DEFAULT_SCHEDULE} schedule, {DEFAULT_STEPS} steps; seconds: {'wall' if device.type == 'cuda' else 'CPU'}")
    rows = []
    print("| preset | class | shape | standard s | gram s | gram / standard | FLOP ratio | auto | rel. diff "
          "| rel. diff (ill-cond.) |" + (" standard vs fp32 | gram vs fp32 |" if args.dtype != "float32" else ""))
    print("|---" * (10 if args.dtype == "float32" else 12) + "|")
    for preset in args.presets:
        shape = PRESETS[preset]
        large = shape.hidden_size >= LARGE_HIDDEN
        repeats = args.repeats_large if large else args.repeats
        for shape_class, matrix in shape_classes(shape).items():
            r = benchmark_shape(preset, shape_class, matrix, args.dtype, repeats, device,
                                accuracy=not (large and device.type == "cpu"))
            rows.append(r)
            errors = "".join(f" {e:.2e} |" if e is not None else " - |"
                             for e in (r.standard_error_vs_fp32, r.gram_error_vs_fp32)) if args.dtype != "float32" else ""
            ill = r.relative_difference_ill_conditioned
            print(f"| {preset} | {shape_class} | {matrix[0]}x{matrix[1]} | {r.standard_s:.4f} | {r.gram_s:.4f} | "
                  f"{r.gram_over_standard:.3f} | {r.flop_ratio:.3f} | {r.auto_picks} | {r.relative_difference:.1e} | "
                  f"{'-' if ill is None else f'{ill:.1e}'} |{errors}", flush=True)
    print(json.dumps({"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "rows": [asdict(r) for r in rows]}))


if __name__ == "__main__":
    main()
