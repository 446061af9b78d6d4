"""Newton-Schulz time with matrix ownership versus one rank orthogonalizing every matrix.

For the logical Muon matrices of a preset (per layer: Q, K, V, O, gate, up, down), plans
ownership over N owners (the T*D ranks that share the work) by Newton-Schulz FLOPs. Each matrix's
orthogonalization is timed in this one process (the minimum of --repeats runs, which filters out
noise from other work on the machine); one rank doing every matrix (the no-ownership baseline)
takes the sum of all of them, an owner the sum of its own. The slowest owner bounds the step, so
speedup = baseline / slowest owner (ideal: N / FLOP imbalance).

    python benchmarks/muon_ownership.py [--preset 150m 1.76b] [--layers L] [--owners 2 4 8]

The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model.presets import PRESETS, ModelShape  # noqa: E402
from trainer.optim.newton_schulz import NAMED_SCHEDULES, NS_DTYPES, newton_schulz_flops, orthogonalize  # noqa: E402
from trainer.optim.ownership import OwnershipPlan  # noqa: E402

# A 1.76b layer takes about a minute of Newton-Schulz on 2 CPU cores, so by default presets wider
# than this are cut to one layer.
FULL_DEPTH_MAX_HIDDEN = 1024


@dataclass
class OwnershipTiming:
    preset: str
    layers: int
    owners: int
    matrices: int
    slowest_owner_matrices: int
    imbalance: float  # busiest owner's FLOPs / mean FLOPs
    baseline_s: float  # one rank, every matrix
    slowest_owner_s: float
    speedup: float
    ideal_speedup: float  # owners / imbalance


def logical_matrix_shapes(shape: ModelShape, layers: int) -> list[tuple[int, int]]:
    """(rows, cols) of every Muon matrix: Q, K, V, O, gate, up, down per layer, as separate matrices."""
    q_rows = shape.num_attention_heads * shape.kv_channels
    kv_rows = shape.query_groups * shape.kv_channels
    h, f = shape.hidden_size, shape.ffn_hidden_size
    per_layer = [(q_rows, h), (kv_rows, h), (kv_rows, h), (h, q_rows), (f, h), (f, h), (h, f)]
    return per_layer * layers


def default_layers(shape: ModelShape) -> int:
    return shape.num_layers if shape.hidden_size <= FULL_DEPTH_MAX_HIDDEN else 1


def time_each_matrix(
    matrices: list[torch.Tensor], schedule: str, steps: int, dtype: torch.dtype, repeats: int
) -> list[float]:
    """Wall seconds to orthogonalize each matrix, the minimum over `repeats` runs."""
    best = [float("inf")] * len(matrices)
    for _ in range(repeats):
        for i, m in enumerate(matrices):
            start = time.perf_counter()
            orthogonalize(m, schedule=schedule, steps=steps, dtype=dtype)
            if m.is_cuda:
                torch.cuda.synchronize(m.device)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def benchmark_preset(
    preset: str, layers: int, owner_counts: list[int], schedule: str, steps: int, dtype: torch.dtype,
    repeats: int, device: torch.device,
) -> list[OwnershipTiming]:
    shapes = logical_matrix_shapes(PRESETS[preset], layers)
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(s, generator=generator).to(device) for s in shapes]
    seconds = time_each_matrix(matrices, schedule, steps, dtype, repeats)
    baseline_s = sum(seconds)
    plans = [OwnershipPlan.build([newton_schulz_flops(s, steps) for s in shapes], owners) for owners in owner_counts]
    results = []
    for plan in plans:
        owner_seconds = [sum(seconds[i] for i in plan.items_of(rank)) for rank in range(plan.num_owners)]
        slowest = max(range(plan.num_owners), key=lambda rank: owner_seconds[rank])
        results.append(
            OwnershipTiming(
                preset=preset, layers=layers, owners=plan.num_owners, matrices=len(matrices),
                slowest_owner_matrices=len(plan.items_of(slowest)), imbalance=round(plan.imbalance, 4),
                baseline_s=round(baseline_s, 4), slowest_owner_s=round(owner_seconds[slowest], 4),
                speedup=round(baseline_s / owner_seconds[slowest], 3),
                ideal_speedup=round(plan.num_owners / plan.imbalance, 3),
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["150m", "1.76b"], choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers to include (default: all up to hidden {FULL_DEPTH_MAX_HIDDEN}, else 1)")
    parser.add_argument("--owners", type=int, nargs="+", default=[2, 4, 8], help="owner counts (T*D)")
    parser.add_argument("--schedule", default="paper", choices=sorted(NAMED_SCHEDULES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=sorted(NS_DTYPES))
    parser.add_argument("--repeats", type=int, default=1, help="time each matrix this many times, keep the fastest")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    args = parser.parse_args()
    device = torch.device(args.device)

    # Warm up the matmul backend so the first timed matrix does not pay for its start-up.
    time_each_matrix([torch.randn(64, 128, device=device)], args.schedule, 1, NS_DTYPES[args.dtype], 1)
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} CPU threads, schedule "
          f"{args.schedule}, {args.steps} steps, {args.dtype}, min of {args.repeats} run(s) per matrix")
    results: list[OwnershipTiming] = []
    for preset in args.preset:
        total_layers = PRESETS[preset].num_layers
        layers = min(args.layers or default_layers(PRESETS[preset]), total_layers)
        if layers < total_layers:
            print(f"{preset}: timing {layers} of {total_layers} layers to keep CPU time short (--layers to change)")
        timings = benchmark_preset(
            preset, layers, args.owners, args.schedule, args.steps, NS_DTYPES[args.dtype], args.repeats, device
        )
        for r in timings:
            print(f"{r.preset:>6} layers={r.layers:<2} owners={r.owners}: slowest owner {r.slowest_owner_matrices}"
                  f"/{r.matrices} matrices {r.slowest_owner_s:.3f}s vs all {r.baseline_s:.3f}s -> speedup "
                  f"{r.speedup:.2f}x (ideal {r.ideal_speedup:.2f}x, FLOP imbalance {r.imbalance:.3f})")
            results.append(r)
    print(json.dumps({"benchmark": "muon_ownership", "results": [asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
