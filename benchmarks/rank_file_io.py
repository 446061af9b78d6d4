"""The safetensors rank file (muloco/core/rank_file.py) against the pickled torch.save file it
replaced, on the same state in the same process: write (with fsync), read everything back, and the
SHA-256 check a load adds. The state has the 150m preset's parameter shapes (vocab 128k) with two
optimizer-state tensors each, as one rank holds at T=1 P=1.

python benchmarks/rank_file_io.py [--vocab 128000] [--repeats 3]

Times are the best of `repeats`; the last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

from trainer.checkpoint.format import sha256_of
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from trainer.model.presets import PRESETS


def preset_state(vocab: int) -> dict:
    m = PRESETS["150m"]
    shapes = {"embedding": (vocab, m.hidden_size), "output_layer": (vocab, m.hidden_size)}
    qkv = (m.num_attention_heads + 2 * m.query_groups) * m.kv_channels
    for layer in range(m.num_layers):
        shapes |= {f"{layer}.qkv": (qkv, m.hidden_size), f"{layer}.proj": (m.hidden_size, m.num_attention_heads * m.kv_channels),
                   f"{layer}.fc1": (2 * m.ffn_hidden_size, m.hidden_size), f"{layer}.fc2": (m.hidden_size, m.ffn_hidden_size),
                   f"{layer}.norm1": (m.hidden_size,), f"{layer}.norm2": (m.hidden_size,)}
    model = {name: torch.randn(shape) for name, shape in shapes.items()}
    return {"model": model, "step": 1000,
            "optimizer": {"param_groups": [{"lr": 0.02, "betas": (0.9, 0.99), "kind": "muon"}],
                          "state": {n: {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
                                    for n, p in model.items()}}}


def fsynced(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def touch_all(obj) -> float:
    """Read every element of every tensor (a memory-mapped load reads nothing until touched)."""
    if isinstance(obj, torch.Tensor):
        return float(obj.sum())
    if isinstance(obj, dict):
        return sum(touch_all(v) for v in obj.values())
    return 0.0


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128_000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    state = preset_state(args.vocab)
    with tempfile.TemporaryDirectory(prefix="rank_file_io_") as work:
        pickled, safe = Path(work) / "rank.pt", Path(work) / "rank.safetensors"
        r = {"pickle_write_s": best(lambda: fsynced(pickled, lambda f: torch.save(state, f)), args.repeats),
             "safetensors_write_s": best(lambda: fsynced(safe, lambda f: write_rank_file(f, state)), args.repeats),
             "pickle_read_s": best(lambda: touch_all(torch.load(pickled, mmap=True, weights_only=True)), args.repeats),
             "safetensors_read_s": best(lambda: touch_all(to_plain(read_rank_file(safe))), args.repeats),
             "sha256_s": best(lambda: sha256_of(safe), args.repeats),
             "file_mib": safe.stat().st_size / 2 ** 20}
    r["write_ratio"] = r["safetensors_write_s"] / r["pickle_write_s"]
    r["read_ratio"] = r["safetensors_read_s"] / r["pickle_read_s"]
    r["checked_read_ratio"] = (r["safetensors_read_s"] + r["sha256_s"]) / r["pickle_read_s"]
    print(f"rank file {r['file_mib']:.0f} MiB | write: safetensors {r['safetensors_write_s']:.2f}s vs pickle "
          f"{r['pickle_write_s']:.2f}s ({r['write_ratio']:.2f}x) | read all: {r['safetensors_read_s']:.2f}s vs "
          f"{r['pickle_read_s']:.2f}s ({r['read_ratio']:.2f}x) | SHA-256 check {r['sha256_s']:.2f}s "
          f"({r['file_mib'] / r['sha256_s']:.0f} MiB/s; checked read {r['checked_read_ratio']:.2f}x)")
    print(json.dumps({"benchmark": "rank_file_io", "results": r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
