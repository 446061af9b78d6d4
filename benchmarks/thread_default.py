"""The trainer's intra-op thread default on CPU: the same 2-rank tiny run with OMP_NUM_THREADS unset
(each rank takes its share of the cores: trainer/threads.py) against OMP_NUM_THREADS set to what torch
would start per process by itself (what every rank used before the default), in one command.

python benchmarks/thread_default.py [--steps 30] [--ranks 2]

Tokens/s is read from each run's metrics.jsonl, leaving out the first logged window (start-up).
The last line printed is a JSON object with the numbers, for scripts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import PRETRAIN, TINY_VOCAB, launch_ranks, read_metrics, tiny_flags

LOG_INTERVAL = 5


def torch_own_threads() -> str:
    """The intra-op threads torch starts in a process with OMP_NUM_THREADS unset."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def tokens_per_s(run_dir: Path, ranks: int, steps: int, data: str, omp_threads: str | None) -> float:
    result = launch_ranks(PRETRAIN, ranks, tiny_flags(
        data, run_dir, "muon", "--train-iters", str(steps), "--micro-batch-size", "4",
        "--global-batch-size", str(4 * ranks), "--log-interval", str(LOG_INTERVAL), "--eval-interval", "0"),
        timeout_s=900, omp_threads=omp_threads, launcher="deepspeed").check(f"run with OMP_NUM_THREADS={omp_threads}")
    print(next(line for line in result.output.splitlines() if "threads:" in line), flush=True)
    windows = [r["tokens_per_s"] for r in read_metrics(run_dir) if "tokens_per_s" in r and r["step"] > LOG_INTERVAL]
    return statistics.mean(windows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    torch_own = torch_own_threads()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=TINY_VOCAB)
        without = tokens_per_s(Path(tmp) / "without", args.ranks, args.steps, data, torch_own)
        default = tokens_per_s(Path(tmp) / "default", args.ranks, args.steps, data, None)
    result = {"without_default_tokens_per_s": round(without, 1), "without_default_threads_per_rank": int(torch_own),
              "default_tokens_per_s": round(default, 1), "default_over_without": round(default / without, 2),
              "ranks": args.ranks, "steps": args.steps}
    print(f"{args.ranks} ranks: {torch_own} threads per rank (torch's own) {result['without_default_tokens_per_s']} "
          f"tokens/s; the default {result['default_tokens_per_s']} tokens/s ({result['default_over_without']}x)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
