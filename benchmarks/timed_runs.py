"""What the launched benchmarks of the outer loop share (outer_hook_overhead.py, straggler.py): each
case's ds_config, a trainer that records every rank's wall clock, and their `--real-link RATE` form: the
same static world with each worker (one rank) in a network namespace of its own whose egress the kernel
limits to RATE (tools/datacenters.py, root), the link's latency still emulated (`muloco.link`)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

BASE_CONFIG = Path(__file__).resolve().parents[1] / "ds_configs" / "cpu_tiny_muloco.json"


def write_config(path: Path, muloco: dict) -> None:
    """The tiny MuLoCo ds_config with its muloco block replaced by `muloco`."""
    base = {k: v for k, v in json.loads(BASE_CONFIG.read_text()).items() if k != "muloco"}
    path.write_text(json.dumps({**base, "muloco": muloco}))


def timed_trainer():
    """The Trainer that writes, to step_times.rank<R>.json in its run folder, this rank's wall clock after
    every inner step it took (step hooks included) and the time of each step's hooks (the outer sync,
    with its wait for the other workers). Imported by a launched rank only: the launcher never loads
    the trainer."""
    import torch.distributed as dist

    from trainer.training import Trainer

    class TimedTrainer(Trainer):
        def train(self) -> dict:
            self.step_times, self.hook_seconds = [], []
            summary = super().train()
            Path(self.config.run_dir, f"step_times.rank{dist.get_rank()}.json").write_text(
                json.dumps({"times": self.step_times, "hooks": self.hook_seconds}))
            return summary

        def train_step(self):
            result = super().train_step()
            self.step_times.append(time.perf_counter())
            return result

        def _run_step_hooks(self) -> dict:
            started = time.perf_counter()
            values = super()._run_step_hooks()
            self.hook_seconds.append(time.perf_counter() - started)
            return values

    return TimedTrainer


def link_block(emulated: dict, real_link: str | None) -> dict:
    """The muloco.link block of a case: `emulated`, or on a real link only its latency (the kernel limits the rate)."""
    if real_link is None:
        return emulated
    return {"bandwidth_gbit_s": 1e6, "latency_ms": emulated["latency_ms"]}


def link_name(emulated: dict, real_link: str | None) -> str:
    if real_link:
        return f"real {real_link} (tbf, a namespace per worker) + {emulated['latency_ms']} ms emulated"
    return f"emulated {emulated['bandwidth_gbit_s']} Gbit/s + {emulated['latency_ms']} ms"


def run_world_on_real_link(rates: list[str], argv: list[str], env: dict, cwd: Path, logs: Path) -> None:
    """What `torchrun --standalone --nproc_per_node=len(rates) ARGV` starts, with rank k in datacenter k: its
    own namespace, its egress limited to `rates[k]`, its gloo sockets on its routable address. Exits with the
    failing rank's log."""
    from tools.datacenters import INTERFACE, Datacenters, unavailable, wait_until
    from tools.trainer_runs import free_port

    why = unavailable()
    if why:
        sys.exit(f"--real-link: cannot make network namespaces here: {why}")
    workers = len(rates)
    with Datacenters(rates) as dcs:
        port, procs = free_port(), []
        for k, site in enumerate(dcs.sites):
            world = {"RANK": str(k), "LOCAL_RANK": "0", "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": dcs.sites[0].address, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": INTERFACE}
            procs.append(dcs.spawn(site, [sys.executable, *argv], logs / f"rank{k}.log", {**env, **world}, cwd=cwd))
        wait_until(lambda: all(p.poll() is not None for p in procs), 3600, "the ranks to finish", poll_s=0.5)
        failed = [k for k, p in enumerate(procs) if p.returncode != 0]
        if failed:
            sys.exit(f"rank {failed[0]} failed on the real link; its log ends:\n"
                     f"{(logs / f'rank{failed[0]}.log').read_text()[-4000:]}")
