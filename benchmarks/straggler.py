"""Datacenters that are not equal (issue 43): K = 3 tiny workers, one slowed down 2x
(`muloco.emulate_slowdown`), over the emulated 1 Gbit/s, 50 ms link, on CPU.

    python benchmarks/straggler.py

Cases, each a torchrun launch of 3 ranks (K = 3 workers of one rank each), 4-bit statistical + EF:
  equal         every worker at full speed, fixed H (the reference)
  barrier       worker 2 at slowdown 2.0, fixed H: today's sync is a barrier, every worker at its pace
  paced         worker 2 at slowdown 2.0, `pace: {"mode": "wall_clock"}` (trainer/diloco/pace.py)
  equal_tokens  every worker at full speed, fixed H, run for the paced run's total tokens (run after it)
Throughput of the fast workers (0 and 1): their inner steps after the first window of H steps over
the time they took (their own clocks, outer syncs included), against `equal`'s; and their useful
share, the part of that time outside the step hooks (the outer sync and its wait for the others),
against `equal`'s: what the throughput ratio would be on machines of their own. Validation loss:
the paced run's final one (every worker holds the global model after the final sync) against
`equal_tokens`'s, which trained on the same number of tokens (the workers' inner steps summed, from
the outer records' `inner_steps`). The three workers share the machine's cores: a slowed-down worker
sleeps half its time, which leaves its peers more CPU, so the steps/s ratios of the straggler cases
read above what separate machines would give; the useful shares do not depend on that. Last line:
JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from timed_runs import timed_trainer, write_config

WORKERS = 3
SLOW_LINK = {"bandwidth_gbit_s": 1, "latency_ms": 50}
FOUR_BIT_EF = {"method": "statistical", "bits": 4, "error_feedback": True}
STRAGGLER = [1.0, 1.0, 2.0]
FAST = [0, 1]


def muloco_block(case: str, sync_interval: int) -> dict:
    block = {"workers": WORKERS, "sync_interval": sync_interval, "outer_lr": 0.7, "outer_momentum": 0.6,
             "nesterov": True, "compression": FOUR_BIT_EF, "link": SLOW_LINK}
    if case in ("barrier", "paced"):
        block["emulate_slowdown"] = STRAGGLER
    if case == "paced":
        block["pace"] = {"mode": "wall_clock"}
    return block


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--sync-interval", type=int, default=20)
    p.add_argument("--syncs", type=int, default=6, help="outer syncs per run (the first window is warm-up)")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--workdir", help=argparse.SUPPRESS)  # these three are set by the launcher
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def train_one(args: argparse.Namespace) -> None:
    """One rank of case `--case`: its metrics.jsonl (rank 0) and its step times under the workdir."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from trainer.comm import COLLECTIVE_TIMEOUT
    from trainer.config import build_parser, resolve
    from trainer.run import run

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=COLLECTIVE_TIMEOUT)
    workdir = Path(args.workdir)
    ds_path = workdir / f"{args.case}.json"
    if dist.get_rank() == 0:
        write_config(ds_path, muloco_block(args.case, args.sync_interval))
    dist.barrier()
    flags = build_parser().parse_args([
        "--ds_config", str(ds_path), "--model", args.model, "--data-path", str(workdir / "markov"),
        "--vocab-size", "1000", "--train-iters", str(args.steps), "--seq-length", str(args.seq_length),
        "--micro-batch-size", "4", "--log-interval", str(args.sync_interval), "--eval-interval", str(args.steps),
        "--eval-iters", "8", "--lr-warmup-iters", str(args.sync_interval), "--run-dir", str(workdir / args.case)])
    run(resolve(flags, dist.get_world_size()), timed_trainer())


def launch(args: argparse.Namespace, case: str, steps: int, workdir: str, env: dict) -> dict:
    forwarded = [__file__, "--model", args.model, "--sync-interval", str(args.sync_interval), "--seq-length",
                 str(args.seq_length), "--workdir", workdir, "--case", case, "--steps", str(steps)]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORKERS}",
                    *forwarded], check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return read_run(Path(workdir) / case, args.sync_interval, time.perf_counter() - started)


def read_run(run_dir: Path, sync_interval: int, seconds: float) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    outer = [r for r in records if "outer_step" in r]
    val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
    per_rank = [json.loads((run_dir / f"step_times.rank{k}.json").read_text()) for k in range(WORKERS)]
    # Each fast worker after its first window: its inner steps over the time they took (syncs included),
    # and the share of that time outside its step hooks (the outer sync and its wait): its useful compute.
    fast, useful = [], []
    for rank in (per_rank[k] for k in FAST):
        times, hooks = rank["times"], rank["hooks"]
        wall = times[-1] - times[sync_interval - 1]
        fast.append((len(times) - sync_interval) / wall)
        useful.append(1 - sum(hooks[sync_interval:]) / wall)
    taken = [len(rank["times"]) for rank in per_rank]
    if outer and "inner_steps" in outer[0]:  # paced: what each worker took, as its headers said
        taken = [sum(r["inner_steps"][k] for r in outer) for k in range(WORKERS)]
    return {"fast_steps_per_s": min(fast), "fast_useful_share": min(useful), "val_loss": val_loss, "inner_steps": taken,
            "launch_seconds": seconds}


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        train_one(args)
        return
    from tools.synthetic_data import write_markov_dataset

    from trainer.diloco.auth import KEY_FILE_ENV, write_new_key

    steps = args.sync_interval * args.syncs
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=1000)
        write_new_key(Path(tmp) / "job.key")
        env = {**os.environ, "OMP_NUM_THREADS": "1", KEY_FILE_ENV: str(Path(tmp) / "job.key")}
        for case in ("equal", "barrier", "paced"):
            print(f"{case} ...", file=sys.stderr, flush=True)
            results[case] = launch(args, case, steps, tmp, env)
        # The same tokens as the paced run, on equal workers: its workers' inner steps over K.
        equal_steps = round(sum(results["paced"]["inner_steps"]) / WORKERS)
        print(f"equal_tokens ({equal_steps} steps) ...", file=sys.stderr, flush=True)
        results["equal_tokens"] = launch(args, "equal_tokens", equal_steps, tmp, env)
    reference = results["equal"]["fast_steps_per_s"]
    useful = results["equal"]["fast_useful_share"]
    summary = {
        "throughput_barrier_vs_equal": results["barrier"]["fast_steps_per_s"] / reference,
        "throughput_paced_vs_equal": results["paced"]["fast_steps_per_s"] / reference,
        "useful_share_barrier_vs_equal": results["barrier"]["fast_useful_share"] / useful,
        "useful_share_paced_vs_equal": results["paced"]["fast_useful_share"] / useful,
        "val_loss_paced_vs_equal_tokens": results["paced"]["val_loss"] / results["equal_tokens"]["val_loss"],
    }
    print(f"model {args.model}, K = {WORKERS} workers x 4 sequences x {args.seq_length} tokens per step, "
          f"H = {args.sync_interval}, {steps} steps, 4-bit statistical + EF, link {SLOW_LINK['bandwidth_gbit_s']} "
          f"Gbit/s + {SLOW_LINK['latency_ms']} ms, slowdown {STRAGGLER}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'case':<13} {'fast steps/s':>12} {'fast useful':>11} {'val loss':>9} {'inner steps (per worker)':>25} "
          f"{'launch s':>9}")
    for case, r in results.items():
        print(f"{case:<13} {r['fast_steps_per_s']:>12.3f} {r['fast_useful_share']:>11.3f} {r['val_loss']:>9.4f} "
              f"{str(r['inner_steps']):>25} {r['launch_seconds']:>9.1f}")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    print(json.dumps({"summary": summary, "cases": results}))


if __name__ == "__main__":
    main()
