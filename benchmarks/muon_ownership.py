"""Newton-Schulz time with matrix ownership versus one rank orthogonalizing every matrix.

For the logical Muon matrices of a preset (per layer: Q, K, V, O, gate, up, down), takes the
ownership DistributedMuon uses over N owners (the T*D ranks that share the work: balanced by
Newton-Schulz FLOPs within each bucket, trainer.optim.muon_comm_model.MuonExchange). Each matrix's
orthogonalization is timed in this one process (the minimum of --repeats runs, which filters out
noise from other work on the machine); one rank doing every matrix (the no-ownership baseline)
takes the sum of all of them. Buckets run one after the other, so the step takes the sum over
buckets of the slowest owner's time in that bucket: speedup = baseline / that sum (ideal: N / FLOP
imbalance).

    python benchmarks/muon_ownership.py [--preset 150m 1.76b] [--layers L] [--owners 2 4 8]

The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch


from trainer.model.presets import PRESETS, ModelShape
from trainer.optim.newton_schulz import NAMED_SCHEDULES, NS_DTYPES, newton_schulz_flops, orthogonalize
from trainer.optim.muon_comm_model import DEFAULT_BUCKET_NUMEL, MuonExchange

# A 1.76b layer takes about a minute of Newton-Schulz on 2 CPU cores, so by default presets wider
# than this are cut to one layer.
FULL_DEPTH_MAX_HIDDEN = 1024


@dataclass
class OwnershipTiming:
    preset: str
    layers: int
    owners: int
    matrices: int
    buckets: int
    slowest_owner_matrices: int  # summed over buckets
    imbalance: float  # FLOP critical path (busiest owner per bucket, summed) x owners / all FLOPs
    baseline_s: float  # one rank, every matrix
    slowest_owner_s: float  # sum over buckets of the bucket's slowest owner
    speedup: float
    ideal_speedup: float  # owners / imbalance


def muon_parameters(shape: ModelShape, layers: int) -> tuple[list[str], list[tuple[int, int]]]:
    """Names and full (T=1) shapes of the hidden matrices: fused QKV, O, fused gate-up, down per layer."""
    qkv_rows = (shape.num_attention_heads + 2 * shape.query_groups) * shape.kv_channels
    h, f, o_cols = shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads * shape.kv_channels
    per_layer = [("self_attention.linear_qkv.weight", (qkv_rows, h)), ("self_attention.linear_proj.weight", (h, o_cols)),
                 ("mlp.linear_fc1.weight", (2 * f, h)), ("mlp.linear_fc2.weight", (h, f))]
    names = [f"decoder.layers.{layer}.{name}" for layer in range(layers) for name, _ in per_layer]
    return names, [s for _ in range(layers) for _, s in per_layer]


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
    repeats: int, device: torch.device, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> list[OwnershipTiming]:
    names, full_shapes = muon_parameters(PRESETS[preset], layers)
    exchanges = [MuonExchange.build(names, full_shapes, PRESETS[preset], 1, owners, steps, bucket_numel)
                 for owners in owner_counts]
    shapes = [m.shape for m in exchanges[0].matrices]
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(s, generator=generator).to(device) for s in shapes]
    seconds = time_each_matrix(matrices, schedule, steps, dtype, repeats)
    baseline_s = sum(seconds)
    results = []
    for x in exchanges:
        flops = [newton_schulz_flops(s, steps) for s in shapes]
        # Buckets run in turn: the step's FLOP critical path is each bucket's busiest owner.
        critical = sum(max(sum(flops[m] for m in x.owned(b, r, 0)) for r in range(x.dp)) for b in range(len(x.buckets)))
        imbalance = critical * x.dp / sum(flops)
        step_s, slowest_matrices = 0.0, 0
        for b in range(len(x.buckets)):
            per_owner = [sum(seconds[m] for m in x.owned(b, r, 0)) for r in range(x.dp)]
            slowest = max(range(x.dp), key=lambda r: per_owner[r])
            step_s += per_owner[slowest]
            slowest_matrices += len(x.owned(b, slowest, 0))
        results.append(
            OwnershipTiming(
                preset=preset, layers=layers, owners=x.dp, matrices=len(matrices), buckets=len(x.buckets),
                slowest_owner_matrices=slowest_matrices, imbalance=round(imbalance, 4),
                baseline_s=round(baseline_s, 4), slowest_owner_s=round(step_s, 4),
                speedup=round(baseline_s / step_s, 3),
                ideal_speedup=round(x.dp / imbalance, 3),
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
