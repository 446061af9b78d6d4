"""Document-masked against causal attention: one forward and backward of the model's core attention
(trainer.model.attention.SDPAttention) at seq 2048, in the same command.

    python benchmarks/attention_mask.py [--seq 2048] [--batch 1] [--docs 4] [--repeats 5] [--device cpu]

"masked" is what `--arch paper` runs: the block-causal mask built on the device from the tokens'
document ids (`--docs` documents per sequence) and SDPA with that mask; "causal" is SDPA's fused causal
path (no mask). Shapes are the 150m preset's attention (4 heads of 128). Times are the median of
`--repeats` interleaved runs after a warm-up; the last line (JSON) holds them and masked / causal.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


from trainer.data import document_ids
from trainer.model.attention import SDPAttention
from trainer.model.builder import transformer_config
from trainer.model.presets import PRESETS

EOD = 0


def step_seconds(attention: SDPAttention, q, k, v, ids, device: torch.device) -> float:
    """One forward and backward (the mask, when masked, built inside, as in training)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = attention(q, k, v, ids)
    out.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=4, help="documents per sequence")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    shape = PRESETS["150m"]
    from megatron.core.transformer.enums import AttnMaskType

    config = transformer_config(shape, 1, 1, bf16_autocast=False)
    attention = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    g = torch.Generator().manual_seed(0)
    s, b, hd = args.seq, args.batch, shape.kv_channels
    q, k, v = (torch.randn(s, b, n, hd, generator=g).to(device).requires_grad_()
               for n in (shape.num_attention_heads, shape.query_groups, shape.query_groups))
    tokens = torch.randint(1, 1000, (b, s), generator=g)
    tokens[:, torch.linspace(0, s - 1, args.docs + 1).long()[1:]] = EOD  # `--docs` documents per row
    ids = document_ids(tokens, EOD).to(device)
    runs = {"causal": None, "masked": ids}
    times = {name: [] for name in runs}
    for name, mask in runs.items():  # warm-up
        step_seconds(attention, q, k, v, mask, device)
    for _ in range(args.repeats):
        for name, mask in runs.items():
            times[name].append(step_seconds(attention, q, k, v, mask, device))
    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = median["masked"] / median["causal"]
    print(f"seq {s}, batch {b}, {args.docs} documents, {shape.num_attention_heads} heads x {hd}, {device}")
    for name, seconds in median.items():
        print(f"{name:>7}: {seconds * 1e3:8.2f} ms per forward+backward")
    print(f"masked / causal: {ratio:.2f}x")
    print(json.dumps({"seq": s, "batch": b, "docs": args.docs, "device": str(device),
                      "seconds": median, "masked_over_causal": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
