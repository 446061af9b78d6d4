"""Elastic MuLoCo (muloco/elastic): three workers launched as three separate jobs, joined only by
torchft's lighthouse, through one failure scenario shared by every test:

1. workers 0, 1, 2 start together (one `deepspeed` launch each) and sync FRAGMENTS streaming fragments
   every SYNC_INTERVAL steps, each sync overlapping OVERLAP inner steps (it runs in the background);
2. worker 1's pseudogradient is NaN at its second sync (NAN_AT);
   worker 2 is killed (SIGKILL) after its first sync;
3. while it is down, workers 0 and 1 sync on their own (K_eff = 2);
4. worker 2 is restarted (a new launch) once they have; it loads the outer state from a live peer and syncs with them again;
   it asks to join during a trickle flood at the lighthouse's gateway (until FLOOD_S seconds after its first
   quorum request), and gets in;
5. worker 1 is frozen (SIGSTOP) and never answers again: workers 0 and 2 drop it and finish the run.
Beside them, a fourth job (a worker 0 of its own) is pointed at a lighthouse that is not there: it stops
after its quorum_timeout_s with one line naming the lighthouse and how long it asked.
All along a stranger who knows the lighthouse's address but not the job secret keeps asking to join
as "worker9" at a far-ahead step (which, let in, would make every worker load its state).

Uncompressed payloads, so the outer step can be checked against a plain fp32 computation.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import free_port
from tools.trainer_runs import EXTENSIONS_ENV, REPO_ROOT, TINY_VOCAB

from muloco.elastic.tunnel import REFUSAL_LOG_INTERVAL_S

PROBE = REPO_ROOT / "tests" / "_elastic_probe.py"
WORKERS = 3
SYNC_INTERVAL = 4
FRAGMENTS, OVERLAP = 2, 1  # fragment 0 syncs at steps 2, 6, 10, ...; fragment 1 at 4, 8, 12, ...
TRAIN_ITERS = 128
# The survivors must outlast worker 2's restart (20-60 s): an emulated WAN latency per round trip
# (2 per sync: the exchange, then the metrics) keeps them from racing through the run on an idle machine.
LINK = {"bandwidth_gbit_s": 10, "latency_ms": 500}
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.6
SYNC_TIMEOUT_S = 8
LIGHTHOUSE_TIMEOUT_S = 4  # join and heartbeat timeouts: how soon a silent worker leaves the quorum
PHASE_TIMEOUT_S = 240
QUORUM_TIMEOUT_S = 240
# Strangers that open connections to the gateway and send a byte every FLOOD_TRICKLE_S, never finishing
# a handshake: FLOOD_CONNECTIONS at once, each one the gateway closes replaced (FLOOD_REPLACED a round).
FLOOD_S, FLOOD_CONNECTIONS, FLOOD_REPLACED, FLOOD_TRICKLE_S = 6, 100, 16, 0.5
LOST_QUORUM_TIMEOUT_S = 5
NAN_AT = f"1:{2 * SYNC_INTERVAL}"  # any one phase; a run that stalls fails here with the logs


def ds_config(lighthouse: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "muon", "params": {"lr": 0.02, "adamw_lr_factor": 0.15}},
        "scheduler": {"params": {"warmup_iters": 4, "min_lr_ratio": 0.1}},
        "gradient_clipping": 1.0, "steps_per_print": 1000000,
        "muloco": {"workers": WORKERS, "sync_interval": SYNC_INTERVAL, "outer_lr": OUTER_LR,
                   "outer_momentum": OUTER_MOMENTUM, "nesterov": True, "compression": {"method": "none"},
                   "streaming": {"fragments": FRAGMENTS, "overlap_steps": OVERLAP},
                   "sync_timeout_s": SYNC_TIMEOUT_S, "link": LINK,
                   "elastic": {"lighthouse": lighthouse, "quorum_timeout_s": QUORUM_TIMEOUT_S, "max_attempts": 4}},
    }


@dataclass
class Job:
    name: str
    proc: subprocess.Popen
    log: Path
    out: Path

    def syncs(self) -> dict[int, dict]:
        return {int(p.stem[len("sync"):]): torch.load(p, weights_only=False) for p in self.out.glob("sync*.pt")}

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)


@dataclass
class Scenario:
    jobs: dict[str, Job]
    returncodes: dict[str, int] = field(default_factory=dict)
    stranger_refusals: int = 0
    stranger_admitted: int = 0
    # The flood's start, the restarted worker's first quorum request, the flood's end (wall clock), and
    # how many connections it opened.
    flood: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)
    span: tuple[float, float] = (0.0, 0.0)  # the scenario's (start, end), wall clock
    lost_lighthouse: str = ""  # where the lost worker looked for its lighthouse

    def syncs(self, name: str) -> dict[int, dict]:
        return self.jobs[name].syncs()

    def logs(self) -> str:
        return "\n".join(f"==== {job.name} ====\n{job.log.read_text()[-3000:]}" for job in self.jobs.values())


def _spawn(name: str, command: list[str], work: Path, extra_env: dict[str, str] | None = None) -> Job:
    log = work / f"{name}.log"
    env = {**os.environ, **EXTENSIONS_ENV, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT), "ELASTIC_PROBE_NAN_AT": NAN_AT, **(extra_env or {})}
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: killed as a whole
    return Job(name, proc, log, work / name)


def _worker_flags(name: str, worker: int, work: Path, data: str, config: Path) -> list[str]:
    return ["--ds_config", str(config), "--model", "tiny", "--data-path", data, "--vocab-size", str(TINY_VOCAB),
            "--run-dir", str(work / name / "run"), "--worker-id", str(worker), "--train-iters", str(TRAIN_ITERS),
            "--log-interval", str(SYNC_INTERVAL), "--eval-interval", "0"]


def _worker(name: str, worker: int, work: Path, data: str, config: Path) -> Job:
    # A worker of one rank (D = P = T = 1) is a world of one: started without the deepspeed launcher,
    # whose two extra interpreters would double a start-up the survivors must outlast.
    return _spawn(name, [sys.executable, str(PROBE), str(work / name), *_worker_flags(name, worker, work, data, config)],
                  work)


def _lost_worker(work: Path, data: str, lighthouse: str) -> Job:
    """trainer/pretrain.py itself (a world of one, as its launcher would set it up) with a lighthouse
    nobody answers at."""
    config = work / "lost.json"
    raw = ds_config(lighthouse)
    raw["muloco"]["elastic"].update(quorum_timeout_s=LOST_QUORUM_TIMEOUT_S, quorum_request_timeout_s=1)
    config.write_text(json.dumps(raw))
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return _spawn("lost", [sys.executable, "trainer/pretrain.py", *_worker_flags("lost", 0, work, data, config)], work,
                  world)


def _wait(scenario: Scenario, what: str, done) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while not done():
        for job in scenario.jobs.values():
            if job.proc.poll() not in (None, 0) and job.name not in ("w2", "lost"):  # the one we kill, the lost one
                pytest.fail(f"{job.name} exited with {job.proc.returncode} while waiting for {what}\n{scenario.logs()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{scenario.logs()}")
        time.sleep(0.5)


def _stranger(lighthouse: str, scenario: Scenario, stop: threading.Event) -> None:
    """Asks the lighthouse for a quorum as worker 9, 10**6 steps ahead, until told to stop."""
    from torchft.coordination import LighthouseClient
    while not stop.wait(2.0):
        try:
            LighthouseClient(addr=lighthouse, connect_timeout=timedelta(seconds=2)).quorum(
                replica_id="worker9", timeout=timedelta(seconds=2), address="http://127.0.0.1:1",
                store_address="127.0.0.1:2", step=10**6, world_size=1)
            scenario.stranger_admitted += 1
        # Refused by the gateway (RuntimeError), or left unanswered until its deadline on a loaded
        # machine (TimeoutError): either way not admitted, and the stranger keeps trying.
        except (RuntimeError, TimeoutError):
            scenario.stranger_refusals += 1


def _restarted_worker_asked(lighthouse_log: Path) -> bool:
    """Whether worker 2 relaunched (a second replica id of worker 2) has asked the lighthouse for a quorum."""
    return len(set(re.findall(r"Received quorum request for replica (worker2:\S+)", lighthouse_log.read_text()))) >= 2


def _trickle_flood(address: tuple[str, int], scenario: Scenario) -> None:
    """Until FLOOD_S seconds after the restarted worker's first quorum request (PHASE_TIMEOUT_S at most)."""
    started, asked, opened, pool = time.time(), 0.0, 0, []
    try:
        while time.time() < min(asked + FLOOD_S if asked else math.inf, started + PHASE_TIMEOUT_S):
            if not asked and _restarted_worker_asked(scenario.jobs["lighthouse"].log):
                asked = time.time()
            for _ in range(min(FLOOD_REPLACED if opened else FLOOD_CONNECTIONS, FLOOD_CONNECTIONS - len(pool))):
                pool.append(socket.create_connection(address, timeout=2))
                opened += 1
            for conn in list(pool):
                try:
                    conn.send(b"M")
                except OSError:  # closed by the gateway
                    pool.remove(conn)
                    conn.close()
            time.sleep(FLOOD_TRICKLE_S)
    finally:
        for conn in pool:
            conn.close()
        scenario.flood = (started, asked, time.time(), opened)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    work = tmp_path_factory.mktemp("elastic")
    data = write_markov_dataset(str(work / "markov"), vocab_size=TINY_VOCAB)
    port = free_port()
    config = work / "elastic.json"
    config.write_text(json.dumps(ds_config(f"http://127.0.0.1:{port}")))
    jobs = {"lighthouse": _spawn("lighthouse", [sys.executable, "-m", "muloco.elastic.lighthouse", "--bind",
                                                f"127.0.0.1:{port}", "--join-timeout-s", str(LIGHTHOUSE_TIMEOUT_S),
                                                "--heartbeat-timeout-s", str(LIGHTHOUSE_TIMEOUT_S)], work)}
    scenario = Scenario(jobs, span=(time.time(), 0.0))
    stop = threading.Event()
    stranger = threading.Thread(target=_stranger, args=(f"http://127.0.0.1:{port}", scenario, stop), daemon=True)
    nobody = free_port()  # no lighthouse there
    try:
        jobs["lost"] = _lost_worker(work, data, f"http://127.0.0.1:{nobody}")
        for k in range(WORKERS):
            jobs[f"w{k}"] = _worker(f"w{k}", k, work, data, config)
        stranger.start()
        _wait(scenario, "worker 2's first sync", lambda: len(scenario.syncs("w2")) >= 1)
        jobs["w2"].signal(signal.SIGKILL)
        jobs["w2"].proc.wait(timeout=30)
        _wait(scenario, "a sync of workers 0 and 1 alone",
              lambda: any(s["record"].get("missing") == [2] for s in scenario.syncs("w0").values()))
        jobs["w2b"] = _worker("w2b", 2, work, data, config)  # the same worker, relaunched
        _wait(scenario, "worker 2 to reach its outer loop", lambda: "global batch" in jobs["w2b"].log.read_text())
        flood = threading.Thread(target=_trickle_flood, args=(("127.0.0.1", port), scenario), daemon=True)
        flood.start()  # it joins the quorum next
        _wait(scenario, "a sync of all three after worker 2 rejoined, applied by worker 1 too",
              lambda: any(len(s["record"]["quorum"]) == 3 and not s["record"]["rejoined"] and n in scenario.syncs("w1")
                          for n, s in scenario.syncs("w2b").items()))
        jobs["w1"].signal(signal.SIGSTOP)  # frozen: it never answers again
        for name in ("w0", "w2b"):
            _wait(scenario, f"{name} to finish", lambda job=jobs[name]: job.proc.poll() is not None)
            scenario.returncodes[name] = jobs[name].proc.returncode
        stop.set()
        stranger.join(timeout=30)
        flood.join(timeout=30)
        jobs["lost"].proc.wait(timeout=PHASE_TIMEOUT_S)
        scenario.lost_lighthouse = f"http://127.0.0.1:{nobody}"
        scenario.span = (scenario.span[0], time.time())
        yield scenario
    finally:
        stop.set()
        for job in jobs.values():
            job.signal(signal.SIGKILL)
            job.proc.wait(timeout=30)


def _records(syncs: dict[int, dict]) -> list[dict]:
    return [syncs[n]["record"] for n in sorted(syncs)]


@pytest.mark.launch
def test_while_a_worker_is_down_the_outer_step_averages_exactly_the_survivors_pseudogradients(scenario):
    w0, w1 = scenario.syncs("w0"), scenario.syncs("w1")
    n = min(k for k, s in w0.items() if "deltas" in s and s["record"]["missing"] == [2])
    a, b = w0[n], w1[n]
    assert a["record"]["quorum"] == b["record"]["quorum"] and sorted(a["record"]["quorum"]) == [0, 1]
    assert a["record"]["workers_in_sync"] == 2 and a["record"]["left_out"] == {}
    first, second = (a, b) if a["record"]["quorum"][0] == 0 else (b, a)  # summed in quorum order
    for bucket, (d0, d1) in enumerate(zip(first["deltas"], second["deltas"])):
        expected = (d0 + d1) / 2
        assert torch.equal(a["averaged"][bucket], expected), f"bucket {bucket}: not the plain average"
        assert torch.equal(b["averaged"][bucket], expected), f"bucket {bucket}: survivors differ"
        # Nesterov SGD on the global weights with that average.
        momentum = OUTER_MOMENTUM * a["momentum_before"][bucket] + expected
        stepped = a["global_before"][bucket] - OUTER_LR * (expected + OUTER_MOMENTUM * momentum)
        torch.testing.assert_close(a["global_after"][bucket], stepped, rtol=1e-6, atol=1e-6)
    assert a["sha_after"] == b["sha_after"]


# Syncs applied: every one launched (the last step's is applied at once by the final sync), and the final
# sync of fragment 0, whose weights moved in the last step.
SYNCS = FRAGMENTS * TRAIN_ITERS // SYNC_INTERVAL + 1


def sync_step(outer_step: int) -> int:
    """The inner step that outer step n syncs after (fragments in turn, every SYNC_INTERVAL / FRAGMENTS steps)."""
    return outer_step * SYNC_INTERVAL // FRAGMENTS


@pytest.mark.launch
def test_survivors_apply_every_outer_step_once_and_the_restarted_worker_rejoins_bit_identical(scenario):
    w0, w2b = scenario.syncs("w0"), scenario.syncs("w2b")
    steps = [r["outer_step"] for r in _records(w0)]
    assert steps == list(range(1, SYNCS + 1)), "an outer step applied twice or skipped"
    assert all(r["step"] == sync_step(r["outer_step"]) for r in _records(w0)[:-1])
    assert _records(w0)[-1]["final_sync"] and _records(w0)[-1]["step"] == TRAIN_ITERS
    assert all(r["fragment"] == (r["outer_step"] - 1) % FRAGMENTS for r in _records(w0))
    # One round trip on the critical path: the exchange carries the membership (a catch-up adds its own).
    assert all(r["round_trips"] == 1 for r in _records(w0) if r["attempts"] == 1 and "joining" not in r["left_out"].values())
    rejoin = min(w2b)
    assert w2b[rejoin]["record"]["rejoined"] and w2b[rejoin]["record"]["left_out"] == {"2": "joining"}
    # It took the survivors' state and inner step (its data stream position) and the same outer step.
    assert w2b[rejoin]["sha_before"] == w0[rejoin]["sha_before"]
    assert w2b[rejoin]["record"]["step"] == w0[rejoin]["record"]["step"]
    after = [n for n in w2b if n in w0]
    assert len(after) >= 3
    for n in after:
        assert w2b[n]["sha_after"] == w0[n]["sha_after"], f"outer step {n}: global weights differ"
    both = [n for n in after if n > rejoin and n in scenario.syncs("w1") and len(w0[n]["record"]["quorum"]) == 3]
    assert both, "no sync of all three after the rejoin"
    for n in both:
        assert scenario.syncs("w1")[n]["sha_after"] == w0[n]["sha_after"]
        assert w0[n]["record"]["workers_in_sync"] == 3


@pytest.mark.launch
def test_a_frozen_worker_is_dropped_after_the_sync_timeout_and_the_run_finishes(scenario):
    assert scenario.returncodes == {"w0": 0, "w2b": 0}, scenario.logs()
    w0 = _records(scenario.syncs("w0"))
    without_1 = [r for r in w0 if 1 in r["missing"]]
    assert without_1, "worker 1 was never dropped"
    first = without_1[0]
    # Dropped by the lighthouse (heartbeats stop) or by the collective's timeout, then one retry.
    assert first["sync_seconds"] < SYNC_TIMEOUT_S + 3 * LIGHTHOUSE_TIMEOUT_S + 20
    assert all(1 in r["missing"] for r in w0[w0.index(first):]), "the frozen worker came back"
    assert w0[-1]["outer_step"] == SYNCS and w0[-1]["workers_in_sync"] == 2
    assert scenario.syncs("w2b")[w0[-1]["outer_step"]]["sha_after"] == scenario.syncs("w0")[w0[-1]["outer_step"]]["sha_after"]


@pytest.mark.launch
def test_a_nonfinite_pseudogradient_is_left_out_while_the_others_proceed(scenario):
    w0, w1 = scenario.syncs("w0"), scenario.syncs("w1")
    n = next(n for n in sorted(w0) if w0[n]["record"]["step"] == 2 * SYNC_INTERVAL)  # NAN_AT
    record = w0[n]["record"]
    assert record["left_out"] == {"1": "non-finite pseudogradient"} == w1[n]["record"]["left_out"]
    assert record["workers_in_sync"] == len(record["quorum"]) - 1
    assert w1[n]["sha_after"] == w0[n]["sha_after"]  # it takes the others' step and goes on
    after = w0[n + 1]["record"]
    assert after["left_out"] == {} and after["workers_in_sync"] == len(after["quorum"])


@pytest.mark.launch
def test_a_stranger_without_the_secret_never_joins_and_nobody_heals_from_it(scenario):
    assert scenario.stranger_refusals >= 3 and scenario.stranger_admitted == 0
    assert "refused" in scenario.jobs["lighthouse"].log.read_text()
    for name in ("w0", "w1", "w2b"):
        for record in _records(scenario.syncs(name)):
            assert 9 not in record["quorum"] and "unauthenticated" not in record, (name, record)


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on, as this host's network shows them (/proc/net/tcp*)."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = {link[len("socket:["):-1] for link in (os.readlink(fd) for fd in fds.iterdir()) if link.startswith("socket:[")}
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.launch
def test_on_the_lighthouse_host_only_the_gateway_is_reachable(scenario):
    """torchft's lighthouse port is in the lighthouse's own network (or, where the kernel refuses one, the
    lighthouse says that any process on the host can reach it)."""
    lighthouse = scenario.jobs["lighthouse"]
    text = lighthouse.log.read_text()
    gateway = int(re.search(r"^lighthouse at 127\.0\.0\.1:(\d+) \(workers must hold the job secret; ", text, re.M)[1])
    exposed = re.search(r"^WARNING: any process on this host can reach torchft's port 127\.0\.0\.1:(\d+)", text, re.M)
    assert _listening_ports(lighthouse.proc.pid) == {gateway, *([int(exposed[1])] if exposed else [])}, text[-3000:]
    assert exposed or "only the gateway reaches torchft's port" in text


@pytest.mark.launch
def test_a_worker_restarted_during_a_trickle_flood_rejoins_soon_after_it_and_the_gateway_logs_a_few_lines(scenario):
    started, asked, ended, opened = scenario.flood
    assert started < asked and ended - asked >= FLOOD_S and opened > FLOOD_CONNECTIONS  # it asked during the flood
    w2b = scenario.syncs("w2b")
    assert w2b[min(w2b)]["record"]["rejoined"]
    assert w2b[min(w2b)]["time"] - ended < QUORUM_TIMEOUT_S
    counts = [int(n) for n in re.findall(r"lighthouse gateway: refused (\d+) connection",
                                         scenario.jobs["lighthouse"].log.read_text())]
    # Every flood connection was refused and counted; one line per source (here one) and interval.
    assert sum(counts) >= opened
    assert len(counts) <= 1 + (scenario.span[1] - scenario.span[0]) / REFUSAL_LOG_INTERVAL_S


@pytest.mark.launch
def test_a_worker_whose_lighthouse_never_answers_stops_with_one_line_naming_it(scenario):
    lost = scenario.jobs["lost"]
    text = lost.log.read_text()
    assert lost.proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    stops = [line for line in text.splitlines() if line.startswith("stopping:")]
    assert len(stops) == 1 and re.fullmatch(
        rf"stopping: rank 0: worker 0: no quorum from the lighthouse at {re.escape(scenario.lost_lighthouse)} in "
        rf"\d+ s of asking \(\d+ requests\): .*", stops[0]), stops
    # Its tunnel's failed connections (torchft reconnects several times a second): a line per interval.
    assert 1 <= len([line for line in text.splitlines() if line.startswith("tunnel to the lighthouse")]) <= 2


# -- without launches ----------------------------------------------------------------------------

def test_membership_leaves_out_joining_nonfinite_and_outlier_members():
    from muloco.elastic.membership import Member, left_out

    def member(worker, norm, joining=False, nonfinite=False):
        return Member(worker, 8, joining, nonfinite, norm)

    assert left_out([member(0, 1.0), member(1, 1.1), member(2, 0.9)], 10.0) == {}
    assert left_out([member(0, 1.0), member(1, 50.0), member(2, 0.9)], 10.0) == {
        1: "pseudogradient norm 50 is over 10.0x its peers'"}
    assert left_out([member(0, 1.0, joining=True), member(1, float("inf"), nonfinite=True), member(2, 0.9)],
                    10.0) == {0: "joining", 1: "non-finite pseudogradient"}
    # Two contributors: only the one far above the other is left out.
    assert left_out([member(0, 1.0), member(1, 20.0)], 10.0) == {1: "pseudogradient norm 20 is over 10.0x its peers'"}


def test_a_rendezvous_port_another_job_holds_is_one_line_naming_it(monkeypatch):
    """Two workers on one host both on the launcher's default --master_port: the second one's rank 0
    says so in one line before anything starts (it died with a traceback; the other trained alone)."""
    from torch.distributed import TCPStore

    from muloco.core.comm import check_rendezvous_port
    from muloco.core.errors import ConfigError

    other_job = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(other_job.port))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=rf"^the rendezvous port {other_job.port} \(MASTER_PORT, the launcher's "
                                          r"--master_port\) is already in use on this host: .* its own --master_port$"):
        check_rendezvous_port()
    monkeypatch.setenv("RANK", "1")
    check_rendezvous_port()  # the other ranks are the store's clients
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    check_rendezvous_port()


@pytest.mark.parametrize("block, flags, message", [
    ({}, [], "needs --worker-id"),
    ({}, ["--worker-id", "3"], "outside 0..2"),
])
def test_elastic_config_errors_name_the_problem(tmp_path, block, flags, message):
    from trainer.config import build_parser, resolve
    from muloco.core.errors import ConfigError

    config = ds_config("http://127.0.0.1:1")
    config["muloco"].update(block)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        resolve(build_parser().parse_args(["--ds_config", str(path), "--data-path", "x", *flags]), 1)


def test_worker_id_without_an_elastic_block_is_an_error(repo_root):
    from trainer.config import build_parser, resolve
    from muloco.core.errors import ConfigError

    args = ["--ds_config", str(repo_root / "ds_configs" / "cpu_tiny_muloco.json"), "--data-path", "x", "--worker-id", "0"]
    with pytest.raises(ConfigError, match="--worker-id is for elastic workers"):
        resolve(build_parser().parse_args(args), 2)
