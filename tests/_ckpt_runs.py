"""Short training runs for the checkpoint and export tests, launched with torchrun (a free port per
launch), and their outputs: losses per step and rank files. The T=2 P=2 reference run is made once
per test session and shared by test_checkpoint and test_convert_checkpoint."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch
from tools.trainer_runs import launch_port, launcher_command
from tools.trainer_runs import EXTENSIONS_ENV

from muloco.core.rank_file import read_rank_file, to_plain

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600  # 2 shared CPU cores: four ranks start slowly
TRAIN_ITERS = 6


def dataset(base: Path) -> str:
    prefix = base / "markov"
    if not prefix.with_suffix(".idx").exists():
        from tools.synthetic_data import write_markov_dataset

        write_markov_dataset(str(prefix), vocab_size=1000)
    return str(prefix)


def _command(base: Path, ranks: int, run_dir: Path, flags: tuple[str, ...], ds_config: str,
             data_flags: tuple[str, ...] | None, train_iters: int, port: int, launcher: str = "torchrun") -> list[str]:
    data = data_flags or ("--data-path", dataset(base), "--vocab-size", "1000")
    return [*launcher_command(launcher, ranks, port), "trainer/pretrain.py", "--ds_config", ds_config,
            "--model", "tiny", *data, "--train-iters", str(train_iters), "--log-interval", "1", "--eval-interval", "0",
            "--run-dir", str(run_dir), *flags]


def _env(env: dict | None) -> dict:
    return {**os.environ, **EXTENSIONS_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}


def launch(base: Path, ranks: int, run_dir: Path, *flags: str, ds_config: str = "ds_configs/cpu_tiny_muon.json",
           env: dict | None = None, data_flags: tuple[str, ...] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_command(base, ranks, run_dir, flags, ds_config, data_flags, TRAIN_ITERS, launch_port()),
                          cwd=REPO_ROOT, env=_env(env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


class Launch:
    """A launch running in the background, its output read line by line (stdout and stderr together),
    so a test can act on the ranks (signal them) when the run reaches a given point."""

    def __init__(self, base: Path, ranks: int, run_dir: Path, *flags: str, train_iters: int = TRAIN_ITERS,
                 ds_config: str = "ds_configs/cpu_tiny_muon.json", launcher: str = "torchrun"):
        self.port = launch_port()
        self.proc = subprocess.Popen(_command(base, ranks, run_dir, flags, ds_config, None, train_iters, self.port,
                                              launcher),
                                     cwd=REPO_ROOT, env=_env(None), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in list(self.lines)):
            if self.proc.poll() is not None:
                self._reader.join(10)
                if any(text in line for line in self.lines):
                    return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise AssertionError(f"{text!r} never appeared:\n{self.output[-6000:]}")
            time.sleep(0.05)

    def rank_pid(self, rank: int) -> int:
        """The pid of the process of global rank `rank` (a child of the launcher)."""
        for pid in self.launcher_pid(), *descendants(self.launcher_pid()):
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        raise AssertionError(f"no process of rank {rank} under launcher {self.launcher_pid()}")

    def launcher_pid(self) -> int:
        """The process that starts the ranks: torchrun itself, or the launch.py DeepSpeed's runner starts."""
        if b"torch.distributed.run" in _cmdline(self.proc.pid):
            return self.proc.pid
        for pid in descendants(self.proc.pid):
            if b"deepspeed.launcher.launch" in _cmdline(pid):
                return pid
        raise AssertionError("DeepSpeed's launch.py has not started yet")

    def finish(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> int:
        """Wait for the launcher to exit (killing the whole session after `timeout_s`); its exit code."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, children first."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return [grand for child in children for grand in (child, *descendants(child))]


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie waiting for its reaper has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def reference_checkpoint(base: Path) -> Path:
    """6 steps at T=2 P=2 (4 ranks), saving at steps 3 and 6; returns the run's base folder."""
    ref = base / "reference_t2p2"
    if not (ref / "ckpt" / "latest").exists():
        check(launch(base, 4, ref / "run", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--save", str(ref / "ckpt"), "--save-interval", "3"))
    return ref


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def rank_files(ckpt: Path, step: int) -> list[Path]:
    return sorted((ckpt / f"iter_{step:07d}").glob("rank_*.safetensors"))


def assert_same_state(a: Path, b: Path, keys=("step", "model", "optimizer", "scheduler", "engine", "extra")) -> None:
    """Bit-for-bit equality of two rank files' training state."""
    sa, sb = (to_plain(read_rank_file(p)) for p in (a, b))
    for key in keys:
        _assert_equal(sa[key], sb[key], f"{a.name}:{key}")


def _assert_equal(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y), f"{where} differs (max |diff| {(x.double() - y.double()).abs().max():.3g})"
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), f"{where}: keys differ"
        for k in x:
            _assert_equal(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), f"{where}: lengths differ"
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_equal(u, v, f"{where}[{i}]")
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"
