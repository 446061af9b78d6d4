"""A multi-datacenter rehearsal on one machine: K elastic MuLoCo workers, each its own `deepspeed` launch
of D ranks inside a datacenter namespace of its own (tools/datacenters.py), the lighthouse behind its
gateway in another, the job secret required, each datacenter's egress rate-limited by the kernel.

    python -m tools.rehearsal                      # K=3 workers, D=2 ranks, 200 Mbit/s each: do they agree?
    python -m tools.rehearsal --rates 200mbit,200mbit,50mbit --latency-ms 20 --train-iters 60

Each worker's outer traffic uses its namespace's routable address: its launcher's rendezvous store
(which torchft's quorum advertises to the peers) is on `--master_addr ADDR` (a one-host hostfile and
`--no_ssh`, the form DeepSpeed's launcher takes a master address in), and gloo's sockets are on its
interface (GLOO_SOCKET_IFNAME). It ends printing every outer sync's global-weight checksum per worker
and whether they agree; exit status 0 only when they do. Everything it made is removed on exit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tools.datacenters import INTERFACE, Datacenters, NetworkError, Site, unavailable, wait_until
from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import EXTENSIONS_ENV, REPO_ROOT, TINY_VOCAB, launch_port, shared_memory_files

LIGHTHOUSE_PORT = 29510
AUTH_KEY_ENV = "MULOCO_AUTH_KEY_FILE"


@dataclass(frozen=True)
class Plan:
    rates: tuple[str | None, ...] = ("200mbit", "200mbit", "200mbit")  # one per datacenter (worker)
    ranks_per_worker: int = 2
    train_iters: int = 30
    sync_interval: int = 5
    latency_ms: float = 0.0  # emulated one-way latency (muloco.link) on top of the real rate limit
    sync_timeout_s: float = 10.0
    quorum_timeout_s: float = 180.0
    lighthouse_timeout_s: float = 5.0  # the lighthouse's join and heartbeat timeouts
    pace: bool = False  # muloco.pace: fast workers keep their throughput beside a slow one
    collective: str = "all_gather"

    @property
    def workers(self) -> int:
        return len(self.rates)


def ds_config(plan: Plan, lighthouse: str | None) -> dict:
    """The job's DeepSpeed config: the tiny model, 4-bit statistical compression with error feedback;
    elastic with a lighthouse, else the static mode (one world of K workers)."""
    muloco = {
        "workers": plan.workers, "sync_interval": plan.sync_interval, "outer_lr": 0.7, "outer_momentum": 0.6,
        "nesterov": True, "compression": {"method": "statistical", "bits": 4, "error_feedback": True},
        "collective": plan.collective, "sync_timeout_s": plan.sync_timeout_s,
    }
    if lighthouse is not None:
        muloco["elastic"] = {"lighthouse": lighthouse, "quorum_timeout_s": plan.quorum_timeout_s, "max_attempts": 4}
    if plan.latency_ms:  # the real link limits the rate; only its latency is emulated
        muloco["link"] = {"bandwidth_gbit_s": 1e6, "latency_ms": plan.latency_ms}
    if plan.pace:
        muloco["pace"] = {"mode": "wall_clock"}
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "muon", "params": {"lr": 0.02, "adamw_lr_factor": 0.15}},
        "scheduler": {"params": {"warmup_iters": 4, "min_lr_ratio": 0.1}},
        "gradient_clipping": 1.0, "steps_per_print": 1000000, "muloco": muloco,
    }


@dataclass
class Rehearsal:
    """One job on a set of datacenters: its files under `work`, its lighthouse and workers."""
    dcs: Datacenters
    plan: Plan
    work: Path
    runs: dict[str, tuple[int, subprocess.Popen]] = field(default_factory=dict)  # run name -> (worker, process)
    ports: list[int] = field(default_factory=list)  # its launches' master ports

    def __enter__(self) -> Rehearsal:
        return self

    def __exit__(self, *exc) -> None:
        """Kill what is still running and remove DeepSpeed's shared-memory files of its launches (a
        rank killed before it unlinked its own leaves it; they are not per namespace)."""
        self.dcs.tear_down()
        for port in self.ports:
            for path in shared_memory_files(port):
                path.unlink(missing_ok=True)

    @property
    def lighthouse_url(self) -> str:
        return f"http://{self.dcs.lighthouse.address}:{LIGHTHOUSE_PORT}"

    def prepare(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        write_markov_dataset(str(self.work / "markov"), vocab_size=TINY_VOCAB)
        subprocess.run([sys.executable, "-m", "muloco.diloco.auth", "new-key", str(self.work / "job.key")],
                       check=True, cwd=REPO_ROOT, env=self.env(), capture_output=True)
        (self.work / "ds_config.json").write_text(json.dumps(ds_config(self.plan, self.lighthouse_url)))
        (self.work / "static.json").write_text(json.dumps(ds_config(self.plan, None)))

    def env(self, site: Site | None = None) -> dict[str, str]:
        env = {**os.environ, **EXTENSIONS_ENV, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore", AUTH_KEY_ENV: str(self.work / "job.key")}
        if site is not None:
            env["GLOO_SOCKET_IFNAME"] = INTERFACE  # gloo's sockets on the routable interface, not the host name's
        return env

    def start_lighthouse(self) -> subprocess.Popen:
        t = f"{self.plan.lighthouse_timeout_s:g}"
        return self.dcs.spawn(self.dcs.lighthouse, [sys.executable, "-m", "muloco.elastic.lighthouse", "--bind",
                                                    f"{self.dcs.lighthouse.address}:{LIGHTHOUSE_PORT}",
                                                    "--join-timeout-s", t, "--heartbeat-timeout-s", t],
                              self.work / "lighthouse.log", self.env(), cwd=REPO_ROOT)

    def start_worker(self, worker: int, name: str | None = None) -> subprocess.Popen:
        """Worker `worker` in datacenter `worker`: one `deepspeed` launch of D ranks, its store on the
        datacenter's routable address."""
        name = name or f"worker{worker}"
        site = self.dcs.sites[worker]
        hostfile = self.work / f"{name}.hostfile"
        hostfile.write_text(f"localhost slots={self.plan.ranks_per_worker}\n")
        argv = self._launcher(hostfile, 0, site.address, launch_port()) + [
            "--ds_config", str(self.work / "ds_config.json"), "--worker-id", str(worker), "--run-dir", str(self.work / name)]
        proc = self.dcs.spawn(site, argv, self.work / f"{name}.log", self.env(site), cwd=REPO_ROOT)
        self.runs[name] = (worker, proc)
        return proc

    def start_static(self) -> None:
        """The static mode: one world of K workers (no lighthouse), node k in datacenter k, as DeepSpeed's
        multi-node launch without ssh starts it (every node runs the launcher with its --node_rank), the
        world's store on datacenter 0's address. Runs "static<k>"; node 0's run folder is "static"."""
        hostfile = self.work / "static.hostfile"
        hostfile.write_text("".join(f"{s.name} slots={self.plan.ranks_per_worker}\n" for s in self.dcs.sites))
        port = launch_port()
        for k, site in enumerate(self.dcs.sites):
            argv = self._launcher(hostfile, k, self.dcs.sites[0].address, port) + [
                "--ds_config", str(self.work / "static.json"), "--run-dir", str(self.work / "static")]
            self.runs[f"static{k}"] = (k, self.dcs.spawn(site, argv, self.work / f"static{k}.log", self.env(site),
                                                         cwd=REPO_ROOT))

    def _launcher(self, hostfile: Path, node: int, master: str, port: int) -> list[str]:
        """`deepspeed` on `hostfile`'s node `node` without ssh, the store on master:port, and the trainer's
        flags but its config and run folder. The port is unique on the machine: DeepSpeed names its
        shared-memory files (not per namespace) by it."""
        self.ports.append(port)
        return [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
                "--node_rank", str(node), "--master_addr", master, "--master_port", str(port),
                "trainer/pretrain.py", "--model", "tiny", "--data-path", str(self.work / "markov"),
                "--vocab-size", str(TINY_VOCAB), "--train-iters", str(self.plan.train_iters),
                "--log-interval", str(self.plan.sync_interval), "--eval-interval", "0"]

    def syncs(self, name: str) -> dict[int, dict]:
        """outer step -> its metrics record, of run `name`."""
        path = self.work / name / "metrics.jsonl"
        if not path.exists():
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {r["outer_step"]: r for r in records if "outer_step" in r}

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def wait_all(self, timeout_s: float) -> dict[str, int]:
        """Each run's exit status, once all have ended."""
        def ended() -> bool:
            return all(proc.poll() is not None for _, proc in self.runs.values())
        wait_until(ended, timeout_s, "the workers to finish")
        return {name: proc.returncode for name, (_, proc) in self.runs.items()}

    def agreement(self, names: list[str]) -> tuple[list[str], bool]:
        """A table of each outer step's checksum per run, and whether every run that has a step has the
        same checksum there (and all have the last step)."""
        syncs = {name: self.syncs(name) for name in names}
        steps = sorted(set().union(*syncs.values()))
        lines = [f"{'outer':>5} {'K_eff':>5} {'quorum':<8} " + " ".join(f"{name:<17}" for name in names)]
        agree = bool(steps)
        for n in steps:
            shas = {name: s[n]["weights_sha"] for name, s in syncs.items() if n in s}
            agree &= len(set(shas.values())) == 1
            first = next(s[n] for s in syncs.values() if n in s)
            lines.append(f"{n:>5} {first['workers_in_sync']:>5} {','.join(map(str, first['quorum'])):<8} "
                         + " ".join(f"{shas.get(name, '-'):<17}" for name in names))
        agree &= all(steps[-1] in s for s in syncs.values()) if steps else False
        return lines, agree

    def outer_connections(self) -> dict[str, set[str]]:
        """Per datacenter, the other sites' addresses it has TCP connections with (`ss`), and "127.0.0.1"
        if any connection's peer there is loopback while its own end is routable (a loopback dial of outer
        traffic could not be anything else)."""
        addresses = {s.address for s in (self.dcs.lighthouse, *self.dcs.sites)}
        seen: dict[str, set[str]] = {}
        for site in self.dcs.sites:
            peers = set()
            for state, local, peer in self.dcs.sockets(site):
                host = peer.rsplit(":", 1)[0].strip("[]")
                if state == "ESTAB" and host in addresses and host != site.address:
                    peers.add(host)
            seen[site.name] = peers
        return seen


def run_default(plan: Plan, work: Path) -> bool:
    """K workers to the end; True when every worker's global weights agree after every sync and each
    datacenter talked to every other one and to the lighthouse on routable addresses."""
    with Datacenters(list(plan.rates)) as dcs, Rehearsal(dcs, plan, work) as rehearsal:
        rehearsal.prepare()
        print(f"[rehearsal] {plan.workers} datacenters ({', '.join(f'{s.name} {s.address} {s.rate}' for s in dcs.sites)})"
              f", lighthouse {rehearsal.lighthouse_url}; D={plan.ranks_per_worker} ranks each; logs in {work}",
              flush=True)
        rehearsal.start_lighthouse()
        for k in range(plan.workers):
            rehearsal.start_worker(k)
        seen: dict[str, set[str]] = {s.name: set() for s in dcs.sites}

        def finished() -> bool:
            for name, peers in rehearsal.outer_connections().items():
                seen[name] |= peers
            return all(proc.poll() is not None for _, proc in rehearsal.runs.values())
        wait_until(finished, 900, "the workers to finish", poll_s=1.0)
        codes = {name: proc.returncode for name, (_, proc) in rehearsal.runs.items()}
        lines, agree = rehearsal.agreement(list(rehearsal.runs))
        print("\n".join(lines))
        everyone = {s.address for s in (dcs.lighthouse, *dcs.sites)}
        routable = all(peers == everyone - {dcs.sites[k].address} for k, peers in enumerate(seen.values()))
        print(f"[rehearsal] exit codes {codes}; outer connections seen (ss): "
              + "; ".join(f"{name} -> {sorted(peers)}" for name, peers in seen.items()))
        ok = agree and routable and all(code == 0 for code in codes.values())
        print(f"[rehearsal] global weights agree: {'yes' if agree else 'NO'}; every datacenter reached its peers and "
              f"the lighthouse on routable addresses: {'yes' if routable else 'NO'}", flush=True)
        return ok


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="200mbit,200mbit,200mbit",
                   help="each datacenter's egress rate (tc units), comma-separated: one worker per datacenter")
    p.add_argument("--ranks", type=int, default=Plan.ranks_per_worker, help="ranks per worker (D)")
    p.add_argument("--train-iters", type=int, default=Plan.train_iters)
    p.add_argument("--latency-ms", type=float, default=0.0, help="emulated one-way latency (muloco.link)")
    p.add_argument("--work", type=Path, default=Path("runs/datacenters"))
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        sys.exit(f"datacenters: cannot make network namespaces here: {why}")
    plan = Plan(rates=tuple(args.rates.split(",")), ranks_per_worker=args.ranks, train_iters=args.train_iters,
                latency_ms=args.latency_ms)
    try:
        ok = run_default(plan, args.work.resolve())
    except (NetworkError, TimeoutError) as err:
        sys.exit(f"datacenters: {err}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
