"""Run every benchmark script in benchmarks/ and write one markdown report.

    python benchmarks/run_all.py --out results/benchmarks.md [--only NAME ...] [--timeout 1800]

Each script prints a JSON object as its last line; this collects them. Scripts run one after the
other with the small settings in SETTINGS (a script added later runs with its defaults). A script
that fails or times out is reported as such and the others still run. The loader benchmark reads the
shakespeare data the method comparison prepares (tools/compare_methods.py) and is compared with the
training throughput step_throughput measured in this same command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from tools.compare.launch import prepare_data
from tools.compare.protocol import DEFAULT_CORPUS

BENCHMARKS = Path(__file__).resolve().parent
# Small, documented settings per script: a few minutes each on 2 CPU cores.
SETTINGS: dict[str, list[str]] = {
    "muon_ownership": ["--preset", "150m", "--owners", "2", "4", "8"],
    "muon_vs_adamw": ["--steps", "100", "--adamw-lrs", "3e-3", "1e-2", "--muon-lrs", "0.02", "0.04"],
    "optimizer_step_share": ["--steps", "20"],
    "step_throughput": ["--steps", "30"],
    "checkpoint_io": ["--presets", "tiny", "150m"],
    "newton_schulz_forms": ["--presets", "150m"],  # 15b: minutes of CPU per matrix (results/newton_schulz_forms.md)
    "link_share": ["--rates", "200mbit", "--workers", "2", "--syncs", "1"],  # root: namespaces (results/link_share.md)
}
# Run first: later scripts use their numbers.
ORDER = ("step_throughput",)
ASSUMED_TRAINER_RATE = 1000.0  # tokens/s, only when step_throughput has no number


@dataclass
class Outcome:
    name: str
    args: list[str]
    seconds: float
    result: dict | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def discover(only: list[str] | None) -> list[str]:
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != Path(__file__).stem)
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"no benchmark script named {unknown}; have {names}")
        names = [n for n in names if n in only]
    return sorted(names, key=lambda n: (n not in ORDER, n))


def _trainer_rate(outcomes: dict[str, Outcome]) -> float | None:
    """The tiny preset's training tokens/s (T=1, D=2) that step_throughput measured in this command."""
    trainer = outcomes.get("step_throughput")
    return trainer.result["T1_D2_tokens_per_s"] if trainer is not None and trainer.result else None


def _shakespeare():
    """The data the method comparison prepares for its default corpus (built once)."""
    return prepare_data(DEFAULT_CORPUS, REPO / "runs" / "compare" / DEFAULT_CORPUS.name / "data")


def arguments(name: str, outcomes: dict[str, Outcome]) -> list[str]:
    if name == "loader_throughput":
        data = _shakespeare()
        args = ["--data-path", data.train, *data.vocabulary, "--seq-lengths", "128", "2048"]
        rate = _trainer_rate(outcomes)
        return args + ["--trainer-tokens-per-s", str(rate or ASSUMED_TRAINER_RATE)]
    if name == "preprocess_throughput":
        return list(_shakespeare().vocabulary)
    return SETTINGS.get(name, [])


def run_one(name: str, args: list[str], timeout: float) -> Outcome:
    command = [sys.executable, str(BENCHMARKS / f"{name}.py"), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.time()
    print(f"benchmark {name} {' '.join(args)}", flush=True)
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return Outcome(name, args, time.time() - start, error=f"timed out after {timeout:.0f} s")
    seconds = time.time() - start
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        return Outcome(name, args, seconds, error=f"exit code {proc.returncode}:\n{tail}")
    try:
        return Outcome(name, args, seconds, result=json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        return Outcome(name, args, seconds, error=f"last line is not JSON: {lines[-1:]!r}")


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render_json(value, indent: str = "") -> list[str]:
    """Scalars as a key/value list; a list of flat dicts as a table; nesting recursively."""
    lines = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                lines.append(f"{indent}- **{key}**:")
                lines += render_json(item, indent + "  ")
            else:
                lines.append(f"{indent}- {key}: {_cell(item)}")
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value) and \
            all(not isinstance(x, (dict, list)) for v in value for x in v.values()):
        columns = list(dict.fromkeys(k for v in value for k in v))
        lines += ["", f"{indent}| " + " | ".join(columns) + " |", f"{indent}|" + "---|" * len(columns)]
        lines += [f"{indent}| " + " | ".join(_cell(v.get(c, "")) for c in columns) + " |" for v in value]
        lines.append("")
    elif isinstance(value, list):
        lines += [line for v in value for line in render_json(v, indent)] if any(
            isinstance(v, (dict, list)) for v in value) else [f"{indent}- {', '.join(_cell(v) for v in value)}"]
    else:
        lines.append(f"{indent}- {_cell(value)}")
    return lines


def report(outcomes: list[Outcome], command: str) -> str:
    ok = sum(o.error is None for o in outcomes)
    lines = ["# Benchmark report", "",
             f"Made by `{command}` on {platform.node()} ({os.cpu_count()} CPU cores, "
             f"load average at the end {os.getloadavg()[0]:.1f}) on {time.strftime('%Y-%m-%d %H:%M')}.",
             "Ratios compare measurements taken in the same script run; absolute times depend on the "
             "machine and its load.", "",
             f"{ok} of {len(outcomes)} benchmarks succeeded.", "",
             "| benchmark | settings | seconds | status |", "|---|---|---|---|"]
    for o in outcomes:
        status = "ok" if o.error is None else "FAILED: " + o.error.splitlines()[0]
        lines.append(f"| {o.name} | `{' '.join(o.args) or '(defaults)'}` | {o.seconds:.0f} | {status} |")
    for o in outcomes:
        lines += ["", f"## {o.name}", "", f"`python benchmarks/{o.name}.py {' '.join(o.args)}`", ""]
        lines += [f"> {note}" for note in o.notes]
        if o.error is not None:
            lines += ["```", o.error, "```"]
        else:
            lines += render_json(o.result)
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="+", help="run only these scripts (names without .py)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per script")
    args = p.parse_args()
    outcomes: dict[str, Outcome] = {}
    for name in discover(args.only):
        script_args = arguments(name, outcomes)
        outcome = run_one(name, script_args, args.timeout)
        if name == "loader_throughput" and _trainer_rate(outcomes) is None:
            outcome.notes.append(f"the trainer rate is an assumed {ASSUMED_TRAINER_RATE:g} tokens/s: "
                                 "step_throughput has no number")
        outcomes[name] = outcome
        print(f"  {'ok' if outcome.error is None else 'FAILED'} in {outcome.seconds:.0f} s", flush=True)
    command = "python benchmarks/run_all.py " + " ".join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(list(outcomes.values()), command))
    print(f"report: {args.out}")
    return 0 if all(o.error is None for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
