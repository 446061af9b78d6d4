"""Pseudogradient codec throughput: elements per second encoded and decoded, for one bucket holding a
transformer layer's matrices at the preset's shapes (what an outer sync encodes per layer), against
the same tensors encoded one by one (a bucket each) in the same command.

    python benchmarks/codec_throughput.py [--model 150m] [--layers 1] [--repeats 3] [--device cpu]

The planner's wall-clock model reads `encode_elements_per_s` / `decode_elements_per_s` of its
compression setting from the last line (JSON): run this on the target device and save its output,
then `python tools/plan.py ... --codec-json FILE`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "statistical 2-bit": {"method": "statistical", "bits": 2},
    "statistical 4-bit": {"method": "statistical", "bits": 4},
    "statistical 8-bit": {"method": "statistical", "bits": 8},
    "linear 4-bit": {"method": "linear", "bits": 4},
    "linear 8-bit": {"method": "linear", "bits": 8},
    "top-2%": {"method": "topk", "topk_fraction": 0.02},
}


def layer_shapes(model: str, layers: int) -> list[tuple[int, int]]:
    """(rows, columns) as the wire sees a layer's matrices: QKV, attention out (sent transposed),
    gate-up, down (sent transposed); ordered by width as the outer loop orders a bucket."""
    from trainer.model.presets import PRESETS

    s = PRESETS[model]
    heads, groups, head_dim = s.num_attention_heads, s.num_query_groups or s.num_attention_heads, s.kv_channels
    qkv = ((heads + 2 * groups) * head_dim, s.hidden_size)
    out = (heads * head_dim, s.hidden_size)  # transposed (hidden, heads*dim) -> rows of heads*dim
    gate_up = (2 * s.ffn_hidden_size, s.hidden_size)
    down = (s.ffn_hidden_size, s.hidden_size)  # transposed
    return sorted([qkv, out, gate_up, down] * layers, key=lambda shape: shape[1])


def median_seconds(fns: list, repeats: int) -> list[float]:
    """The median time of each function, run in alternation, so a load that drifts hits them alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, own in zip(fns, times):
            start = time.perf_counter()
            fn()
            own.append(time.perf_counter() - start)
    return [statistics.median(own) for own in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="150m")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    import torch

    from muloco.diloco.compression import Compressor
    from muloco.diloco.config import CompressionConfig

    torch.manual_seed(0)
    shapes = layer_shapes(args.model, args.layers)
    tensors = [torch.randn(shape, device=args.device) for shape in shapes]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    blocks = tuple(shapes)
    elements = flat.numel()
    print(f"model {args.model}, {args.layers} layer(s): {len(shapes)} matrices, {elements / 1e6:.1f}M elements, "
          f"device {args.device}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"{'setting':<18} {'encode Melem/s':>15} {'decode Melem/s':>15} {'per-tensor encode':>18} "
          f"{'bucket speed-up':>16} {'bytes/elem':>11}")
    rows = []
    for label, settings in SETTINGS.items():
        compressor = Compressor(CompressionConfig(**settings))
        encoded = compressor.encode_bucket(flat, blocks)
        encode_s, one_by_one_s, decode_s = median_seconds(
            [lambda c=compressor: c.encode_bucket(flat, blocks), lambda c=compressor: [c.encode(t) for t in tensors],
             lambda c=compressor, e=encoded: c.decode_bucket(e.data, blocks)], args.repeats)
        row = {"setting": label, **settings, "elements": elements,
               "encode_elements_per_s": elements / encode_s, "decode_elements_per_s": elements / decode_s,
               "per_tensor_encode_elements_per_s": elements / one_by_one_s,
               "bucket_speedup": one_by_one_s / encode_s, "bytes_per_element": encoded.nbytes / elements}
        rows.append(row)
        print(f"{label:<18} {row['encode_elements_per_s'] / 1e6:>15.1f} {row['decode_elements_per_s'] / 1e6:>15.1f} "
              f"{row['per_tensor_encode_elements_per_s'] / 1e6:>18.1f} {row['bucket_speedup']:>16.2f} "
              f"{row['bytes_per_element']:>11.4f}")
    print(json.dumps({"model": args.model, "layers": args.layers, "device": args.device, "rows": rows}))


if __name__ == "__main__":
    main()
