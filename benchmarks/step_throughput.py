"""Tiny-preset training throughput on 2 ranks: tensor parallel (T=2, D=1) against inner data parallel
(T=1, D=2), the same global batch, with the real launcher.

python benchmarks/step_throughput.py [--steps 30] [--optimizer muon|adamw]

Tokens/s is read from each run's metrics.jsonl, leaving out the first logged window (start-up).
The last line printed is a JSON object with the numbers, for scripts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import PRETRAIN, TINY_VOCAB, launch_ranks, read_metrics, tiny_flags

LAYOUTS = {"T1_D2": [], "T2_D1": ["--tensor-model-parallel-size", "2"]}
LOG_INTERVAL = 5


def measure(layout: str, steps: int, optimizer: str, work_dir: Path, data: str) -> float:
    run_dir = work_dir / layout
    launch_ranks(PRETRAIN, 2, tiny_flags(
        data, run_dir, optimizer, *LAYOUTS[layout], "--train-iters", str(steps), "--micro-batch-size", "4",
        "--global-batch-size", "8", "--log-interval", str(LOG_INTERVAL), "--eval-interval", "0"),
        timeout_s=600).check(f"{layout} run")
    windows = [r["tokens_per_s"] for r in read_metrics(run_dir) if "tokens_per_s" in r and r["step"] > LOG_INTERVAL]
    return statistics.mean(windows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        data = write_markov_dataset(str(work_dir / "markov"), vocab_size=TINY_VOCAB)
        result = {f"{layout}_tokens_per_s": round(measure(layout, args.steps, args.optimizer, work_dir, data), 1)
                  for layout in LAYOUTS}
    result["T2_D1_over_T1_D2"] = round(result["T2_D1_tokens_per_s"] / result["T1_D2_tokens_per_s"], 3)
    result.update(optimizer=args.optimizer, steps=args.steps, global_batch=8, seq_length=128)
    print(f"T=1 D=2: {result['T1_D2_tokens_per_s']} tokens/s; T=2 D=1: {result['T2_D1_tokens_per_s']} tokens/s "
          f"({result['T2_D1_over_T1_D2']}x)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
