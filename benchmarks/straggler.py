"""Datacenters that are not equal (issue 43): K = 3 tiny workers, one slowed down 2x
(`muloco.emulate_slowdown`), over the emulated 1 Gbit/s, 50 ms link, on CPU.

    python benchmarks/straggler.py

Cases, each a torchrun launch of 3 ranks (K = 3 workers of one rank each), 4-bit statistical + EF:
  equal         every worker at full speed, fixed H (the reference)
  barrier       worker 2 at slowdown 2.0, fixed H: today's sync is a barrier, every worker at its pace
  paced         worker 2 at slowdown 2.0, `pace: {"mode": "wall_clock"}` (muloco/diloco/pace.py)
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

    python benchmarks/straggler.py --real-link 1gbit

The same static cases with each worker (one rank) in a network namespace of its own whose egress the
kernel limits to 1 Gbit/s (benchmarks/timed_runs.py; root), the 50 ms latency still emulated.

    python benchmarks/straggler.py --real-link 32mbit --slow-link

A datacenter whose LINK is the slow one: every worker at full compute speed, each in its namespace,
datacenter 2's egress limited to a quarter of RATE (8 Mbit/s here), the others' to RATE:
  equal    every link at RATE, fixed H (the reference)
  barrier  datacenter 2 at RATE / 4, fixed H
  paced    the same, `pace: {"mode": "wall_clock"}`
  overlap  the same, fixed H, `streaming.overlap_steps: "auto"` (up to H / 2 steps): the sync runs in
           the background while the inner steps go on
  equal_overlap  every link at RATE, the same overlap (overlap's reference: the overlap also hides
           the workers' wait for each other's noise, which the link has nothing to do with)
(pace with overlap is refused by the config: see docs/unequal_workers.md.) Per case: the fast workers'
and the slow worker's inner steps/s after the first window (syncs included), their outer seconds per
interval (the step hooks: the sync and its wait, or with overlap the wait for its result), and from
worker 0's records the bytes each rank sent per sync and the sync's wall time (mean and least: the
least is the transfer with the least wait for a worker that came late). Ratios against `equal`, and
overlap's also against `equal_overlap`.

    python benchmarks/straggler.py --elastic

The elastic mode (`muloco.elastic`, docs/multi_datacenter.md), where a worker can be left out of a
sync: the lighthouse and K = 3 workers, each its own launch (a world of one rank, its own master port,
`--worker-id k`), as in tests/test_elastic.py; the same link, compression and steps:
  elastic_equal    every worker at full speed (the reference)
  elastic_sigstop  worker 2 frozen (SIGSTOP) once its first outer record is written (it is then
                   training, not inside a quorum) and resumed (SIGCONT) when worker 0 has written the
                   record of the FROZEN_SYNCS-th sync after that one
Throughput of workers 0 and 1 as above. For worker 2: how many syncs it missed (worker 0's records
with 2 in `missing`) and whether it came back (a record of its own with `rejoined`, the state caught
up from a peer). ELASTIC_SETTINGS says which timeouts and why.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]

from timed_runs import link_block, link_name, run_world_on_real_link, timed_trainer, write_config

from tools.datacenters import rate_bits
from tools.trainer_runs import EXTENSIONS_ENV, free_port, shared_memory_files

WORKERS = 3
SLOW_LINK = {"bandwidth_gbit_s": 1, "latency_ms": 50}
FOUR_BIT_EF = {"method": "statistical", "bits": 4, "error_feedback": True}
STRAGGLER = [1.0, 1.0, 2.0]
FAST = [0, 1]
SLOW = 2  # the straggler: slowed down, frozen, or behind the slow link
SLOW_LINK_SHARE = 4  # --slow-link: datacenter 2's rate is RATE / 4
SLOW_LINK_CASES = ("equal", "barrier", "paced", "overlap", "equal_overlap")
OVERLAPPED = ("overlap", "equal_overlap")
FROZEN_SYNCS = 3
# The lighthouse forms a quorum at once when every worker still heartbeating (every 100 ms), or every
# member of the previous quorum, has asked; it waits --join-timeout-s (the grace window) only for a
# worker that heartbeats but has not asked.
# So a frozen worker costs the others --heartbeat-timeout-s at their first sync without it (1 s: ten
# missed heartbeats), while the join timeout can cover the start-up skew of healthy workers (10 s, on
# 2 shared cores). sync_timeout_s is what the others wait when a member freezes inside a quorum (not
# this case: see results/straggler.md); above the slowest healthy exchange (well under 1 s here).
ELASTIC_SETTINGS = {"join_timeout_s": 10.0, "heartbeat_timeout_s": 1.0, "sync_timeout_s": 5.0,
                    "quorum_timeout_s": 120.0, "quorum_request_timeout_s": 10.0}


def muloco_block(case: str, sync_interval: int, lighthouse: str = "", real_link: str | None = None,
                 slow_link: bool = False) -> dict:
    block = {"workers": WORKERS, "sync_interval": sync_interval, "outer_lr": 0.7, "outer_momentum": 0.6,
             "nesterov": True, "compression": FOUR_BIT_EF, "link": link_block(SLOW_LINK, real_link)}
    if lighthouse:
        block["sync_timeout_s"] = ELASTIC_SETTINGS["sync_timeout_s"]
        block["elastic"] = {"lighthouse": lighthouse, "quorum_timeout_s": ELASTIC_SETTINGS["quorum_timeout_s"],
                            "quorum_request_timeout_s": ELASTIC_SETTINGS["quorum_request_timeout_s"]}
    if case in ("barrier", "paced") and not slow_link:  # behind a slow link, every worker computes at full speed
        block["emulate_slowdown"] = STRAGGLER
    if case == "paced":
        block["pace"] = {"mode": "wall_clock"}
    if case in OVERLAPPED:
        block["streaming"] = {"overlap_steps": "auto", "max_overlap_steps": sync_interval // 2}
    return block


def link_rates(rate: str, case: str, slow_link: bool) -> list[str]:
    """Each datacenter's egress rate on the real link: `rate`, datacenter 2's a quarter of it in a slow-link
    case but the equal ones."""
    rates = [rate] * WORKERS
    if slow_link and not case.startswith("equal"):
        slow = rate_bits(rate) / SLOW_LINK_SHARE
        rates[SLOW] = f"{slow / 1e6:g}mbit" if slow % 1e6 == 0 else f"{slow / 1e3:g}kbit"
    return rates


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--sync-interval", type=int, default=20)
    p.add_argument("--syncs", type=int, default=6, help="outer syncs per run (the first window is warm-up)")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--elastic", action="store_true", help="the elastic cases: all equal, and worker 2 frozen")
    p.add_argument("--real-link", metavar="RATE",
                   help="the static cases with each worker in a network namespace of its own, its egress limited "
                        "to RATE by the kernel (1gbit: the emulated link's rate), the 50 ms still emulated (root)")
    p.add_argument("--slow-link", action="store_true",
                   help="with --real-link RATE: nobody slowed down, datacenter 2's link at RATE / 4 instead (the "
                        "cases equal, barrier, paced, overlap, equal_overlap)")
    p.add_argument("--workdir", help=argparse.SUPPRESS)  # these four are set by the launcher
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-id", type=int, help=argparse.SUPPRESS)  # elastic: this launch's worker
    return p.parse_args(argv)


def run_dir(workdir: str | Path, case: str, worker: int | None) -> Path:
    """A case's run folder; in the elastic mode each worker's, under the case's."""
    return Path(workdir) / case if worker is None else Path(workdir) / case / f"worker{worker}"


def train_one(args: argparse.Namespace) -> None:
    """One rank of case `--case` (of worker `--worker-id` in the elastic mode): its metrics.jsonl (rank 0)
    and its step times in its run folder."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from muloco.core.comm import COLLECTIVE_TIMEOUT
    from trainer.config import build_parser, resolve
    from trainer.run import run

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=COLLECTIVE_TIMEOUT)
    workdir = Path(args.workdir)
    elastic = [] if args.worker_id is None else ["--worker-id", str(args.worker_id)]
    flags = build_parser().parse_args([
        "--ds_config", str(workdir / f"{args.case}.json"), "--model", args.model, "--data-path",
        str(workdir / "markov"), "--vocab-size", "1000", "--train-iters", str(args.steps), "--seq-length",
        str(args.seq_length), "--micro-batch-size", "4", "--log-interval", str(args.sync_interval),
        "--eval-interval", str(args.steps), "--eval-iters", "8", "--lr-warmup-iters", str(args.sync_interval),
        "--run-dir", str(run_dir(workdir, args.case, args.worker_id)), *elastic])
    run(resolve(flags, dist.get_world_size()), timed_trainer())


def forwarded(args: argparse.Namespace, case: str, steps: int, workdir: str) -> list[str]:
    return [__file__, "--model", args.model, "--sync-interval", str(args.sync_interval), "--seq-length",
            str(args.seq_length), "--workdir", workdir, "--case", case, "--steps", str(steps)]


def launch(args: argparse.Namespace, case: str, steps: int, workdir: str, env: dict) -> dict:
    write_config(Path(workdir) / f"{case}.json",
                 muloco_block(case, args.sync_interval, real_link=args.real_link, slow_link=args.slow_link))
    started = time.perf_counter()
    if args.real_link:
        logs = Path(workdir) / f"{case}.logs"
        logs.mkdir()
        run_world_on_real_link(link_rates(args.real_link, case, args.slow_link), forwarded(args, case, steps, workdir),
                               env, REPO_ROOT, logs)
    else:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORKERS}",
                        *forwarded(args, case, steps, workdir)], check=True, env=env, cwd=REPO_ROOT,
                       stdout=subprocess.DEVNULL)
    run = run_dir(workdir, case, None)
    per_rank = [json.loads((run / f"step_times.rank{k}.json").read_text()) for k in range(WORKERS)]
    return read_run(read_records(run), per_rank, args.sync_interval, time.perf_counter() - started)


def read_records(run: Path) -> list[dict]:
    """A run's metrics.jsonl records; while it runs, the lines written in full (the last may not be)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().split("\n")[:-1] if line]


def outer_records(run: Path) -> list[dict]:
    """The outer syncs' records written so far (none before the first)."""
    path = run / "metrics.jsonl"
    return [r for r in read_records(run) if "outer_step" in r] if path.exists() else []


def launch_elastic(args: argparse.Namespace, case: str, steps: int, workdir: str, env: dict) -> dict:
    """The lighthouse and one launch per worker (a world of one rank each); in `elastic_sigstop` worker 2
    frozen for FROZEN_SYNCS of the others' syncs. Every process started here is killed on the way out,
    and the shared-memory files named by their master ports removed."""
    lighthouse_port, ports, procs = free_port(), [], []
    write_config(Path(workdir) / f"{case}.json",
                 muloco_block(case, args.sync_interval, f"http://127.0.0.1:{lighthouse_port}"))

    def start(command: list[str], extra_env: dict) -> subprocess.Popen:
        with open(Path(workdir) / f"{case}.{len(procs)}.log", "w") as log:  # its own process group: killed whole
            procs.append(subprocess.Popen(command, env={**env, **extra_env}, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                          stderr=log, start_new_session=True))
        return procs[-1]

    started = time.perf_counter()
    frozen_s = 0.0
    try:
        start([sys.executable, "-m", "muloco.elastic.lighthouse", "--bind", f"127.0.0.1:{lighthouse_port}",
               "--join-timeout-s", str(ELASTIC_SETTINGS["join_timeout_s"]),
               "--heartbeat-timeout-s", str(ELASTIC_SETTINGS["heartbeat_timeout_s"])], {})
        workers = []
        for k in range(WORKERS):
            ports.append(free_port())
            world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[-1])}
            workers.append(start([sys.executable, *forwarded(args, case, steps, workdir), "--worker-id", str(k)],
                                 world))
        if case == "elastic_sigstop":
            frozen_s = freeze_worker_2(workers, run_dir(workdir, case, 0), run_dir(workdir, case, 2))
        for k, worker in enumerate(workers):
            if worker.wait() != 0:  # the workdir goes with the launcher: the end of its log now
                log = (Path(workdir) / f"{case}.{k + 1}.log").read_text()[-4000:]
                raise RuntimeError(f"{case}: worker {k} exited with {worker.returncode}; its log ends:\n{log}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for port in ports:
            for path in shared_memory_files(port):
                path.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    runs = [run_dir(workdir, case, k) for k in range(WORKERS)]
    per_worker = [json.loads((run / "step_times.rank0.json").read_text()) for run in runs]
    result = read_run(read_records(runs[0]), per_worker, args.sync_interval, seconds)
    outer = outer_records(runs[0])
    worker_2 = outer_records(runs[2])
    result.update(syncs_without_2=sum(2 in r["missing"] for r in outer), syncs=len(outer),
                  worker_2_rejoined=any(r["rejoined"] for r in worker_2), worker_2_syncs=len(worker_2),
                  frozen_s=frozen_s)
    return result


def freeze_worker_2(workers: list[subprocess.Popen], run_0: Path, run_2: Path) -> float:
    """SIGSTOP worker 2 once its first outer record is written, SIGCONT once worker 0 has written
    FROZEN_SYNCS more; how long it was stopped."""
    while not outer_records(run_2):
        if workers[2].poll() is not None:
            raise RuntimeError("worker 2 ended before its first sync")
        time.sleep(0.05)
    os.killpg(workers[2].pid, signal.SIGSTOP)
    # Counted from worker 2's last sync, not from worker 0's records so far: worker 0 may not have
    # written that sync's record yet.
    stopped, resume_after = time.perf_counter(), outer_records(run_2)[-1]["outer_step"] + FROZEN_SYNCS
    while not any(r["outer_step"] >= resume_after for r in outer_records(run_0)):
        if workers[0].poll() is not None:
            raise RuntimeError(f"worker 0 ended before outer step {resume_after}")
        time.sleep(0.05)
    os.killpg(workers[2].pid, signal.SIGCONT)
    return time.perf_counter() - stopped


def read_run(records: list[dict], per_rank: list[dict], sync_interval: int, seconds: float) -> dict:
    """A case's figures from worker 0's records and each worker's step times (step_times.rank<R>.json)."""
    outer = [r for r in records if "outer_step" in r]
    val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
    # Each fast worker after its first window: its inner steps over the time they took (syncs included),
    # and the share of that time outside its step hooks (the outer sync and its wait): its useful compute.
    # Its outer seconds per interval: the hooks' time over the windows after the first.
    steps_per_s, useful, outer_s = [], [], []
    for rank in per_rank:
        times, hooks = rank["times"], rank["hooks"]
        wall = times[-1] - times[sync_interval - 1]
        steps_per_s.append((len(times) - sync_interval) / wall)
        useful.append(1 - sum(hooks[sync_interval:]) / wall)
        outer_s.append(sum(hooks[sync_interval:]) / ((len(times) - sync_interval) / sync_interval))
    taken = [len(rank["times"]) for rank in per_rank]
    if outer and "inner_steps" in outer[0]:  # paced: what each worker took, as its headers said
        taken = [sum(r["inner_steps"][k] for r in outer) for k in range(WORKERS)]
    measured = [r for r in outer if "bytes_sent_per_rank" in r][1:]  # after the first sync, as above
    return {"fast_steps_per_s": min(steps_per_s[k] for k in FAST), "fast_useful_share": min(useful[k] for k in FAST),
            "slow_steps_per_s": steps_per_s[SLOW], "fast_outer_s": max(outer_s[k] for k in FAST),
            "slow_outer_s": outer_s[SLOW], "val_loss": val_loss, "inner_steps": taken, "launch_seconds": seconds,
            "bytes_per_sync": mean(r["bytes_sent_per_rank"] for r in measured),
            "sync_seconds": mean(r["sync_seconds"] for r in measured),
            "least_sync_seconds": min((r["sync_seconds"] for r in measured), default=float("nan")),
            "overlap_steps": mean(r.get("overlap_steps", 0) for r in measured)}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        train_one(args)
        return
    from tools.synthetic_data import write_markov_dataset

    from muloco.diloco.auth import KEY_FILE_ENV, write_new_key

    if args.slow_link and (not args.real_link or args.elastic):
        sys.exit("--slow-link needs --real-link RATE (every datacenter's rate but the slow one's), static cases only")
    steps = args.sync_interval * args.syncs
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=1000)
        write_new_key(Path(tmp) / "job.key")
        env = {**os.environ, **EXTENSIONS_ENV, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", KEY_FILE_ENV: str(Path(tmp) / "job.key")}
        if args.elastic:
            if args.real_link:
                sys.exit("--real-link runs the static cases; the elastic mode on a real link is scripts/datacenters.sh")
            for case in ("elastic_equal", "elastic_sigstop"):
                print(f"{case} ...", file=sys.stderr, flush=True)
                results[case] = launch_elastic(args, case, steps, tmp, env)
            report_elastic(args, steps, results)
            return
        if args.slow_link:
            for case in SLOW_LINK_CASES:
                print(f"{case} ...", file=sys.stderr, flush=True)
                results[case] = launch(args, case, steps, tmp, env)
            report_slow_link(args, steps, results)
            return
        for case in ("equal", "barrier", "paced"):
            print(f"{case} ...", file=sys.stderr, flush=True)
            results[case] = launch(args, case, steps, tmp, env)
        # The same tokens as the paced run, on equal workers: its workers' inner steps over K.
        equal_steps = round(sum(results["paced"]["inner_steps"]) / WORKERS)
        print(f"equal_tokens ({equal_steps} steps) ...", file=sys.stderr, flush=True)
        results["equal_tokens"] = launch(args, "equal_tokens", equal_steps, tmp, env)
    report_static(args, steps, results)


@dataclass(frozen=True)
class Column:
    """One column of a report's table: its label, its width, the value of a case (a key of its results, or a
    function of them) and the value's format after the width ("": as text)."""
    label: str
    width: int
    value: str | Callable[[dict], object]
    spec: str = ""

    def cell(self, result: dict) -> str:
        value = result[self.value] if isinstance(self.value, str) else self.value(result)
        return format(value if self.spec else str(value), f">{self.width}{self.spec}")


def print_table(title: str, case_width: int, columns: list[Column], results: dict, summary: dict) -> None:
    """A report: its title line, one row per case, then each summary ratio on a line of its own."""
    print(title)
    print(" ".join([f"{'case':<{case_width}}", *(f"{c.label:>{c.width}}" for c in columns)]))
    for case, result in results.items():
        print(" ".join([f"{case:<{case_width}}", *(c.cell(result) for c in columns)]))
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")


def report_static(args: argparse.Namespace, steps: int, results: dict) -> None:
    reference = results["equal"]["fast_steps_per_s"]
    useful = results["equal"]["fast_useful_share"]
    summary = {
        "throughput_barrier_vs_equal": results["barrier"]["fast_steps_per_s"] / reference,
        "throughput_paced_vs_equal": results["paced"]["fast_steps_per_s"] / reference,
        "useful_share_barrier_vs_equal": results["barrier"]["fast_useful_share"] / useful,
        "useful_share_paced_vs_equal": results["paced"]["fast_useful_share"] / useful,
        "val_loss_paced_vs_equal_tokens": results["paced"]["val_loss"] / results["equal_tokens"]["val_loss"],
    }
    print_table(f"model {args.model}, K = {WORKERS} workers x 4 sequences x {args.seq_length} tokens per step, "
                f"H = {args.sync_interval}, {steps} steps, 4-bit statistical + EF, link "
                f"{link_name(SLOW_LINK, args.real_link)}, slowdown {STRAGGLER}, {time.strftime('%Y-%m-%d %H:%M')}",
                13, [Column("fast steps/s", 12, "fast_steps_per_s", ".3f"),
                     Column("fast useful", 11, "fast_useful_share", ".3f"), Column("val loss", 9, "val_loss", ".4f"),
                     Column("inner steps (per worker)", 25, "inner_steps"),
                     Column("launch s", 9, "launch_seconds", ".1f")],
                results, summary)
    print(json.dumps({"summary": summary, "link": link_name(SLOW_LINK, args.real_link), "cases": results}))


def report_slow_link(args: argparse.Namespace, steps: int, results: dict) -> None:
    summary = {}
    for case, reference in [(c, "equal") for c in SLOW_LINK_CASES[1:]] + [("overlap", "equal_overlap")]:
        for who in ("fast", "slow"):
            summary[f"{who}_throughput_{case}_vs_{reference}"] = (results[case][f"{who}_steps_per_s"]
                                                                 / results[reference][f"{who}_steps_per_s"])
    slow_rate = link_rates(args.real_link, "barrier", True)[SLOW]
    print_table(f"model {args.model}, K = {WORKERS} workers x 4 sequences x {args.seq_length} tokens per step, "
                f"H = {args.sync_interval}, {steps} steps, 4-bit statistical + EF, links real {args.real_link} (tbf, a "
                f"namespace per worker) + {SLOW_LINK['latency_ms']} ms emulated, datacenter {SLOW} at {slow_rate} but "
                f"in `equal`, {time.strftime('%Y-%m-%d %H:%M')}",
                13, [Column("fast steps/s", 12, "fast_steps_per_s", ".3f"),
                     Column("slow steps/s", 12, "slow_steps_per_s", ".3f"),
                     Column("fast outer s", 12, "fast_outer_s", ".3f"),
                     Column("slow outer s", 12, "slow_outer_s", ".3f"),
                     Column("MB/sync", 7, lambda r: r["bytes_per_sync"] / 1e6, ".3f"),
                     Column("sync s", 6, "sync_seconds", ".3f"), Column("least", 6, "least_sync_seconds", ".3f"),
                     Column("tau", 4, "overlap_steps", ".1f"), Column("val loss", 8, "val_loss", ".4f"),
                     Column("inner steps", 16, "inner_steps"), Column("launch s", 8, "launch_seconds", ".1f")],
                results, summary)
    print(json.dumps({"summary": summary, "rates": {"fast": args.real_link, "slow": slow_rate}, "cases": results}))


def report_elastic(args: argparse.Namespace, steps: int, results: dict) -> None:
    equal, frozen = results["elastic_equal"], results["elastic_sigstop"]
    summary = {"throughput_sigstop_vs_elastic_equal": frozen["fast_steps_per_s"] / equal["fast_steps_per_s"],
               "useful_share_sigstop_vs_elastic_equal": frozen["fast_useful_share"] / equal["fast_useful_share"],
               "val_loss_sigstop_vs_elastic_equal": frozen["val_loss"] / equal["val_loss"]}
    print_table(f"model {args.model}, K = {WORKERS} elastic workers x 4 sequences x {args.seq_length} tokens per "
                f"step, H = {args.sync_interval}, {steps} steps, 4-bit statistical + EF, link "
                f"{SLOW_LINK['bandwidth_gbit_s']} Gbit/s + {SLOW_LINK['latency_ms']} ms, worker 2 stopped for "
                f"{FROZEN_SYNCS} syncs, "
                f"{ELASTIC_SETTINGS}, {time.strftime('%Y-%m-%d %H:%M')}",
                16, [Column("fast steps/s", 12, "fast_steps_per_s", ".3f"),
                     Column("fast useful", 11, "fast_useful_share", ".3f"), Column("val loss", 9, "val_loss", ".4f"),
                     Column("syncs", 5, "syncs"), Column("without 2", 9, "syncs_without_2"),
                     Column("2 rejoined", 10, "worker_2_rejoined"), Column("2 syncs", 7, "worker_2_syncs"),
                     Column("2 frozen s", 10, "frozen_s", ".1f"), Column("launch s", 9, "launch_seconds", ".1f")],
                results, summary)
    if equal["syncs_without_2"]:  # a worker that started more than the join timeout late, on a loaded machine
        print(f"NOT all equal: worker 2 missed {equal['syncs_without_2']} sync(s) of the reference run")
    print(json.dumps({"summary": summary, "cases": results}))


if __name__ == "__main__":
    main()
