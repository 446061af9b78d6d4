"""The real trainer run from tests and benchmarks on the tiny preset: launched (torchrun or DeepSpeed's
runner) on a private port with a timeout that kills every rank, or assembled exactly as trainer/pretrain.py
assembles it inside the calling process (a world of one outside a launcher); and a run's metrics.
The tiny preset's flags name this checkout's ds_configs/ (the package is installed editable)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DS_CONFIGS = {name: REPO_ROOT / "ds_configs" / f"cpu_tiny_{name}.json" for name in ("muon", "adamw")}
TINY_VOCAB = 1000
PRETRAIN = REPO_ROOT / "trainer" / "pretrain.py"
LAUNCH_TIMEOUT_S = 300
# deepspeed.init_distributed JIT-builds a CPU communication op under one lock in the torch extensions
# cache; virtual environments sharing the default cache rebuild it for each other (minutes, every
# rank of every run waiting), so each environment keeps its own.
EXTENSIONS_ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                         str(Path(sys.prefix) / "torch_extensions"))}


def tiny_flags(data_prefix: str | Path, run_dir: str | Path, optimizer: str, *extra: str) -> list[str]:
    """pretrain.py flags for the tiny preset on a synthetic dataset of vocabulary TINY_VOCAB
    (tools/synthetic_data.py)."""
    return ["--ds_config", str(DS_CONFIGS[optimizer]), "--model", "tiny", "--data-path", str(data_prefix),
            "--vocab-size", str(TINY_VOCAB), "--run-dir", str(run_dir), *extra]


def init_distributed() -> None:
    """As pretrain.py does; outside a launcher this process becomes a world of one."""
    from muloco.core import comm

    os.environ.update(EXTENSIONS_ENV)
    comm.one_rank_without_launcher()
    comm.init_distributed(comm.default_backend())


def run_trainer(flags: list[str], trainer_class=None) -> dict:
    """One run from pretrain.py's flags, in this process (after init_distributed); Megatron's groups
    are torn down afterwards so that the next run can build its own."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    from trainer.config import build_parser, resolve
    from trainer.run import run
    from trainer.training import Trainer

    config = resolve(build_parser().parse_args(flags), dist.get_world_size())
    try:
        return run(config, trainer_class or Trainer)
    finally:
        mps.destroy_model_parallel()


def free_port() -> int:
    # Other people's launches share this machine: the default port 29500 would collide.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The master ports of this session's launches: DeepSpeed names its shared-memory files by them, so
# the suite can remove what its own launches left (a rank killed before it unlinked its file).
LAUNCH_PORTS: set[int] = set()


def launch_port() -> int:
    port = free_port()
    LAUNCH_PORTS.add(port)
    return port


def shared_memory_files(port: int) -> list[Path]:
    """DeepSpeed's CPU all-reduce files of the launch on `port` (deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK)."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


@dataclass
class LaunchResult:
    returncode: int
    output: str  # stdout and stderr of the launcher and every rank, interleaved
    master_port: int = 0

    def check(self, what: str) -> "LaunchResult":
        assert self.returncode == 0, f"{what} failed (exit {self.returncode}):\n{self.output[-8000:]}"
        return self


def launcher_command(launcher: str, num_ranks: int, port: int) -> list[str]:
    """The command that starts `num_ranks` ranks of a script on this host (the script and its
    arguments follow): "deepspeed", the runner the README uses (it starts DeepSpeed's launch.py,
    which starts the ranks), or "torchrun" (one process fewer and no DeepSpeed import before the
    ranks start: about 4 s less per launch on 2 cores; it sets OMP_NUM_THREADS=1 where unset)."""
    if launcher == "deepspeed":
        return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(num_ranks),
                "--master_port", str(port)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--master-addr=127.0.0.1",
                f"--master-port={port}", f"--nproc_per_node={num_ranks}"]
    raise ValueError(f"unknown launcher {launcher!r} (deepspeed or torchrun)")


def launch_ranks(script: str | Path, num_ranks: int, args: list[str], timeout_s: float = LAUNCH_TIMEOUT_S,
                 omp_threads: str | None = "1", launcher: str = "torchrun") -> LaunchResult:
    """`num_ranks` gloo processes of `script args` on CPU, started by `launcher` (launcher_command),
    with OMP_NUM_THREADS=omp_threads (None: unset, the trainer's own default, which needs the deepspeed
    runner). A hang fails within the timeout: the launcher and its ranks share a new session, which is
    killed as a whole."""
    if omp_threads is None and launcher != "deepspeed":
        raise ValueError("torchrun sets OMP_NUM_THREADS=1 where it is unset: the trainer's own thread default "
                         "needs the deepspeed runner")
    port = launch_port()
    command = [*launcher_command(launcher, num_ranks, port), str(script), *args]
    env = {**os.environ, **EXTENSIONS_ENV, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = omp_threads
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return LaunchResult(124, f"timed out after {timeout_s} s\n{output}", port)
    return LaunchResult(proc.returncode, output, port)


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
