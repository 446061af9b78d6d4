"""The elastic mode's quorums against strangers and failures, without launching a trainer: a worker whose
lighthouse transport fails gets no quorum and then a fresh one; a stranger in the lighthouse's quorums
never joins the workers' group; only members signed under the job secret count (a copied id sits its
worker out, a stranger's id is named in one printable line); torchft's manager server binds the
configured address only."""
from __future__ import annotations

import re
import socket
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore
from torchft.coordination import LighthouseClient, LighthouseServer

from job_keys import KEY, STRANGER_KEY
from muloco.elastic.authentic_quorum import AuthenticatedQuorums, signed_replica_id
from muloco.elastic.quorum import NoQuorum, QuorumGroup
from muloco.core.network import host_port
from muloco.elastic.tunnel import Gateway

TIMEOUT = timedelta(seconds=5)


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
    other_key = signed_replica_id(STRANGER_KEY, 2, "10.0.0.9:1") + ":uuid2"
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
