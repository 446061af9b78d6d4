"""Sampler throughput: samples/s and tokens/s of trainer.data.micro_batches(), against the trainer's
consumption.

python benchmarks/loader_throughput.py [--data-path PREFIX] [--tokenizer-model M]
    [--metrics RUN/metrics.jsonl | --trainer-tokens-per-s N] [--seq-lengths 128 2048]

The defaults are the demo's outputs (scripts/demo.sh). The trainer's rate is the fastest
`tokens_per_s` in the run's metrics.jsonl, for the whole job; one process's loader is compared with
it, which is conservative: each rank only loads its 1/(K x D) share. The ratio loader/trainer must be
far above 1. The last line printed is a JSON object with the numbers, for scripts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

import torch.distributed as dist

from trainer.config import BatchConfig, DataConfig
from trainer.data import StreamPosition, build_datasets, micro_batches, tokenizer_info

DEMO = REPO_ROOT / "demo_data"


def trainer_tokens_per_s(metrics: Path) -> float:
    if not metrics.is_file():
        raise SystemExit(f"loader_throughput: {metrics} not found; run scripts/demo.sh, or give --metrics "
                         f"RUN_DIR/metrics.jsonl or --trainer-tokens-per-s")
    rates = [record["tokens_per_s"] for record in map(json.loads, metrics.read_text().splitlines())
             if "tokens_per_s" in record]
    if not rates:
        raise SystemExit(f"loader_throughput: no tokens_per_s records in {metrics}")
    return max(rates)


def measure(data: DataConfig, seq_length: int, micro_batch_size: int, samples: int, work_dir: Path) -> dict:
    batch = BatchConfig(micro_batch_size=micro_batch_size, gradient_accumulation_steps=1)
    steps = samples // batch.global_batch
    start = time.perf_counter()
    train = build_datasets(data, tokenizer_info(data), seq_length, seed=1234, train_samples=steps * batch.global_batch,
                           valid_samples=1, cache_dir=str(work_dir / f"cache{seq_length}")).train
    build_seconds = time.perf_counter() - start
    position = StreamPosition(worker=0, data_rank=0, batch=batch)
    start = time.perf_counter()
    for step in range(steps):
        for micro in micro_batches(train, position, step):
            assert micro["tokens"].shape == (micro_batch_size, seq_length)
    seconds = time.perf_counter() - start
    loaded = steps * batch.global_batch
    return {"seq_length": seq_length, "samples": loaded, "build_seconds": round(build_seconds, 3),
            "samples_per_s": round(loaded / seconds), "tokens_per_s": round(loaded * seq_length / seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", nargs="+", default=[str(DEMO / "data" / "train_text_document")],
                        help="prefix, or weight prefix weight prefix ...")
    parser.add_argument("--tokenizer-model", default=str(DEMO / "tokenizer" / "demo.model"))
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--metrics", type=Path, default=REPO_ROOT / "runs" / "demo" / "metrics.jsonl",
                      help="a real run's metrics.jsonl (default: the demo's)")
    rate.add_argument("--trainer-tokens-per-s", type=float, help="the trainer's consumption, instead of --metrics")
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4000, help="samples loaded per sequence length")
    args = parser.parse_args()

    trainer_rate = args.trainer_tokens_per_s or trainer_tokens_per_s(args.metrics)
    data = DataConfig(data_path=args.data_path, tokenizer_model=args.tokenizer_model)
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        # Megatron's weighted blends ask torch.distributed for the rank when they write their cache.
        dist.init_process_group("gloo", init_method=f"file://{work_dir / 'store'}", rank=0, world_size=1)
        try:
            results = [measure(data, seq, args.micro_batch_size, args.samples, work_dir) for seq in args.seq_lengths]
        finally:
            dist.destroy_process_group()
    for result in results:
        result["ratio_to_trainer"] = round(result["tokens_per_s"] / trainer_rate, 1)
        print(f"seq {result['seq_length']}: {result['samples_per_s']} samples/s, {result['tokens_per_s']} tokens/s, "
              f"{result['ratio_to_trainer']}x the trainer's {trainer_rate:.0f} tokens/s "
              f"(index build {result['build_seconds']}s)")
    print(json.dumps({"benchmark": "loader_throughput", "trainer_tokens_per_s": round(trainer_rate, 1),
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
