"""The elastic mode against a stranger who knows the lighthouse's address but not the job secret, and
against crafted state, without launching a trainer: the lighthouse's gateway and the workers' tunnel
(muloco/elastic/tunnel.py) in front of a real torchft lighthouse, a worker's quorum requests while the
lighthouse's transport fails (what a flood at its gateway can do), the state transfer's parser and
checks, torchft's manager server bound where the config says, and a walk over the code for anything
that could unpickle what it receives."""
from __future__ import annotations

import ast
import os
import re
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore
from torchft.coordination import LighthouseClient, LighthouseServer

from muloco.core.rank_file import RankFileError, state_from_bytes, state_to_bytes
from muloco.diloco.auth import JobKey
from muloco.elastic.authentic_quorum import AuthenticatedQuorums, signed_replica_id
from muloco.elastic.quorum import NoQuorum, QuorumGroup
from muloco.core.network import host_port
from muloco.elastic.tunnel import Gateway, Tunnel, TunnelError, _Direction

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = JobKey(b"k" * 32, "test-job")
TIMEOUT = timedelta(seconds=5)
REFUSED = (RuntimeError, TimeoutError)


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200)
    gateway = Gateway("127.0.0.1", 0, ("127.0.0.1", host_port(server.address())[1]), KEY).start()
    yield gateway
    gateway.close()
    server.shutdown()


def ask_quorum(address: str, replica: str, step: int):
    client = LighthouseClient(addr=address, connect_timeout=TIMEOUT)
    return client.quorum(replica_id=replica, timeout=TIMEOUT, address="http://127.0.0.1:1", store_address="127.0.0.1:2",
                         step=step, world_size=1)


def test_only_a_worker_holding_the_secret_joins_the_quorum(lighthouse):
    worker = Tunnel(lighthouse.address, KEY).start()
    impostor = Tunnel(lighthouse.address, JobKey(b"x" * 32, "test-job")).start()
    try:
        assert [m.replica_id for m in ask_quorum(f"http://127.0.0.1:{worker.address[1]}", "worker0", 3).participants] \
            == ["worker0"]
        # A stranger speaking torchft's protocol straight to the lighthouse's port, and one with another
        # secret (claiming a far-ahead step, which would make every worker heal from it): both refused.
        # torchft reports the gateway's hang-up as a RuntimeError, or as a TimeoutError when gRPC calls
        # the dropped call "cancelled" (seen on a loaded machine); either way no quorum is returned.
        with pytest.raises(REFUSED):
            ask_quorum(f"http://{lighthouse.address[0]}:{lighthouse.address[1]}", "worker9", 10**6)
        with pytest.raises(REFUSED):
            ask_quorum(f"http://127.0.0.1:{impostor.address[1]}", "worker8", 10**6)
        deadline = time.monotonic() + 10  # the gateway counts a refusal when its side of the handshake ends
        while lighthouse.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lighthouse.refused >= 2
        quorum = ask_quorum(f"http://127.0.0.1:{worker.address[1]}", "worker0", 4)
        assert [m.replica_id for m in quorum.participants] == ["worker0"]
    finally:
        worker.close()
        impostor.close()


_IN_A_NETWORK_OF_ITS_OWN = """
import socket, sys
from muloco.elastic.private_network import enter_private_network
before = socket.create_server(("127.0.0.1", 0))
refused = enter_private_network()
after = socket.create_server(("127.0.0.1", 0))
socket.create_connection(after.getsockname()).close()  # its own loopback is up
print(before.getsockname()[1], after.getsockname()[1], refused, flush=True)
sys.stdin.read()
"""


@pytest.mark.launch
def test_a_port_opened_in_the_lighthouses_own_network_is_out_of_reach_of_the_host():
    """What the lighthouse does (muloco/elastic/private_network.py): its public socket, opened before it
    enters a network of its own, stays reachable; a port opened after (torchft's) is not, from the host."""
    child = subprocess.Popen([sys.executable, "-c", _IN_A_NETWORK_OF_ITS_OWN], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        before, after, refused = child.stdout.readline().split(" ", 2)
        if refused.strip() != "None":
            pytest.skip(f"this kernel refuses a network namespace: {refused.strip()}")
        socket.create_connection(("127.0.0.1", int(before)), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(after)), timeout=5)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_a_connection_that_sends_nothing_is_closed_and_does_not_hold_the_gateway(lighthouse, monkeypatch):
    monkeypatch.setattr("muloco.elastic.tunnel.HANDSHAKE_TIMEOUT_S", 0.5)
    idle = socket.create_connection(lighthouse.address)
    idle.settimeout(5)
    assert idle.recv(1) == b""  # the gateway hung up on it
    idle.close()


def test_frames_that_were_altered_reordered_or_replayed_are_refused():
    a, b = socket.socketpair()
    sender, receiver = _Direction(b"s" * 32), _Direction(b"s" * 32)
    sender.send(a, b"hello")
    assert receiver.receive(b) == b"hello"
    # Altered: one bit of the payload.
    payload = b"world"
    frame = struct.pack("<I", 5) + payload + sender._tag(payload)
    a.sendall(frame[:4] + b"w0rld" + frame[9:])
    with pytest.raises(TunnelError, match="failed authentication"):
        receiver.receive(b)
    # Replayed: the first frame again (its sequence number is behind the receiver's).
    a2, b2 = socket.socketpair()
    sender2, receiver2 = _Direction(b"s" * 32), _Direction(b"s" * 32)
    sender2.send(a2, b"one")
    first = struct.pack("<I", 3) + b"one" + _Direction(b"s" * 32)._tag(b"one")
    receiver2.receive(b2)
    a2.sendall(first)
    with pytest.raises(TunnelError, match="failed authentication"):
        receiver2.receive(b2)
    for s in (a, b, a2, b2):
        s.close()


def test_the_tunnel_relays_bytes_both_ways():
    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = echo.accept()
        while data := conn.recv(65536):
            conn.sendall(data[::-1])
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    gateway = Gateway("127.0.0.1", 0, echo.getsockname()[:2], KEY).start()
    tunnel = Tunnel(gateway.address, KEY).start()
    try:
        with socket.create_connection(tunnel.address, timeout=10) as conn:
            message = bytes(range(256)) * 5000  # more than one frame
            conn.sendall(message)
            received = b""
            while len(received) < len(message):
                received += conn.recv(1 << 20)
            # The echo reverses each chunk it reads; concatenated, the multiset of bytes is the same.
            assert sorted(received) == sorted(message) and len(received) == len(message)
    finally:
        tunnel.close()
        gateway.close()
        echo.close()


@pytest.fixture
def echo_gateway():
    """A gateway in front of a server that echoes every connection."""
    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = echo.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                             daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    gateway = Gateway("127.0.0.1", 0, echo.getsockname()[:2], KEY).start()
    yield gateway
    gateway.close()
    echo.close()


def test_a_trickle_flood_keeps_no_worker_out_and_is_logged_in_a_few_lines(echo_gateway, capsys):
    """100 strangers that each send a byte every 0.2 s (more than the gateway's 64 handshake slots)."""
    flood = [socket.create_connection(echo_gateway.address) for _ in range(100)]
    tunnel = Tunnel(echo_gateway.address, KEY).start()
    try:
        for round_ in range(10):
            for stranger in flood:
                try:
                    stranger.send(b"M")
                except OSError:
                    pass  # closed by the gateway
            if round_ == 5:
                with socket.create_connection(tunnel.address, timeout=5) as honest:
                    honest.sendall(b"ping")
                    assert honest.recv(4) == b"ping"
            time.sleep(0.2)
    finally:
        tunnel.close()
        for stranger in flood:
            stranger.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if "lighthouse gateway: refused" in line]
    assert 1 <= len(lines) <= 2, lines  # one per source and interval, with the count


def test_a_tunnel_whose_lighthouse_is_out_of_reach_logs_its_failed_connections_a_line_per_interval(capsys, monkeypatch):
    """torchft reconnects several times a second during an outage: one line per interval, with the count."""
    monkeypatch.setattr("muloco.elastic.tunnel.REFUSAL_LOG_INTERVAL_S", 0.5)
    closed = socket.create_server(("127.0.0.1", 0))
    remote = closed.getsockname()[:2]
    closed.close()  # nothing listens there
    tunnel = Tunnel(remote, KEY).start()

    def attempt() -> None:
        with socket.create_connection(tunnel.address, timeout=5) as conn:
            assert conn.recv(1) == b""  # the tunnel hung up: it could not reach the lighthouse

    try:
        for _ in range(20):
            attempt()
        time.sleep(0.6)
        attempt()
    finally:
        tunnel.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tunnel to the lighthouse")]
    assert [int(re.search(r": (\d+) connection", line).group(1)) for line in lines] == [1, 20], lines
    assert f"127.0.0.1:{remote[1]}" in lines[0] and "refused" in lines[0].lower()


def test_a_handshake_has_a_deadline_in_all_not_per_read(echo_gateway, monkeypatch):
    monkeypatch.setattr("muloco.elastic.tunnel.HANDSHAKE_TIMEOUT_S", 1.0)
    slow = socket.create_connection(echo_gateway.address)
    start, closed = time.monotonic(), False
    try:
        while time.monotonic() - start < 5 and not closed:
            try:
                slow.send(b"M")  # one byte every 0.2 s: each read well within the deadline
                slow.settimeout(0.2)
                closed = slow.recv(1) == b""
            except TimeoutError:
                pass
            except OSError:
                closed = True
    finally:
        slow.close()
    assert closed and time.monotonic() - start < 3


class _Cable:
    """A TCP relay to `target` that can be cut (its connections closed, new ones hung up on) and mended."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.cut, self.ends = target, False, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.sock.accept()
            except OSError:
                return
            if self.cut:
                near.close()
                continue
            far = socket.create_connection(self.target)
            self.ends += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._copy, args=(a, b), daemon=True).start()

    @staticmethod
    def _copy(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        b.close()

    def cut_off(self) -> None:
        self.cut = True
        for end in self.ends:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.ends = []

    def close(self) -> None:
        self.cut_off()
        self.sock.close()


def test_a_worker_whose_lighthouse_transport_fails_gets_no_quorum_and_then_a_fresh_one(monkeypatch):
    """torchft's manager server only logs the lighthouse's transport error ("lighthouse quorum failed ...
    transport error") and lets the request wait out its timeout, and its Manager raises that timeout again
    from every later call: QuorumGroup.start says NoQuorum, and once the lighthouse is back the next
    request forms a quorum that commits. Real torchft, tunnel and gateway; the cable behind the gateway
    is cut."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200)
    cable = _Cable(("127.0.0.1", host_port(server.address())[1]))
    gateway = Gateway("127.0.0.1", 0, cable.address, KEY).start()
    quorum = QuorumGroup(0, 0, 1, f"http://127.0.0.1:{gateway.address[1]}", "127.0.0.1", KEY, "gloo",
                         sync_timeout=TIMEOUT, request_timeout=timedelta(seconds=1), workers=1)
    try:
        quorum.start()
        assert quorum.commit()
        cable.cut_off()
        with pytest.raises(NoQuorum, match=r"^no answer within 1 s"):
            quorum.start()
        cable.cut = False
        quorum.start()
        assert quorum.commit() and quorum.committed_syncs == 2
    finally:
        quorum.shutdown()
        gateway.close()
        cable.close()
        server.shutdown()


def _honest_worker(worker: int, lighthouse: str, monkeypatch) -> tuple[QuorumGroup, TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return QuorumGroup(worker, 0, 1, lighthouse, "127.0.0.1", KEY, "gloo", sync_timeout=TIMEOUT,
                       request_timeout=timedelta(seconds=10), workers=2), store


def _sync_once(quorum: QuorumGroup, worker: int) -> list:
    """One quorum and one tagged exchange on its group: every member's worker id, and the commit."""
    quorum.start()
    wire = quorum.wire(None)
    wire.begin(outer_step=0, fragment=0, epoch=quorum.epoch)
    rows = wire.all_gather_ints([worker], "test sync")
    return [rows, quorum.commit()]


def test_a_stranger_on_the_lighthouse_host_shares_its_quorums_but_never_the_group(monkeypatch, capsys):
    """torchft's lighthouse on its host's loopback (where the kernel refuses the lighthouse a network of
    its own) admits anyone. A stranger there asks it for every quorum (heartbeating, claiming a
    far-ahead step, so torchft would make its store the one every member meets at) and then sends
    nothing: the two workers holding the secret still form their group, of the two of them, and sync
    and commit every time, and each names the stranger once per quorum. The lighthouse forms quorums
    of three only, so the stranger is in every one."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=200)
    inner = server.address()
    gateway = Gateway("127.0.0.1", 0, ("127.0.0.1", host_port(inner)[1]), KEY).start()
    seen, stop = [], threading.Event()

    def stranger() -> None:
        client = LighthouseClient(addr=inner, connect_timeout=TIMEOUT)
        while not stop.is_set():
            try:
                client.heartbeat("worker9")
                quorum = client.quorum(replica_id="worker9", timeout=timedelta(seconds=1), address="http://127.0.0.1:1",
                                       store_address="127.0.0.1:1", step=10**6, world_size=1)
                seen.append([m.replica_id for m in quorum.participants])
            except (RuntimeError, TimeoutError):
                pass

    intruder = threading.Thread(target=stranger, daemon=True)
    intruder.start()
    workers = [_honest_worker(k, f"http://127.0.0.1:{gateway.address[1]}", monkeypatch) for k in (0, 1)]
    try:
        for _ in range(2):
            results = [None, None]
            threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, _sync_once(workers[k][0], k)))
                       for k in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert results == [[[[0], [1]], True]] * 2
            assert [q.quorums.dropped for q, _ in workers] == [1, 1]
        assert any(len(ids) == 3 and "worker9" in ids for ids in seen)  # it was in the lighthouse's quorums
        out = capsys.readouterr().out
        for k in (0, 1):
            said = re.findall(rf"^worker {k}: quorum (\d+) holds 1 member\(s\) not among this job's 2 workers, left "
                              r"out: worker9 \(not signed by the job secret\)$", out, re.M)
            assert said and len(said) == len(set(said)), out  # a line per quorum, not per request
    finally:
        stop.set()
        for quorum, _ in workers:
            quorum.shutdown()
        gateway.close()
        server.shutdown()
        intruder.join(timeout=10)


def test_only_members_signed_under_the_job_secret_count_and_a_copied_id_sits_its_worker_out():
    first, second = (signed_replica_id(KEY, k, f"10.0.0.{k}:29500") + f":uuid{k}" for k in (0, 1))
    copy = second.rpartition(":")[0] + ":uuid9"  # a stranger replaying the id the lighthouse showed it
    other_key = signed_replica_id(JobKey(b"x" * 32, "test-job"), 2, "10.0.0.9:1") + ":uuid2"
    forged = "worker3:00:" + "0" * 32 + "@10.0.0.9:1:uuid3"
    beyond_k = signed_replica_id(KEY, 7, "10.0.0.7:29500") + ":uuid7"  # the secret's, but not one of the K = 2
    result = SimpleNamespace(quorum_id=7, replica_rank=0, replica_world_size=6, store_address="10.0.0.9:1",
                             max_step=10**6, max_replica_rank=None, max_world_size=1, heal=False,
                             recover_src_manager_address="", recover_src_replica_rank=None, recover_dst_replica_ranks=[],
                             replica_ids=sorted([first, second, copy, other_key, forged, beyond_k]))
    client = SimpleNamespace(_quorum=lambda group_rank, *a, **k: result)
    said = []
    quorums = AuthenticatedQuorums(client, KEY, first, workers=2, say=said.append)
    kept = quorums._quorum(0)
    assert (kept.replica_ids, kept.replica_rank, kept.replica_world_size, kept.store_address) == \
        ([first], 0, 1, "10.0.0.0:29500")
    assert (kept.max_replica_rank, kept.max_world_size, quorums.dropped) == (0, 1, 5)
    (line,) = said
    assert line.startswith("worker 0: quorum 7 holds 5 member(s) not among this job's 2 workers, left out: ")
    for why in ("(not signed by the job secret)", "(signed as worker7, not one of this job's workers 0..1)",
                "(one of 2 members signed as worker1 (a copied id))"):
        assert why in line
    assert line.count("not signed by the job secret") == 2 and line.count("a copied id") == 2
    quorums._quorum(1)  # another rank's request, or a retry, in the same quorum: no second line
    assert len(said) == 1
    result.quorum_id = 8
    quorums._quorum(0)
    assert len(said) == 2 and said[1].startswith("worker 0: quorum 8 holds 5 member(s)")
    with pytest.raises(RuntimeError, match="sits it out"):
        AuthenticatedQuorums(client, KEY, second, workers=2)._quorum(0)
    honest = SimpleNamespace(**{**vars(result), "replica_ids": [first, second]})
    assert AuthenticatedQuorums(SimpleNamespace(_quorum=lambda *a: honest), KEY, second, workers=2,
                                say=said.append)._quorum(0) is honest
    assert len(said) == 2  # nobody to name


def test_a_strangers_id_is_named_in_printable_ascii_cut_short():
    """The stranger chooses its replica id: a newline or a megabyte of it must not make the line many."""
    first = signed_replica_id(KEY, 0, "10.0.0.0:29500") + ":uuid0"
    crafted = ["evil\nworker 1: forged line\x1b[2J" + "x" * 1000] + [f"stranger{i}" for i in range(20)]
    result = SimpleNamespace(quorum_id=3, max_step=0, replica_ids=[first, *crafted])
    said = []
    AuthenticatedQuorums(SimpleNamespace(_quorum=lambda *a: result), KEY, first, workers=1, say=said.append)._quorum(0)
    (line,) = said
    assert "\n" not in line and "\x1b" not in line and line.isascii() and len(line) < 1500
    assert r"evil\nworker 1: forged line\x1b[2Jxxx" in line
    assert "x... (not signed by the job secret); stranger0 (not signed" in line
    assert line.endswith("; and 13 more")


class _CreatesMarker:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_state_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(RankFileError, match="not a state in safetensors format"):
        state_from_bytes(pickle.dumps({"global_weights": _CreatesMarker(marker)}), "the state from quorum member 1")
    assert not marker.exists()


def test_state_bytes_round_trip_and_truncations_are_refused():
    state = {"outer_step": 3, "skipped": 0, "step": 12, "global_weights": {"w": torch.randn(4, 5)},
             "momentum": {"w": torch.zeros(4, 5)}, "scheduler": {"last_epoch": 12, "lr_lambdas": [None]}}
    data = state_to_bytes(state)
    back = state_from_bytes(data, "x")
    assert torch.equal(back["global_weights"]["w"], state["global_weights"]["w"]) and back["step"] == 12
    for cut in (0, 7, 9, len(data) // 2, len(data) - 1):
        with pytest.raises(RankFileError):
            state_from_bytes(data[:cut], "x")


def _non_loopback_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_the_manager_server_binds_the_configured_address_only():
    import torchft.manager
    from muloco.elastic.quorum import _manager_server_bound_to

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        with _manager_server_bound_to("127.0.0.1"):
            server = torchft.manager.ManagerServer(
                replica_id="worker0", lighthouse_addr=lighthouse.address(), hostname="ignored", bind="[::]:0",
                store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(seconds=1),
                connect_timeout=TIMEOUT, quorum_retries=0)
        try:
            host, port = host_port(server.address())
            assert host == "127.0.0.1"
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            other = _non_loopback_address()
            if other is not None:
                with pytest.raises(OSError):
                    socket.create_connection((other, port), timeout=2).close()
        finally:
            server.shutdown()
    finally:
        lighthouse.shutdown()


CODE_DIRS = ("trainer", "tools", "dataprep", "tokenizer", "megatron_patches", "scripts", "benchmarks")


def test_nothing_in_the_project_can_unpickle_what_it_reads():
    """No pickle import, no torch.load without weights_only=True, no torchft Manager left with its
    default (HTTP, pickling) checkpoint transport, anywhere outside the tests."""
    problems = []
    for path in sorted(p for d in CODE_DIRS for p in (REPO_ROOT / d).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(REPO_ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names):
                    problems.append(f"{where}:{node.lineno} imports a pickler")
                if any(n == "HTTPTransport" for n in names):
                    problems.append(f"{where}:{node.lineno} imports torchft's HTTPTransport")
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                keywords = {k.arg: k.value for k in node.keywords}
                if name.endswith("torch.load") or name == "load" and "weights_only" in keywords:
                    value = keywords.get("weights_only")
                    if not (isinstance(value, ast.Constant) and value.value is True):
                        problems.append(f"{where}:{node.lineno} torch.load without weights_only=True")
                if name in ("Manager", "torchft.Manager") and "checkpoint_transport" not in keywords:
                    problems.append(f"{where}:{node.lineno} torchft Manager with its default checkpoint transport")
                if name.endswith(("np.load", "numpy.load")) and isinstance(keywords.get("allow_pickle"), ast.Constant) \
                        and keywords["allow_pickle"].value:
                    problems.append(f"{where}:{node.lineno} numpy.load(allow_pickle=True)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["../../outside/secret.model", "/etc/passwd", "sub/../../x.model", "link.model"])
def test_a_checkpoint_whose_tokenizer_path_leaves_its_folder_is_refused(tmp_path, name):
    from trainer.checkpoint import CheckpointReader
    from trainer.checkpoint.format import CheckpointError

    folder = tmp_path / "ckpt" / "iter_0000010"
    folder.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.model").write_text("secret")
    (folder / "link.model").symlink_to(tmp_path / "outside" / "secret.model")
    (folder / "tokenizer.model").write_text("ours")
    reader = CheckpointReader.__new__(CheckpointReader)
    reader.directory, reader.meta = folder, SimpleNamespace(tokenizer_model=name)
    with pytest.raises(CheckpointError, match="is not a file in the checkpoint's folder"):
        reader.tokenizer_path
    reader.meta = SimpleNamespace(tokenizer_model="tokenizer.model")
    assert reader.tokenizer_path.read_text() == "ours"
