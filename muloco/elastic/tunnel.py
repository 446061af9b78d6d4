"""An authenticated TCP tunnel to the lighthouse: nobody without the job secret can reach it.

torchft's lighthouse (Rust, gRPC) accepts anyone who can connect, and whoever reaches it can join the
quorum, claim to be far ahead and have every worker load its state. So the lighthouse listens on a
loopback of its own (muloco/elastic/private_network.py), and the port the workers reach is a `Gateway`
in front of it; each worker's rank 0 runs a `Tunnel` on its own loopback, which its torchft
ManagerServer uses as the lighthouse's address.
Every connection through them:

1. handshake: the tunnel sends a magic and a fresh nonce; the gateway answers with its own nonce and
   an HMAC of both under the job secret (muloco/diloco/auth.py); the tunnel checks it and answers
   with its own HMAC; a side whose check fails closes the connection (the gateway logs it). Fresh
   nonces on both sides make a recorded handshake useless.
2. frames: the bytes then travel in frames of at most FRAME_BYTES, each with an HMAC under a key of
   this connection and direction over its sequence number and bytes, so nothing can be injected,
   dropped, reordered or replayed inside a connection either. No encryption: the bytes are readable.

Relaying is two threads per connection (gRPC keeps a few long-lived connections per worker).

A stranger cannot hold the gateway either: a handshake has HANDSHAKE_TIMEOUT_S in all (not per read, so
one byte every few seconds does not keep it open), and of the connections in their handshake each source
address holds at most MAX_HANDSHAKES_PER_SOURCE and all together MAX_HANDSHAKES; a new one beyond either
cap closes the oldest (of its source, else of all). A flood thus displaces only itself, and an honest
handshake, which takes milliseconds, completes. Refusals are logged at most once per source and
REFUSAL_LOG_INTERVAL_S, with their count; so are a tunnel's failed connections while the lighthouse is
out of reach (torchft reconnects several times a second).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable

from muloco.diloco.auth import JobKey

MAGIC = b"MULOCOT1"
NONCE_BYTES = 32
DIGEST_BYTES = 32
FRAME_BYTES = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0
MAX_HANDSHAKES = 64  # connections in their handshake at once; a new one closes the oldest
MAX_HANDSHAKES_PER_SOURCE = 8
REFUSAL_LOG_INTERVAL_S = 10.0  # the gateway's refusals, a tunnel's failed connections: a line per interval


class TunnelError(ConnectionError):
    """A connection that failed authentication or broke a frame."""


def _read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a `deadline` (time.monotonic()), all of them by then."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TunnelError(f"handshake not finished within {HANDSHAKE_TIMEOUT_S:g} s")
            sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise TunnelError("connection closed")
        data += chunk
    return bytes(data)


class _Direction:
    """One direction of a connection: frames tagged under its own key with a running sequence."""

    def __init__(self, key: bytes):
        self.key, self.sequence = key, 0

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self.key, struct.pack("<Q", self.sequence) + payload, hashlib.sha256).digest()

    def send(self, sock: socket.socket, payload: bytes) -> None:
        sock.sendall(struct.pack("<I", len(payload)) + payload + self._tag(payload))
        self.sequence += 1

    def receive(self, sock: socket.socket) -> bytes:
        (length,) = struct.unpack("<I", _read_exactly(sock, 4))
        if not 0 < length <= FRAME_BYTES:
            raise TunnelError(f"frame of {length} bytes")
        payload = _read_exactly(sock, length)
        if not hmac.compare_digest(_read_exactly(sock, DIGEST_BYTES), self._tag(payload)):
            raise TunnelError("frame failed authentication")
        self.sequence += 1
        return payload


def _session(key: JobKey, client_nonce: bytes, server_nonce: bytes) -> tuple[_Direction, _Direction]:
    """(client to server, server to client) for one connection."""
    return (_Direction(key.mac(b"tunnel c2s", client_nonce, server_nonce)),
            _Direction(key.mac(b"tunnel s2c", client_nonce, server_nonce)))


def _client_handshake(sock: socket.socket, key: JobKey) -> tuple[_Direction, _Direction]:
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + client_nonce)
    server_nonce = _read_exactly(sock, NONCE_BYTES)
    proof = _read_exactly(sock, DIGEST_BYTES)
    if not hmac.compare_digest(proof, key.mac(b"tunnel gateway", client_nonce, server_nonce)):
        raise TunnelError("the lighthouse gateway failed authentication (another job secret, or not a MuLoCo gateway)")
    sock.sendall(key.mac(b"tunnel worker", client_nonce, server_nonce))
    return _session(key, client_nonce, server_nonce)


def _server_handshake(sock: socket.socket, key: JobKey) -> tuple[_Direction, _Direction]:
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    hello = _read_exactly(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not hello.startswith(MAGIC):
        raise TunnelError("not a MuLoCo tunnel")
    client_nonce, server_nonce = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    sock.sendall(server_nonce + key.mac(b"tunnel gateway", client_nonce, server_nonce))
    proof = _read_exactly(sock, DIGEST_BYTES, deadline)
    if not hmac.compare_digest(proof, key.mac(b"tunnel worker", client_nonce, server_nonce)):
        raise TunnelError("failed authentication (no job secret, or another one)")
    return _session(key, client_nonce, server_nonce)


def _relay(plain: socket.socket, framed: socket.socket, outgoing: _Direction, incoming: _Direction) -> None:
    """Copy plain -> framed (sending frames) and framed -> plain (checking them) until either side
    closes or a frame fails; then close both."""
    def close() -> None:
        for s in (plain, framed):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def up() -> None:
        try:
            while chunk := plain.recv(FRAME_BYTES):
                outgoing.send(framed, chunk)
        except OSError:
            pass
        close()

    def down() -> None:
        try:
            while True:
                plain.sendall(incoming.receive(framed))
        except TunnelError as err:
            if str(err) != "connection closed":
                print(f"tunnel: dropped a connection: {err}", file=sys.stderr, flush=True)
        except OSError:
            pass
        close()

    threading.Thread(target=up, daemon=True).start()
    threading.Thread(target=down, daemon=True).start()


class _Listener:
    """A listening socket whose connections are handed to `serve` in threads."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_server((host, port))
        self.sock.settimeout(0.5)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=self.serve, args=(conn, peer), daemon=True).start()

    def serve(self, conn: socket.socket, peer) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=5)


class _Handshakes:
    """The gateway's connections in their handshake, oldest first, within the caps (see the module)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, str] = OrderedDict()

    def admit(self, conn: socket.socket, source: str) -> None:
        with self._lock:
            same_source = [c for c, s in self._pending.items() if s == source]
            if len(same_source) >= MAX_HANDSHAKES_PER_SOURCE:
                self._evict(same_source[0])
            elif len(self._pending) >= MAX_HANDSHAKES:
                self._evict(next(iter(self._pending)))
            self._pending[conn] = source

    def finished(self, conn: socket.socket) -> None:
        with self._lock:
            self._pending.pop(conn, None)

    def _evict(self, conn: socket.socket) -> None:
        """Wake its thread, blocked reading, which then refuses it as closed."""
        self._pending.pop(conn)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _CountedLog:
    """One line per key (a source, a remote) and REFUSAL_LOG_INTERVAL_S, with how many failures it stands
    for: `line(key, count, last reason)` says it."""

    def __init__(self, line: Callable[[str, int, object], str]):
        self._line = line
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._last_line: dict[str, float] = {}

    def failed(self, key: str, reason: object) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            now = time.monotonic()
            if now - self._last_line.get(key, -REFUSAL_LOG_INTERVAL_S) < REFUSAL_LOG_INTERVAL_S:
                return
            count, self._counts[key], self._last_line[key] = self._counts[key], 0, now
        print(self._line(key, count, reason), file=sys.stderr, flush=True)


class Gateway(_Listener):
    """The lighthouse's public port: authenticates each connection, then relays it to `target` (which may
    be set after the port is bound, up to `start`: the lighthouse binds it before entering its own network)."""

    def __init__(self, host: str, port: int, target: tuple[str, int] | None, key: JobKey):
        super().__init__(host, port)
        self.target, self.key = target, key
        self.refused = 0
        self._handshakes = _Handshakes()
        self._log = _CountedLog(lambda source, count, last: f"lighthouse gateway: refused {count} connection(s) from "
                                                           f"{source} since its last line (last: {last})")

    def serve(self, conn: socket.socket, peer) -> None:
        self._handshakes.admit(conn, peer[0])
        try:
            c2s, s2c = _server_handshake(conn, self.key)
            conn.settimeout(None)
        except (TunnelError, OSError) as err:
            self.refused += 1
            self._log.failed(peer[0], err)
            conn.close()
            return
        finally:
            self._handshakes.finished(conn)
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            conn.close()
            return
        _relay(upstream, conn, outgoing=s2c, incoming=c2s)


class Tunnel(_Listener):
    """A loopback port that reaches `remote` (a Gateway) over authenticated connections."""

    def __init__(self, remote: tuple[str, int], key: JobKey):
        super().__init__("127.0.0.1", 0)
        self.remote, self.key = remote, key
        self._log = _CountedLog(lambda remote, count, last: f"tunnel to the lighthouse {remote}: {count} connection(s) "
                                                           f"failed since its last line (last: {last})")

    def serve(self, conn: socket.socket, peer) -> None:
        try:
            remote = socket.create_connection(self.remote, timeout=HANDSHAKE_TIMEOUT_S)
            c2s, s2c = _client_handshake(remote, self.key)
            remote.settimeout(None)
        except (TunnelError, OSError) as err:
            self._log.failed(f"{self.remote[0]}:{self.remote[1]}", err)
            conn.close()
            return
        _relay(conn, remote, outgoing=c2s, incoming=s2c)

