"""The runner of the device scripts (scripts/gpu_check.py, scripts/gpu_evidence.py): a table of stages run in
order within a time budget counted from the shell script's start, each stage passing, failing with its traceback,
or saying why it does not apply here; a stage whose input another makes is not run when that one failed. The report
(markdown and JSON) is rewritten after every stage, so a kill from outside keeps what ran; SIGTERM and SIGINT end
the run with a report that says so."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Protocol

REPO = Path(__file__).resolve().parents[1]

STARTED_ENV = "MULOCO_CHECK_STARTED"  # epoch seconds when the shell script started (the install counts too)
MIN_STAGE_S = 20.0  # a stage given less than this is not started
REPORT_RESERVE_S = 5.0  # kept back from the stages for the last report


class Mode(Protocol):
    """What the runner reads of a device run's mode (GPU or its CPU twin)."""

    cpu: bool
    budget_s: float  # the whole run, from the shell script's start

    @property
    def name(self) -> str: ...


class StageFailed(Exception):
    pass


class NotSupportedHere(Exception):
    """The stage's path does not exist on this machine; the message says why."""


class CheckKilled(BaseException):
    """SIGTERM or SIGINT reached the check: its children go, the report says so."""

    def __init__(self, signum: int):
        super().__init__(f"the check was killed by signal {signal.Signals(signum).name}")
        self.signum = signum


@dataclasses.dataclass
class Budget:
    total_s: float
    started: float  # time.time() at the start of the command
    clock: Callable[[], float] = time.time

    def left(self) -> float:
        return self.total_s - (self.clock() - self.started)

    def stage_timeout(self, cap_s: float) -> float:
        """Seconds the next stage may take: its cap, or what is left after the last report's reserve."""
        return max(0.0, min(cap_s, self.left() - REPORT_RESERVE_S))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One row of a device run's table of stages."""

    key: str
    what: str  # the report's description
    run: Callable[[Any], dict]  # what it runs: a method of the run's stages object, returning the stage's results
    cap_s: dict  # the stage's longest timeout per mode
    needs: tuple[str, ...] = ()  # stages whose output it reads: not run when one of them failed


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    for package in ("deepspeed", "megatron.core", "transformers"):
        try:
            info[package] = __import__(package, fromlist=["__version__"]).__version__
        except Exception as err:
            info[package] = f"missing ({err})"
    return info


def report_head(title: str, report: dict) -> list[str]:
    return [f"# {title} ({report['mode']})", "",
            f"`{report['command']}`, {report['started']}, {report['seconds']:.0f} s of a {report['budget_s']:.0f} s "
            f"budget (from the command's start). Result: **{report['result']}**.", "",
            "Environment: " + ", ".join(f"{k} {v}" for k, v in report["environment"].items()), ""]


def stage_lines(report: dict) -> list[str]:
    """The stages' table, then each stage's results and error."""
    lines = ["| stage | what | result | seconds | timeout |", "|---|---|---|---|---|"]
    for stage in report["stages"]:
        lines.append(f"| {stage['stage']} | {stage['what']} | {stage['status']} | {stage.get('seconds', 0):.0f} | "
                     f"{stage.get('timeout_s', 0):.0f} |")
    for stage in report["stages"]:
        lines += ["", f"## {stage['stage']}: {stage['what']}", ""]
        for key, value in stage.get("results", {}).items():
            lines.append(f"- {key}: {value}")
        if "error" in stage:
            lines += ["", "```", stage["error"].rstrip(), "```"]
    return lines


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    """A report's two files in the --out folder: NAME.json and NAME.md (`render` of the same dict)."""
    name: str
    render: Callable[[dict], str]

    def write(self, out: Path, report: dict) -> None:
        """Both files replaced whole (a kill mid-write leaves the previous report, never half of one)."""
        for name, text in ((f"{self.name}.json", json.dumps(report, indent=2, default=str)),
                           (f"{self.name}.md", self.render(report))):
            tmp = out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, out / name)


def run_stages(check, stages: list[Stage], budget: Budget, report: dict, out: Path, files: ReportFiles) -> None:
    failed: set[str] = set()
    for spec in stages:
        stage = {"stage": spec.key, "what": spec.what}
        report["stages"].append(stage)
        timeout_s = budget.stage_timeout(spec.cap_s[check.mode.name])
        blocked = [k for k in spec.needs if k in failed]
        if blocked:
            stage["status"] = f"not run: needs stage {', '.join(blocked)}"
            failed.add(spec.key)
        elif timeout_s < MIN_STAGE_S:
            stage["status"] = f"not run: {max(0.0, budget.left()):.0f} s of the time budget left"
            failed.add(spec.key)
        else:
            stage.update(status="running", timeout_s=timeout_s)
            files.write(out, {**report, "seconds": budget.total_s - budget.left()})
            print(f"[check] stage {spec.key} (timeout {timeout_s:.0f} s): {spec.what}", flush=True)
            t0 = time.monotonic()
            check.start_stage(timeout_s)
            try:
                stage["results"] = spec.run(check)
                stage["status"] = "passed"
            except NotSupportedHere as err:
                stage["status"] = "not supported here"
                stage["error"] = str(err)
            except CheckKilled as err:
                stage.update(status=f"killed ({err})", seconds=time.monotonic() - t0)
                raise
            except Exception as err:
                stage["status"] = "FAILED"
                stage["error"] = str(err) if isinstance(err, StageFailed) else traceback.format_exc()
                failed.add(spec.key)
            stage["seconds"] = time.monotonic() - t0
        print(f"[check] stage {spec.key}: {stage['status']} ({stage.get('seconds', 0):.0f} s)", flush=True)
        files.write(out, {**report, "seconds": budget.total_s - budget.left()})
    unsupported = [s["stage"] for s in report["stages"] if s["status"] == "not supported here"]
    if failed:
        report["result"] = f"FAILED or not run: stages {', '.join(sorted(failed))}"
    else:
        report["result"] = "passed" + (f" (not supported here: {', '.join(unsupported)})" if unsupported else "")


def _raise_killed(signum, frame):
    raise CheckKilled(signum)


def run_check(check, stages: list[Stage], budget: Budget, out: Path, command: str, files: ReportFiles) -> int:
    """`stages` of `check` within `budget`, the report rewritten in `out` after each and at the end
    (a SIGTERM or SIGINT included); the exit code: 0 when every stage passed."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_killed)
    report = {"mode": check.mode.name, "command": command, "budget_s": budget.total_s,
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(budget.started)),
              "environment": {}, "stages": [], "result": "running"}
    code = 1
    try:
        report["environment"] = environment()
        run_stages(check, stages, budget, report, out, files)
        code = 0 if report["result"].startswith("passed") else 1
    except CheckKilled as err:
        report["result"] = f"killed ({err})"
        code = 128 + err.signum
    finally:
        report["seconds"] = budget.total_s - budget.left()
        files.write(out, report)
    print(f"[check] {report['result']} in {report['seconds']:.0f} s: report {out / (files.name + '.md')} "
          f"(+ {files.name}.json)", flush=True)
    return code


def add_run_arguments(parser: argparse.ArgumentParser, script: str, gpu: Mode, cpu: Mode) -> None:
    """The options every device script takes (gpu_check.py and gpu_evidence.py)."""
    parser.add_argument("--cpu", action="store_true", help="gloo, fp32, tiny preset; report to a temporary folder")
    parser.add_argument("--out", default=None, help="report folder (default: results/ on GPU, a temp folder on CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run from {script}'s start "
                             f"(default: {gpu.budget_s:.0f} on GPU, {cpu.budget_s:.0f} on CPU)")


def run_script(args: argparse.Namespace, argv: list[str] | None, script: str, mode, make_check, stages: list[Stage],
               files: ReportFiles) -> int:
    """`stages` of `make_check(mode, work)` as `args` (add_run_arguments) ask: the budget counted from the
    shell script's start, the report in --out (results/ on GPU, a temporary folder on CPU), a scratch
    folder `work` removed at the end."""
    budget = Budget(args.budget_s or mode.budget_s, float(os.environ.get(STARTED_ENV) or time.time()))
    name = Path(script).stem
    out = Path(args.out or (tempfile.mkdtemp(prefix=f"muloco_cpu_{name}_") if mode.cpu else REPO / "results"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"muloco_{name}_work_"))
    command = " ".join([f"bash scripts/{script}", *(argv if argv is not None else sys.argv[1:])])
    try:
        return run_check(make_check(mode, work), stages, budget, out, command, files)
    finally:
        shutil.rmtree(work, ignore_errors=True)
