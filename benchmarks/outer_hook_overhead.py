"""Step-time overhead of the MuLoCo outer hook against the data-parallel baseline, with and without
an emulated slow cross-datacenter link.

    python benchmarks/outer_hook_overhead.py [--model tiny] [--steps 40] [--sync-interval 10]

Launches itself under torchrun on 2 ranks (gloo on CPU) and trains, one after another in that
launch, runs assembled exactly as trainer/pretrain.py assembles them, with the same work per rank
(one micro-batch of 4 sequences per step):
  dp                   no muloco block: D=2 replicas all-reduce gradients every step (the baseline)
  muloco               K=2 workers, 4-bit statistical + EF, sync every H steps
  muloco+link          the same over a 1 Gbit/s, 50 ms link (slow-link emulation)
  muloco+link, none    uncompressed pseudogradients over that link
  muloco+link, tau=1   4-bit over that link, the sync overlapping one inner step
Throughput is metrics.jsonl's tokens_per_s over windows of H steps (each holds one sync), the
first window dropped as warm-up; overhead = baseline tokens/s / run tokens/s. Last line: JSON.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

BASE_CONFIG = REPO_ROOT / "ds_configs" / "cpu_tiny_muloco.json"
SLOW_LINK = {"bandwidth_gbit_s": 1, "latency_ms": 50}
FOUR_BIT_EF = {"method": "statistical", "bits": 4, "error_feedback": True}


def cases(sync_interval: int) -> dict[str, dict | None]:
    """Name -> muloco block (None: the data-parallel baseline)."""
    muloco = {"workers": 2, "sync_interval": sync_interval, "outer_lr": 0.7, "outer_momentum": 0.6,
              "nesterov": True, "compression": FOUR_BIT_EF}
    return {
        "dp": None,
        "muloco": muloco,
        "muloco+link": {**muloco, "link": SLOW_LINK},
        "muloco+link, none": {**muloco, "link": SLOW_LINK, "compression": {"method": "none"}},
        "muloco+link, tau=1": {**muloco, "link": SLOW_LINK, "streaming": {"overlap_steps": 1}},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sync-interval", type=int, default=10)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--workdir", help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_args(argv)


def train_all(args: argparse.Namespace) -> None:
    """One rank: every case in turn; each run writes its metrics.jsonl under the workdir."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from megatron.core import parallel_state as mps

    from trainer.config import build_parser, resolve
    from trainer.comm import COLLECTIVE_TIMEOUT
    from trainer.run import run

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=COLLECTIVE_TIMEOUT)
    workdir = Path(args.workdir)
    base = {k: v for k, v in json.loads(BASE_CONFIG.read_text()).items() if k != "muloco"}
    for i, block in enumerate(cases(args.sync_interval).values()):
        ds_path = workdir / f"case{i}.json"
        if dist.get_rank() == 0:
            ds_path.write_text(json.dumps(base if block is None else {**base, "muloco": block}))
        dist.barrier()
        flags = build_parser().parse_args([
            "--ds_config", str(ds_path), "--model", args.model, "--data-path", str(workdir / "markov"),
            "--vocab-size", "1000", "--train-iters", str(args.steps), "--seq-length", str(args.seq_length),
            "--micro-batch-size", "4", "--log-interval", str(args.sync_interval), "--eval-interval", "0",
            "--run-dir", str(workdir / f"run{i}")])
        run(resolve(flags, dist.get_world_size()))
        dist.barrier()
        mps.destroy_model_parallel()


def throughput(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return statistics.fmean(windows)


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        train_all(args)
        return
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from synthetic_data import write_markov_dataset

    with tempfile.TemporaryDirectory() as tmp:
        write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=1000)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                        "--model", args.model, "--steps", str(args.steps), "--sync-interval", str(args.sync_interval),
                        "--seq-length", str(args.seq_length), "--workdir", tmp],
                       check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        names = list(cases(args.sync_interval))
        tokens_per_s = {name: throughput(Path(tmp) / f"run{i}") for i, name in enumerate(names)}
        syncs = {name: [json.loads(line) for line in (Path(tmp) / f"run{i}" / "metrics.jsonl").read_text().splitlines()
                        if "outer_step" in line] for i, name in enumerate(names)}
    baseline = tokens_per_s["dp"]
    print(f"model {args.model}, 2 ranks x 4 sequences x {args.seq_length} tokens per step, H = {args.sync_interval}, "
          f"slow link {SLOW_LINK['bandwidth_gbit_s']} Gbit/s + {SLOW_LINK['latency_ms']} ms")
    print(f"{'run':<20} {'tokens/s':>9} {'step-time ratio vs dp':>22} {'sync s (mean)':>14} {'MB/rank/sync':>13}")
    rows = []
    for name in names:
        sync_s = [r["sync_seconds"] for r in syncs[name]]
        sent = [r["bytes_sent_per_rank"] for r in syncs[name]]
        row = {"run": name, "tokens_per_s": tokens_per_s[name], "overhead_vs_dp": baseline / tokens_per_s[name],
               "sync_seconds": statistics.fmean(sync_s) if sync_s else None,
               "bytes_per_rank_per_sync": statistics.fmean(sent) if sent else None}
        rows.append(row)
        print(f"{name:<20} {row['tokens_per_s']:>9.0f} {row['overhead_vs_dp']:>22.3f} "
              f"{row['sync_seconds'] or 0:>14.3f} {(row['bytes_per_rank_per_sync'] or 0) / 1e6:>13.2f}")
    print(json.dumps({"model": args.model, "steps": args.steps, "sync_interval": args.sync_interval, "rows": rows}))


if __name__ == "__main__":
    main()
