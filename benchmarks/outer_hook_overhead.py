"""Step-time overhead of the MuLoCo outer sync itself: the same run with the outer loop syncing
against the same run with syncs disabled, so both do identical inner work.

    python benchmarks/outer_hook_overhead.py [--model tiny] [--sync-interval 30] [--windows 2] [--repeats 3]

Each run is its own torchrun launch of this file on 2 ranks (gloo on CPU; a fresh process per run,
since a long-lived one slowed down run after run): K = 2 workers of one rank each, 4-bit statistical
+ error feedback, assembled exactly as trainer/pretrain.py assembles it:
  nosync            sync_interval above the run length: the outer loop never syncs (the baseline)
  sync              a sync every H steps
  sync+link         over an emulated 1 Gbit/s, 50 ms link
  sync+link, tau=1  over that link, the sync running in the background during the next inner step
  sync+link, tau=2  the same, with two inner steps to hide it in
The cases are interleaved `--repeats` times, each repeat in an order rotated by one, so machine load
drifts hit all of them alike. Throughput is the job's over the windows of H steps after the first
(each window holds one sync; the first is warm-up): tokens over the time the slowest rank takes to
run them. Every rank times its own steps; a job goes at its slowest worker's pace, and taking rank
0's clock alone would let the free-running nosync baseline skip the waits for a slower peer that any
synchronous step (this sync, or DP's all-reduce) pays. Per case the median over the repeats;
overhead_vs_nosync = nosync tokens/s / case tokens/s. Also reported: cross-datacenter round
trips per sync, on its critical path (metrics.jsonl's `round_trips`: the exchange, which carries the
skip vote) and in the background after the result is applied (`background_round_trips`: the
metrics), and the mean sync wall time. Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

BASE_CONFIG = REPO_ROOT / "ds_configs" / "cpu_tiny_muloco.json"
SLOW_LINK = {"bandwidth_gbit_s": 1, "latency_ms": 50}
FOUR_BIT_EF = {"method": "statistical", "bits": 4, "error_feedback": True}


def cases(sync_interval: int, steps: int) -> dict[str, dict]:
    """Name -> muloco block."""
    muloco = {"workers": 2, "sync_interval": sync_interval, "outer_lr": 0.7, "outer_momentum": 0.6,
              "nesterov": True, "compression": FOUR_BIT_EF}
    return {
        "nosync": {**muloco, "sync_interval": steps + 1},
        "sync": muloco,
        "sync+link": {**muloco, "link": SLOW_LINK},
        "sync+link, tau=1": {**muloco, "link": SLOW_LINK, "streaming": {"overlap_steps": 1}},
        "sync+link, tau=2": {**muloco, "link": SLOW_LINK, "streaming": {"overlap_steps": 2}},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--sync-interval", type=int, default=30)
    p.add_argument("--windows", type=int, default=2, help="measured windows of H steps per run (after one warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--workdir", help=argparse.SUPPRESS)  # these three are set by the launcher
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--run-index", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_order(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Repeat r runs the cases rotated by r, so a load that drifts during the command does not always
    favour the case that runs first."""
    names = list(cases(args.sync_interval, steps(args)))
    return [(name, repeat) for repeat in range(args.repeats)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]]


def steps(args: argparse.Namespace) -> int:
    return (args.windows + 1) * args.sync_interval


def train_one(args: argparse.Namespace) -> None:
    """One rank of run `--run-index` (case `--case`); it writes its metrics.jsonl and step times under
    the workdir."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from trainer.config import build_parser, resolve
    from trainer.comm import COLLECTIVE_TIMEOUT
    from trainer.run import run
    from trainer.training import Trainer

    class TimedTrainer(Trainer):
        """Writes this rank's wall clock after every step (outer hook included) to step_times.rank<R>.json."""

        def train(self) -> dict:
            self.step_times = []
            summary = super().train()
            Path(self.config.run_dir, f"step_times.rank{dist.get_rank()}.json").write_text(json.dumps(self.step_times))
            return summary

        def train_step(self):
            result = super().train_step()
            self.step_times.append(time.perf_counter())
            return result

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=COLLECTIVE_TIMEOUT)
    workdir, i = Path(args.workdir), args.run_index
    base = {k: v for k, v in json.loads(BASE_CONFIG.read_text()).items() if k != "muloco"}
    ds_path = workdir / f"run{i}.json"
    if dist.get_rank() == 0:
        ds_path.write_text(json.dumps({**base, "muloco": cases(args.sync_interval, steps(args))[args.case]}))
    dist.barrier()
    flags = build_parser().parse_args([
        "--ds_config", str(ds_path), "--model", args.model, "--data-path", str(workdir / "markov"),
        "--vocab-size", "1000", "--train-iters", str(steps(args)), "--seq-length", str(args.seq_length),
        "--micro-batch-size", "4", "--log-interval", str(args.sync_interval), "--eval-interval", "0",
        "--run-dir", str(workdir / f"run{i}")])
    run(resolve(flags, dist.get_world_size()), TimedTrainer)


def read_run(run_dir: Path, sync_interval: int) -> tuple[float, list[dict]]:
    """(the job's tokens/s over the windows after the first, the outer-sync records)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "tokens_per_s" in r)
    tokens_per_step = first["tokens"] // first["step"]
    per_rank = [json.loads(path.read_text()) for path in sorted(run_dir.glob("step_times.rank*.json"))]
    measured = len(per_rank[0]) - sync_interval  # steps after the first window
    slowest = max(times[-1] - times[sync_interval - 1] for times in per_rank)
    return measured * tokens_per_step / slowest, [r for r in records if "outer_step" in r]


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        train_one(args)
        return
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from synthetic_data import write_markov_dataset

    order = run_order(args)
    with tempfile.TemporaryDirectory() as tmp:
        write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=1000)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for i, (name, repeat) in enumerate(order):
            print(f"run {i + 1}/{len(order)}: {name} (repeat {repeat + 1})", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            __file__, "--model", args.model, "--sync-interval", str(args.sync_interval),
                            "--windows", str(args.windows), "--seq-length", str(args.seq_length), "--workdir", tmp,
                            "--case", name, "--run-index", str(i)],
                           check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        results = [read_run(Path(tmp) / f"run{i}", args.sync_interval) for i in range(len(order))]
    names = list(cases(args.sync_interval, steps(args)))
    tokens = {name: [results[i][0] for i, (n, _) in enumerate(order) if n == name] for name in names}
    syncs = {name: [s for i, (n, _) in enumerate(order) if n == name for s in results[i][1]] for name in names}
    baseline = statistics.median(tokens["nosync"])
    print(f"model {args.model}, K = 2 workers x 4 sequences x {args.seq_length} tokens per step, H = {args.sync_interval}, "
          f"4-bit statistical + EF, link {SLOW_LINK['bandwidth_gbit_s']} Gbit/s + {SLOW_LINK['latency_ms']} ms; "
          f"medians of {args.repeats} interleaved runs")
    print(f"{'case':<18} {'tokens/s':>9} {'overhead_vs_nosync':>19} {'runs (tokens/s)':>26} {'round trips':>12} "
          f"{'background':>11} {'sync s':>7} {'MB/rank/sync':>13}")
    rows = []
    for name in names:
        median = statistics.median(tokens[name])
        records = syncs[name]
        row = {"case": name, "tokens_per_s": median, "overhead_vs_nosync": baseline / median,
               "runs_tokens_per_s": tokens[name],
               "round_trips_per_sync": statistics.fmean(r["round_trips"] for r in records) if records else 0,
               "background_round_trips_per_sync":
                   statistics.fmean(r["background_round_trips"] for r in records) if records else 0,
               "sync_seconds": statistics.fmean(r["sync_seconds"] for r in records) if records else 0.0,
               "bytes_per_rank_per_sync": statistics.fmean(r["bytes_sent_per_rank"] for r in records) if records else 0}
        rows.append(row)
        runs = " ".join(f"{t:.0f}" for t in tokens[name])
        print(f"{name:<18} {median:>9.0f} {row['overhead_vs_nosync']:>19.3f} {runs:>26} "
              f"{row['round_trips_per_sync']:>12.1f} {row['background_round_trips_per_sync']:>11.1f} "
              f"{row['sync_seconds']:>7.3f} {row['bytes_per_rank_per_sync'] / 1e6:>13.3f}")
    print(json.dumps({"model": args.model, "sync_interval": args.sync_interval, "repeats": args.repeats,
                      "load_average": os.getloadavg(), "rows": rows}))


if __name__ == "__main__":
    main()
