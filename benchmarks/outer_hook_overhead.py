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
  sync+link, tau=auto  the same, each sync's tau picked from the previous one's wall time
  elastic nosync    the elastic mode (each worker its own job, a torchft lighthouse with the job
                    secret, muloco/elastic/), the outer loop never syncing after the first quorum
  elastic sync+link, tau=1   the elastic mode syncing over the link, tau = 1
With `--real-link RATE` (root) the static cases run with each worker in a network namespace of its own
whose egress the kernel limits to RATE (benchmarks/timed_runs.py), the link's 50 ms still emulated.
Elastic cases are compared with `elastic nosync` (the same runs with syncs disabled), the others with
`nosync`. Beside each ratio, per sync: the time the emulated link held it (`link_seconds`), the CPU
time of the sync's own work (`sync_cpu_seconds`: encode, decode, checks, tags, on the thread that ran
it) and how long applying the result waited for the background sync (`apply_wait_seconds`), which
tells a codec competing with the inner step for the rank's core from a link that is not hidden.
Each rank (an elastic case's worker) runs on a core of its own (`--no-pin`: wherever the OS puts
it): left to the OS, two workers on two cores share them unevenly, one 10-15% slower than the other
in a run, and the waits of a synchronous step then swing the ratios by more than a sync's cost; pinned,
a sync's own CPU work competes with its rank's inner step, as it does on a real worker's host.
The cases are interleaved `--repeats` times, each repeat in an order rotated by one, so machine load
drifts hit all of them alike. Throughput is the job's over the windows of H steps after the first
(each window holds one sync; the first is warm-up): tokens over the time the slowest rank takes to
run them. Every rank times its own steps; a job goes at its slowest worker's pace, and taking rank
0's clock alone would let the free-running nosync baseline skip the waits for a slower peer that any
synchronous step (this sync, or DP's all-reduce) pays. Per case the median over the repeats;
overhead_vs_nosync = nosync tokens/s / case tokens/s, with a 95% bootstrap interval of the median of
the per-repeat ratios (each case against its baseline of the same repeat), and the baseline's own
spread (its fastest over its slowest run: how noisy the machine was during the command). Also reported: cross-datacenter round
trips per sync, on its critical path (metrics.jsonl's `round_trips`: the exchange, which carries the
skip vote) and in the background after the result is applied (`background_round_trips`: the
metrics), and the mean sync wall time. Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from timed_runs import link_block, link_name, run_world_on_real_link, timed_trainer, write_config

SLOW_LINK = {"bandwidth_gbit_s": 1, "latency_ms": 50}
FOUR_BIT_EF = {"method": "statistical", "bits": 4, "error_feedback": True}


ELASTIC = {"quorum_timeout_s": 300, "max_attempts": 2}  # the lighthouse's address comes from $TORCHFT_LIGHTHOUSE


def cases(sync_interval: int, steps: int, real_link: str | None = None) -> dict[str, dict]:
    """Name -> muloco block (on a real link: the static cases only)."""
    # No final sync: the baseline must not sync at its last step, and the cases are measured in steady state.
    muloco = {"workers": 2, "sync_interval": sync_interval, "outer_lr": 0.7, "outer_momentum": 0.6,
              "nesterov": True, "compression": FOUR_BIT_EF, "final_sync": False}
    link = link_block(SLOW_LINK, real_link)
    tau1 = {"link": link, "streaming": {"overlap_steps": 1}}
    static = {
        "nosync": {**muloco, "sync_interval": steps + 1},
        "sync": muloco,
        "sync+link": {**muloco, "link": link},
        "sync+link, tau=1": {**muloco, **tau1},
        "sync+link, tau=2": {**muloco, "link": link, "streaming": {"overlap_steps": 2}},
        "sync+link, tau=auto": {**muloco, "link": link, "streaming": {"overlap_steps": "auto"}},
    }
    if real_link:
        return static
    return {**static, "elastic nosync": {**muloco, "sync_interval": steps + 1, "elastic": ELASTIC},
            "elastic sync+link, tau=1": {**muloco, **tau1, "elastic": ELASTIC}}


def bootstrap_interval(ratios: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the median of `ratios` over resamples with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def baseline_of(case: str) -> str:
    return "elastic nosync" if case.startswith("elastic") else "nosync"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--sync-interval", type=int, default=30)
    p.add_argument("--windows", type=int, default=2, help="measured windows of H steps per run (after one warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--no-pin", action="store_true",
                   help="let the OS place the ranks (default: rank, or elastic worker, k on core k mod cores)")
    p.add_argument("--cases", nargs="+", help="run only these cases (and their baselines)")
    p.add_argument("--real-link", metavar="RATE",
                   help="the static cases with each worker in a network namespace of its own, its egress limited "
                        "to RATE by the kernel (1gbit: the emulated link's rate), the 50 ms still emulated (root)")
    p.add_argument("--workdir", help=argparse.SUPPRESS)  # these three are set by the launcher
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--run-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-id", type=int, help=argparse.SUPPRESS)  # an elastic case's worker
    return p.parse_args(argv)


def run_order(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Repeat r runs the cases rotated by r, so a load that drifts during the command does not always
    favour the case that runs first."""
    names = case_names(args)
    return [(name, repeat) for repeat in range(args.repeats)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]]


def case_names(args: argparse.Namespace) -> list[str]:
    names = list(cases(args.sync_interval, steps(args), args.real_link))
    if args.cases:
        unknown = set(args.cases) - set(names)
        if unknown:
            sys.exit(f"unknown cases {sorted(unknown)}; known: {names}")
        wanted = set(args.cases) | {baseline_of(name) for name in args.cases}
        names = [name for name in names if name in wanted]
    return names


def steps(args: argparse.Namespace) -> int:
    return (args.windows + 1) * args.sync_interval


def train_one(args: argparse.Namespace) -> None:
    """One rank of run `--run-index` (case `--case`); it writes its metrics.jsonl and step times under
    the workdir."""
    if not args.no_pin:  # before torch starts its threads: they inherit the core
        k = args.worker_id if args.worker_id is not None else int(os.environ["RANK"])
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[k % len(cores)]})
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from muloco.core.comm import COLLECTIVE_TIMEOUT
    from trainer.config import build_parser, resolve
    from trainer.run import run

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=COLLECTIVE_TIMEOUT)
    workdir, i = Path(args.workdir), args.run_index
    ds_path = workdir / f"run{i}.json"
    elastic = args.worker_id is not None
    if dist.get_rank() == 0 and not elastic:  # an elastic case's launcher wrote it
        write_config(ds_path, cases(args.sync_interval, steps(args), args.real_link)[args.case])
    dist.barrier()
    run_dir = workdir / f"run{i}" / (f"worker{args.worker_id}" if elastic else "")
    flags = build_parser().parse_args([
        "--ds_config", str(ds_path), "--model", args.model, "--data-path", str(workdir / "markov"),
        "--vocab-size", "1000", "--train-iters", str(steps(args)), "--seq-length", str(args.seq_length),
        "--micro-batch-size", "4", "--log-interval", str(args.sync_interval), "--eval-interval", "0",
        "--run-dir", str(run_dir), *(["--worker-id", str(args.worker_id)] if elastic else [])])
    run(resolve(flags, dist.get_world_size()), timed_trainer())


def read_run(run_dir: Path, sync_interval: int) -> tuple[float, list[dict]]:
    """(the job's tokens/s over the windows after the first, the outer-sync records). An elastic run's
    folder holds a folder per worker: the job is both, at the slower one's pace."""
    dirs = sorted(run_dir.glob("worker*")) or [run_dir]
    records = [json.loads(line) for line in (dirs[0] / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "tokens_per_s" in r)
    tokens_per_step = first["tokens"] // first["step"]
    per_rank = [json.loads(path.read_text())["times"] for d in dirs for path in sorted(d.glob("step_times.rank*.json"))]
    measured = len(per_rank[0]) - sync_interval  # steps after the first window
    slowest = max(times[-1] - times[sync_interval - 1] for times in per_rank)
    return measured * tokens_per_step / slowest, [r for r in records if "outer_step" in r]


def launch(args: argparse.Namespace, name: str, i: int, workdir: str, env: dict) -> None:
    """One run of case `name`: a torchrun launch of 2 ranks (K = 2 workers of one rank each), or for an
    elastic case a lighthouse and one single-process job per worker."""
    forwarded = [__file__, "--model", args.model, "--sync-interval", str(args.sync_interval), "--windows",
                 str(args.windows), "--seq-length", str(args.seq_length), "--workdir", workdir, "--case", name,
                 "--run-index", str(i), *(["--no-pin"] if args.no_pin else []),
                 *(["--real-link", args.real_link] if args.real_link else [])]
    if args.real_link:
        logs = Path(workdir) / f"run{i}.logs"
        logs.mkdir()
        run_world_on_real_link([args.real_link] * 2, forwarded, env, REPO_ROOT, logs)
        return
    if not name.startswith("elastic"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        *forwarded], check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        return
    write_config(Path(workdir) / f"run{i}.json", cases(args.sync_interval, steps(args))[name])
    port = free_port()
    lighthouse = subprocess.Popen([sys.executable, "-m", "muloco.elastic.lighthouse", "--bind", f"127.0.0.1:{port}",
                                   "--join-timeout-s", "5", "--heartbeat-timeout-s", "5"], env=env, cwd=REPO_ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        jobs = [subprocess.Popen([sys.executable, *forwarded, "--worker-id", str(k)], cwd=REPO_ROOT,
                                 env={**env, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "RANK": "0",
                                      "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": str(free_port())}, stdout=subprocess.DEVNULL)
                for k in range(2)]
        if any(job.wait() for job in jobs):
            raise RuntimeError(f"an elastic worker of run {i} ({name}) failed")
    finally:
        lighthouse.terminate()
        lighthouse.wait()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        train_one(args)
        return
    from tools.synthetic_data import write_markov_dataset

    from muloco.diloco.auth import KEY_FILE_ENV, write_new_key

    order = run_order(args)
    with tempfile.TemporaryDirectory() as tmp:
        write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=1000)
        write_new_key(Path(tmp) / "job.key")  # K = 2 workers talk: with the job secret, as a user runs them
        env = {**os.environ, "OMP_NUM_THREADS": "1", KEY_FILE_ENV: str(Path(tmp) / "job.key")}
        for i, (name, repeat) in enumerate(order):
            print(f"run {i + 1}/{len(order)}: {name} (repeat {repeat + 1})", file=sys.stderr, flush=True)
            launch(args, name, i, tmp, env)
        results = [read_run(Path(tmp) / f"run{i}", args.sync_interval) for i in range(len(order))]
    names = case_names(args)
    tokens = {name: [results[i][0] for i, (n, _) in enumerate(order) if n == name] for name in names}
    syncs = {name: [s for i, (n, _) in enumerate(order) if n == name for s in results[i][1]] for name in names}
    # Per repeat, each case against its baseline of the same repeat (the runs are interleaved).
    ratios = {name: [b / t for b, t in zip(tokens[baseline_of(name)], tokens[name])] for name in names}
    spread = max(tokens["nosync"]) / min(tokens["nosync"]) if "nosync" in tokens else None
    print(f"model {args.model}, K = 2 workers x 4 sequences x {args.seq_length} tokens per step, H = {args.sync_interval}, "
          f"4-bit statistical + EF, link {link_name(SLOW_LINK, args.real_link)}; "
          f"medians of {args.repeats} interleaved runs; ranks {'not pinned' if args.no_pin else 'pinned to cores'}; "
          f"nosync spread {spread or float('nan'):.3f} (fastest / slowest run), {time.strftime('%Y-%m-%d')}")
    print(f"{'case':<26} {'tokens/s':>9} {'overhead_vs_nosync':>19} {'95% interval':>16} {'tau':>5} "
          f"{'runs (tokens/s)':>26} {'round trips':>12} {'background':>11} {'sync s':>7} {'link s':>7} "
          f"{'sync CPU s':>11} {'apply wait s':>13} {'MB/rank/sync':>13}")
    rows = []
    for name in names:
        median = statistics.median(tokens[name])
        records = syncs[name]
        mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in records) if records else 0.0  # noqa: E731
        row = {"case": name, "tokens_per_s": median, "overhead_vs_nosync": statistics.median(ratios[name]),
               "interval": bootstrap_interval(ratios[name]), "overlap_steps": mean("overlap_steps"),
               "runs_tokens_per_s": tokens[name],
               "round_trips_per_sync": statistics.fmean(r["round_trips"] for r in records) if records else 0,
               "background_round_trips_per_sync":
                   statistics.fmean(r["background_round_trips"] for r in records) if records else 0,
               "sync_seconds": statistics.fmean(r["sync_seconds"] for r in records) if records else 0.0,
               "bytes_per_rank_per_sync": statistics.fmean(r["bytes_sent_per_rank"] for r in records) if records else 0,
               "link_seconds": mean("link_seconds"), "sync_cpu_seconds": mean("sync_cpu_seconds"),
               "apply_wait_seconds": mean("apply_wait_seconds")}
        rows.append(row)
        runs = " ".join(f"{t:.0f}" for t in tokens[name])
        interval = f"[{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]"
        print(f"{name:<26} {median:>9.0f} {row['overhead_vs_nosync']:>19.3f} {interval:>16} {row['overlap_steps']:>5.2f} "
              f"{runs:>26} "
              f"{row['round_trips_per_sync']:>12.1f} {row['background_round_trips_per_sync']:>11.1f} "
              f"{row['sync_seconds']:>7.3f} {row['link_seconds']:>7.3f} {row['sync_cpu_seconds']:>11.3f} "
              f"{row['apply_wait_seconds']:>13.3f} {row['bytes_per_rank_per_sync'] / 1e6:>13.3f}")
    print(json.dumps({"model": args.model, "link": link_name(SLOW_LINK, args.real_link), "sync_interval": args.sync_interval,
                      "repeats": args.repeats,
                      "pinned": not args.no_pin, "nosync_spread": spread, "date": time.strftime("%Y-%m-%d"),
                      "load_average": os.getloadavg(), "rows": rows}))


if __name__ == "__main__":
    main()
