"""The elastic mode's lighthouse against a stranger who knows its address but not the job secret,
without launching a trainer: the lighthouse's gateway and the workers' tunnel (muloco/elastic/tunnel.py)
in front of a real torchft lighthouse. Only a holder of the secret reaches it, frames are authenticated,
floods and slow handshakes keep no worker out and are logged in a few lines, an outage is logged a line
per interval, and a port opened in the lighthouse's own network is out of the host's reach."""
from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torchft.coordination import LighthouseClient, LighthouseServer

from job_keys import KEY, STRANGER_KEY
from muloco.core.network import host_port
from muloco.elastic.tunnel import Gateway, Tunnel, TunnelError, _Direction

REPO_ROOT = Path(__file__).resolve().parents[1]


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
    impostor = Tunnel(lighthouse.address, STRANGER_KEY).start()
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
