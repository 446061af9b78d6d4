"""Tool start-up: each command's `--help` against `python -c "import torch"` and `python -c pass`, and the whole
preprocessing command with 2 processes against 1 on one JSONL file.

python benchmarks/tool_startup.py [--repeats 5] [--mb 40 160] [--scaling-repeats 3] [--checkouts DIR ...]
    [--skip-help] [--skip-scaling] [--import-first]

--help: every command the README names, run as it writes it, wall clock and CPU time (steadier on a shared machine)
of the whole process; the commands and the two baselines take turns --repeats times (so a burst of load hits them
alike) and each ratio is of the medians.

Scaling: the whole `python tools/preprocess_data.py ... --processes 1` and `--processes 2` command (start-up,
tokenizing, merge), taking turns --scaling-repeats times, on one uncompressed JSONL file of each --mb size made from
the sample corpus as benchmarks/preprocess_throughput.py makes its corpus, with the 4096-piece SentencePiece model
it trains; ratio of the medians. Next to it, the CPU seconds of all the run's processes: equal for 1 and 2 processes
means the split adds no work, so on two free cores the ratio is what the start-up leaves. The 1-minute load average
and the share of the cores other processes used during the run are printed with every number: on a shared machine
a wall clock depends on what else got the cores; the ratio is also given over the quiet runs alone (others at most
QUIET_SHARE of the cores) when both process counts have one. Every run's .bin/.idx is checked byte-for-byte against
the first run's. --import-first clocks each preprocessing command from after its process has imported Megatron's .idx
code (in the same process, before the command runs): the ratio once that import costs nothing (the CPU seconds still
hold it).

--checkouts DIR ... runs these checkouts' commands instead of this one's (e.g. this one and a clone from before a
change), taking turns with each other as well, with the same baselines and corpus. The last line printed is a JSON
object.
"""
from __future__ import annotations

import argparse
import json
import math
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
QUIET_SHARE = 0.1  # a run during which other processes used at most this share of the cores counts as quiet
# --import-first: `python -c IMPORT_FIRST tools/preprocess_data.py ARGS` imports Megatron's .idx code, then runs the
# command and prints how long it took after the import.
AFTER_IMPORT = "seconds after the import: "
IMPORT_FIRST = f"""
import runpy, sys, time
from dataprep.indexed_writer import load_index_code
load_index_code()
start = time.perf_counter()
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("{AFTER_IMPORT}" + str(time.perf_counter() - start), file=sys.stderr)
"""


def environment(checkout: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has run so far (Linux's /proc/stat; NaN elsewhere)."""
    try:
        ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return math.nan
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(args: list[str], checkout: Path, after_import: bool = False) -> tuple[float, float, float]:
    """Wall and CPU seconds (with its own children) of `python ARGS` run in `checkout`, and the share of the machine's
    cores that other processes used meanwhile (what makes a wall clock on a shared machine slower); `after_import`:
    the wall seconds the process printed after AFTER_IMPORT instead (IMPORT_FIRST)."""
    cpu, busy, start = children_cpu_seconds(), machine_busy_seconds(), time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=checkout, env=environment(checkout), capture_output=True,
                            text=True)
    wall, cpu, busy = time.perf_counter() - start, children_cpu_seconds() - cpu, machine_busy_seconds() - busy
    if result.returncode != 0:
        raise SystemExit(f"python {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    others = max(0.0, busy - cpu) / (wall * (os.cpu_count() or 1))
    if after_import:
        wall = float(result.stderr.rsplit(AFTER_IMPORT, 1)[1].split()[0])
    return wall, cpu, others


def help_times(checkouts: list[Path], repeats: int) -> list[dict]:
    """Per checkout and command, the median --help, by wall clock and by CPU time (which another process's load
    changes less); the baselines run in the same turns."""
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    loads = []
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        for name, args in COMMANDS.items():
            for checkout in checkouts:
                runs.setdefault((str(checkout), name), []).append(timed([*args, "--help"], checkout)[:2])
        for name, args in BASELINES.items():
            runs.setdefault(("baseline", name), []).append(timed(args, checkouts[0])[:2])
    median = {key: [statistics.median(run[i] for run in times) for i in (0, 1)] for key, times in runs.items()}
    torch, bare = (median[("baseline", name)] for name in BASELINES)
    return [{"checkout": checkout, "command": name, "median_s": round(wall, 3), "median_cpu_s": round(cpu, 3),
             "vs_import_torch": round(wall / torch[0], 3), "cpu_vs_import_torch": round(cpu / torch[1], 3),
             "vs_python_pass": round(wall / bare[0], 1), "cpu_vs_python_pass": round(cpu / bare[1], 1),
             "load_1min": f"{min(loads):.1f}-{max(loads):.1f}"} for (checkout, name), (wall, cpu) in median.items()]


def scaling(checkouts: list[Path], corpus: Path, model: Path, work_dir: Path, repeats: int,
            import_first: bool = False) -> list[dict]:
    """Per checkout, the whole command with 1 and 2 processes, every run taking its turn; whether every run wrote the
    same .bin/.idx as the first. `import_first`: clocked from after the process imported Megatron's .idx code."""
    runs: dict[tuple[Path, int], list[dict]] = {(checkout, p): [] for checkout in checkouts for p in (1, 2)}
    reference, same = str(work_dir / f"{corpus.stem}_reference_text_document"), True
    for _ in range(repeats):
        for (checkout, processes), measured in runs.items():
            prefix = work_dir / "run"
            load = os.getloadavg()[0]
            command = ["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
                       "--tokenizer-model", str(model), "--processes", str(processes)]
            wall, cpu, others = timed(["-c", IMPORT_FIRST, *command] if import_first else command, checkout,
                                      after_import=import_first)
            measured.append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "others_share": round(others, 3),
                             "load_1min": round(load, 2)})
            output = f"{prefix}_text_document"
            same = same and (not Path(reference + ".bin").exists() or identical(reference, output))
            for suffix in (".bin", ".idx", ".meta.json"):
                Path(output + suffix).replace(reference + suffix)
    for suffix in (".bin", ".idx", ".meta.json"):
        Path(reference + suffix).unlink()
    cases = []
    for checkout in checkouts:
        one, two = ({key: statistics.median(run[key] for run in runs[(checkout, p)]) for key in ("wall_s", "cpu_s")}
                    for p in (1, 2))
        quiet = [[run["wall_s"] for run in runs[(checkout, p)] if run["others_share"] <= QUIET_SHARE] for p in (1, 2)]
        cases.append({"checkout": str(checkout), "megabytes": round(corpus.stat().st_size / 1e6, 1),
                      "import_first": import_first,
                      "runs_1_process": runs[(checkout, 1)], "runs_2_processes": runs[(checkout, 2)],
                      "ratio_2_over_1": round(one["wall_s"] / two["wall_s"], 3),
                      "quiet_ratio_2_over_1": round(statistics.median(quiet[0]) / statistics.median(quiet[1]), 3)
                      if all(quiet) else None,
                      "cpu_2_over_1": round(two["cpu_s"] / one["cpu_s"], 3), "identical_output": same})
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="--help runs per command (default %(default)s)")
    parser.add_argument("--mb", type=float, nargs="*", default=[40.0, 160.0],
                        help="JSONL sizes in MB for the scaling runs (default %(default)s)")
    parser.add_argument("--scaling-repeats", type=int, default=3, help="runs per process count (default %(default)s)")
    parser.add_argument("--checkouts", type=Path, nargs="+", default=[ROOT],
                        help="whose commands to run, taking turns (default: this checkout)")
    parser.add_argument("--skip-help", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--import-first", action="store_true",
                        help="clock the preprocessing commands from after they imported Megatron's .idx code")
    args = parser.parse_args()
    checkouts = [checkout.resolve() for checkout in args.checkouts]
    result: dict = {"benchmark": "tool_startup", "cpu_count": os.cpu_count()}
    if not args.skip_help:
        result["help"] = help_times(checkouts, args.repeats)
        print(f"--help, medians of {args.repeats}: wall clock against import torch and python -c pass; CPU time the same")
        for row in result["help"]:
            print(f"  {row['command']:>46} {row['checkout']}: {row['median_s']:6.3f} s = "
                  f"{row['vs_import_torch']:5.2f}x import torch, {row['vs_python_pass']:6.1f}x python -c pass; "
                  f"CPU {row['median_cpu_s']:6.3f} s = {row['cpu_vs_import_torch']:5.2f}x, "
                  f"{row['cpu_vs_python_pass']:6.1f}x (load {row['load_1min']})")
    if not args.skip_scaling:
        result["scaling"] = []
        with tempfile.TemporaryDirectory() as scratch:
            work_dir = Path(scratch)
            model = sentencepiece_model(work_dir)
            for megabytes in args.mb:
                corpus = work_dir / f"corpus_{megabytes:g}mb.jsonl"
                corpus.write_bytes(b"".join(corpus_lines(megabytes)))
                cases = scaling(checkouts, corpus, model, work_dir, args.scaling_repeats, args.import_first)
                corpus.unlink()
                result["scaling"] += cases
                for case in cases:
                    clock = "clocked after importing Megatron's .idx code" if args.import_first else "whole command"
                    print(f"preprocessing {case['megabytes']} MB of JSONL, {clock}, {case['checkout']}, medians "
                          f"of {args.scaling_repeats}: 2 processes / 1 process = {case['ratio_2_over_1']:.2f}x faster "
                          f"(runs with others at most {QUIET_SHARE:.0%} of the cores: {case['quiet_ratio_2_over_1']}), "
                          f"{case['cpu_2_over_1']:.2f}x the CPU seconds; every run's .bin/.idx identical: "
                          f"{case['identical_output']}")
                    for processes, key in ((1, "runs_1_process"), (2, "runs_2_processes")):
                        print(f"  processes={processes}: " + ", ".join(
                            f"{run['wall_s']} s ({run['cpu_s']} CPU s, others {run['others_share']:.0%} of the cores, "
                            f"load {run['load_1min']})" for run in case[key]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
