"""Tool start-up: each command's `--help` against `python -c "import torch"` and `python -c pass`, and the whole
preprocessing command with 2 processes against 1 on one JSONL file.

python benchmarks/tool_startup.py [--repeats 5] [--mb 40 160] [--scaling-repeats 3] [--checkout DIR]
    [--skip-help] [--skip-scaling]

--help: every command the README names, run as it writes it, wall clock of the whole process; the commands and the
two baselines take turns --repeats times (so a burst of load hits them alike) and each ratio is of the medians.

Scaling: the whole `python tools/preprocess_data.py ... --processes 1` and `--processes 2` command (start-up,
tokenizing, merge), taking turns --scaling-repeats times, on one uncompressed JSONL file of each --mb size made from
the sample corpus as benchmarks/preprocess_throughput.py makes its corpus, with the 4096-piece SentencePiece model
it trains; ratio of the medians. Next to it, the CPU seconds of all the run's processes: equal for 1 and 2 processes
means the split adds no work, so on two free cores the ratio is what the start-up leaves. The 1-minute load average
is printed with every number: on a shared machine a wall clock depends on what else got the cores. The 2-process
output is checked byte-for-byte against the 1-process output.

--checkout DIR runs another checkout's commands (e.g. before a change) with the same baselines and corpus.
The last line printed is a JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.preprocess_throughput import corpus_lines, identical, sentencepiece_model

ROOT = Path(__file__).resolve().parents[1]
# Every command the README names, as it writes them (tests/test_tool_startup.py holds that none imports Megatron,
# transformers or DeepSpeed for --help).
COMMANDS = {
    "tokenizer.train": ["-m", "tokenizer.train"],
    "preprocess_data": ["tools/preprocess_data.py"],
    "convert_checkpoint": ["-m", "tools.convert_checkpoint"],
    "generate": ["tools/generate.py"],
    "plan": ["tools/plan.py"],
    "pretrain": ["trainer/pretrain.py"],
    "compare_methods": ["tools/compare_methods.py"],
    "build_demo_corpus": ["-m", "tools.build_demo_corpus"],
    "muloco.diloco.auth (muloco-key)": ["-m", "muloco.diloco.auth"],
    "muloco.elastic.lighthouse (muloco-lighthouse)": ["-m", "muloco.elastic.lighthouse"],
}
BASELINES = {"import torch": ["-c", "import torch"], "pass": ["-c", "pass"]}


def environment(checkout: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(args: list[str], checkout: Path) -> tuple[float, float]:
    """Wall and CPU seconds (with its own children) of `python ARGS` run in `checkout`."""
    cpu, start = children_cpu_seconds(), time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=checkout, env=environment(checkout), capture_output=True,
                            text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return wall, children_cpu_seconds() - cpu


def help_times(checkout: Path, repeats: int) -> list[dict]:
    runs = {name: [] for name in [*COMMANDS, *BASELINES]}
    loads = []
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        for name, args in [*COMMANDS.items(), *BASELINES.items()]:
            runs[name].append(timed(args + (["--help"] if name in COMMANDS else []), checkout)[0])
    torch, bare = (statistics.median(runs[name]) for name in BASELINES)
    return [{"command": name, "median_s": round(statistics.median(times), 3),
             "vs_import_torch": round(statistics.median(times) / torch, 3),
             "vs_python_pass": round(statistics.median(times) / bare, 1),
             "load_1min": f"{min(loads):.1f}-{max(loads):.1f}"} for name, times in runs.items()]


def scaling(checkout: Path, corpus: Path, model: Path, work_dir: Path, repeats: int) -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: []}
    outputs = {}
    for repeat in range(repeats):
        for processes in (1, 2):
            prefix = work_dir / f"{corpus.stem}_p{processes}"
            load = os.getloadavg()[0]
            wall, cpu = timed(["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
                               "--tokenizer-model", str(model), "--processes", str(processes)], checkout)
            runs[processes].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_1min": round(load, 2)})
            outputs[processes] = f"{prefix}_text_document"
    same = identical(outputs[1], outputs[2])
    for output in outputs.values():
        for suffix in (".bin", ".idx", ".meta.json"):
            Path(output + suffix).unlink()
    one, two = ({key: statistics.median(run[key] for run in runs[p]) for key in ("wall_s", "cpu_s")} for p in (1, 2))
    return {"megabytes": round(corpus.stat().st_size / 1e6, 1), "runs_1_process": runs[1], "runs_2_processes": runs[2],
            "ratio_2_over_1": round(one["wall_s"] / two["wall_s"], 3),
            "cpu_2_over_1": round(two["cpu_s"] / one["cpu_s"], 3), "identical_output": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="--help runs per command (default %(default)s)")
    parser.add_argument("--mb", type=float, nargs="*", default=[40.0, 160.0],
                        help="JSONL sizes in MB for the scaling runs (default %(default)s)")
    parser.add_argument("--scaling-repeats", type=int, default=3, help="runs per process count (default %(default)s)")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="whose commands to run (default: this one)")
    parser.add_argument("--skip-help", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    result: dict = {"benchmark": "tool_startup", "checkout": str(checkout), "cpu_count": os.cpu_count()}
    if not args.skip_help:
        result["help"] = help_times(checkout, args.repeats)
        print(f"--help, median of {args.repeats} (checkout {checkout}):")
        for row in result["help"]:
            print(f"  {row['command']:>46}: {row['median_s']:6.3f} s = {row['vs_import_torch']:5.2f}x import torch, "
                  f"{row['vs_python_pass']:6.1f}x python -c pass (load {row['load_1min']})")
    if not args.skip_scaling:
        result["scaling"] = []
        with tempfile.TemporaryDirectory() as scratch:
            work_dir = Path(scratch)
            model = sentencepiece_model(work_dir)
            for megabytes in args.mb:
                corpus = work_dir / f"corpus_{megabytes:g}mb.jsonl"
                corpus.write_bytes(b"".join(corpus_lines(megabytes)))
                case = scaling(checkout, corpus, model, work_dir, args.scaling_repeats)
                corpus.unlink()
                result["scaling"].append(case)
                print(f"preprocessing {case['megabytes']} MB of JSONL, whole command, medians of "
                      f"{args.scaling_repeats}: 2 processes / 1 process = {case['ratio_2_over_1']:.2f}x faster, "
                      f"{case['cpu_2_over_1']:.2f}x the CPU seconds; identical .bin/.idx: {case['identical_output']}")
                for processes, key in ((1, "runs_1_process"), (2, "runs_2_processes")):
                    print(f"  processes={processes}: " + ", ".join(
                        f"{run['wall_s']} s ({run['cpu_s']} CPU s, load {run['load_1min']})" for run in case[key]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
