"""The training stall of a checkpoint save: the step time of a run that saves every N steps against the
same run without saves, synchronous (the default) and --async-save, at the 150m preset's shapes (the
paper's ~128k vocabulary) on CPU in one process, the real trainer and Checkpointer.

python benchmarks/async_save_stall.py [--preset 150m] [--interval 2] [--saves 3] [--repeats 1] [--out DIR]

Each run trains (saves + 1) x interval steps (sequence length 128, one sequence) and saves at every
interval; a run's end saves too (the trainer always does), so the measured window is steps 2 to the
one before the last: with interval >= 2 it holds `saves` periodic saves, each followed by interval - 1
steps in the window (an asynchronous save's write overlaps them). The ratio is the mean step time (the
step and its hooks: the save, or its host copy) over the window against the run without saves; runs alternate
(none, sync, async) `repeats` times, each ratio against the no-save run of its own round. Also
printed: the median time a save's hook held its step (`checkpoint_seconds`: the whole save, or the
host copy plus any wait for the previous save), which the load of the machine disturbs less. The writer
thread shares the machine's cores with training: the load average is printed with the numbers.
The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from trainer.training import Trainer
from tools.trainer_runs import TINY_VOCAB, init_distributed, run_trainer, tiny_flags

VOCAB = 128_000  # the paper's parameter counts include it (150m: 131M of its parameters)
MODES = ("none", "sync", "async")


class TimedTrainer(Trainer):
    """Records the wall time of each step, its step hooks included (where a save stalls training), and
    the seconds the checkpoint hook itself held the step (None: no save at that step)."""

    step_seconds: list[float] = []
    save_seconds: list[float | None] = []

    def train_step(self):
        start = time.perf_counter()
        result = super().train_step()
        TimedTrainer.step_seconds.append(time.perf_counter() - start)
        TimedTrainer.save_seconds.append(result.hook_values.get("checkpoint_seconds"))
        return result


def run(mode: str, preset: str, interval: int, steps: int, work: Path, data: str) -> tuple[list, list]:
    folder = work / mode
    shutil.rmtree(folder, ignore_errors=True)
    saves = [] if mode == "none" else ["--save", str(folder / "ckpt"), "--save-interval", str(interval),
                                       "--keep-last", "1", *(["--async-save"] if mode == "async" else [])]
    flags = tiny_flags(data, folder / "run", "muon", "--seq-length", "128", "--micro-batch-size", "1",
                       "--train-iters", str(steps), "--eval-interval", "0",
                       "--log-interval", str(steps), *saves)
    flags[flags.index("tiny")] = preset
    flags[flags.index("--vocab-size") + 1] = str(VOCAB)
    TimedTrainer.step_seconds, TimedTrainer.save_seconds = [], []
    run_trainer(flags, TimedTrainer)
    shutil.rmtree(folder, ignore_errors=True)
    return TimedTrainer.step_seconds, TimedTrainer.save_seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="150m")
    p.add_argument("--interval", type=int, default=2, help="N: save every N steps")
    p.add_argument("--saves", type=int, default=3, help="periodic saves before the last step's")
    p.add_argument("--repeats", type=int, default=1, help="rounds of (none, sync, async)")
    p.add_argument("--out", default=None, help="work folder (default: a temporary one, removed afterwards)")
    args = p.parse_args(argv)
    from tools.synthetic_data import write_markov_dataset

    work = Path(args.out or tempfile.mkdtemp(prefix="async_save_stall_"))
    work.mkdir(parents=True, exist_ok=True)
    init_distributed()
    data = write_markov_dataset(str(work / "markov"), vocab_size=TINY_VOCAB)
    steps = (args.saves + 1) * args.interval
    window = slice(1, steps - 1)  # steps 2 .. steps - 1
    saves_in_window = sum(1 for step in range(2, steps) if step % args.interval == 0)
    rounds = []
    for _ in range(args.repeats):
        means, held = {}, {}
        for mode in MODES:
            step_seconds, save_seconds = run(mode, args.preset, args.interval, steps, work, data)
            means[mode] = statistics.mean(step_seconds[window])
            held[mode] = statistics.median([s for s in save_seconds[window] if s is not None] or [0.0])
        rounds.append({**{f"{m}_step_s": means[m] for m in MODES},
                       "sync_ratio": means["sync"] / means["none"], "async_ratio": means["async"] / means["none"],
                       "sync_save_held_s": held["sync"], "async_save_held_s": held["async"],
                       "load_average": os.getloadavg()[0]})
        r = rounds[-1]
        print(f"{args.preset}, save every {args.interval} steps: step {r['none_step_s']:.2f}s without saves | "
              f"synchronous {r['sync_step_s']:.2f}s ({r['sync_ratio']:.2f}x; a save holds its step "
              f"{r['sync_save_held_s']:.2f}s) | asynchronous {r['async_step_s']:.2f}s ({r['async_ratio']:.2f}x; "
              f"{r['async_save_held_s']:.2f}s) | load average {r['load_average']:.1f}", flush=True)
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    summary = {key: statistics.median(r[key] for r in rounds) for key in ("sync_ratio", "async_ratio")}
    print(json.dumps({"benchmark": "async_save_stall", "preset": args.preset, "interval": args.interval,
                      "window_steps": steps - 2, "saves_in_window": saves_in_window, "rounds": rounds,
                      "median": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
