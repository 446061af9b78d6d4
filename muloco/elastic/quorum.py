"""This rank's place in the fault-tolerant outer group, on torchft.

Every rank of an elastic worker runs a torchft `Manager`; the worker's local rank 0 also runs the
worker's `ManagerServer`, which heartbeats to the lighthouse (through an authenticated tunnel,
muloco/elastic/tunnel.py) and asks it for a quorum on behalf of the worker's D x P x T ranks. A
quorum is the set of workers that are alive and at the sync; the Manager then reconfigures its gloo
group so that it joins rank (d, p, t) of every worker in the quorum (a fresh rendezvous per quorum,
through a live member's store). With a job secret, the quorum's members are those whose replica id it
signed (muloco/elastic/authentic_quorum.py): anyone else the lighthouse let in is not in the group.

What is not torchft's here: healing. torchft would send a behind worker the state over its HTTP
transport, which unpickles what it receives (so any peer could run code in it) and listens on every
interface; here torchft heals nobody, and the elastic membership (muloco/elastic/membership.py) sends the
state itself over the quorum's group, tagged and in safetensors. The ManagerServer binds the address
the config names (its clients are this worker's own ranks).

Why torchft and not a home-made protocol: its Rust lighthouse already does quorum with heartbeats
and join timeouts, and its Manager reconfigurable process groups and a per-worker commit agreement;
the outer loop decides what is averaged and who receives what.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torchft.manager
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
from torchft import Manager
from torchft.checkpointing import CheckpointTransport
from torchft.manager import REPLICA_ID_KEY
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from muloco.core import comm
from muloco.diloco.auth import JobKey
from muloco.diloco.wire import Lanes, Wire
from muloco.diloco.link import SlowLink
from muloco.elastic.authentic_quorum import AuthenticatedQuorums, signed_replica_id
from muloco.core.network import host_port
from muloco.elastic.tunnel import Tunnel


class QuorumWire(Wire):
    """The outer exchange (muloco.diloco.wire.Wire) on the current quorum's group: the rank is this
    worker's place in the quorum, the size the quorum's size. Valid for one quorum. With `lanes` (gloo)
    the payloads go point to point on them (muloco.diloco.wire.exchange; Lanes says why)."""

    def __init__(self, group, rank: int, size: int, device: torch.device, link: SlowLink | None, key: JobKey | None,
                 lanes: Lanes | None = None):
        super().__init__(rank, size, device, link, key, channel="quorum", lanes=lanes)
        self.group = group

    def _group_all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.group.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()).wait()

    def _group_all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                               input_sizes: list[int]) -> None:
        self.group.alltoall_base(output, input, output_sizes, input_sizes, AllToAllOptions()).wait()

    def _send(self, lane, tensor: torch.Tensor, peer: int):
        return lane.send([tensor], peer, 0)

    def _receive(self, lane, tensor: torch.Tensor, peer: int):
        return lane.recv([tensor], peer, 0)


class _RemembersQuorum:
    """A torchft reconfigurable group that remembers this rank's place in the last quorum (the
    Manager's own view of it counts only the members at the highest step, and catching up is ours)."""
    quorum_id, rank_in_quorum, quorum_size = -1, 0, 0
    lanes: Lanes | None = None  # one group per direction of the payloads (gloo's, below)

    def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, *args, **kwargs) -> None:
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kwargs)
        self.quorum_id, self.rank_in_quorum, self.quorum_size = quorum_id, rank, world_size


class _QuorumGloo(_RemembersQuorum, ProcessGroupGloo):
    """With two lanes: gloo groups of the same quorum, one per direction of the payloads
    (muloco.diloco.wire.Lanes), set up with it under their own prefixes of its store."""

    def __init__(self, timeout: timedelta):
        super().__init__(timeout=timeout)
        self.lanes = Lanes(ProcessGroupGloo(timeout=timeout), ProcessGroupGloo(timeout=timeout))

    def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, *args, **kwargs) -> None:
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kwargs)
        for name, lane in (("up", self.lanes.up), ("down", self.lanes.down)):
            lane.configure(f"{store_addr}/lane_{name}", replica_id, rank, world_size, quorum_id)


class _QuorumNCCL(_RemembersQuorum, ProcessGroupNCCL):
    pass


class _NoTransport(CheckpointTransport):
    """Stands where torchft would put its HTTP transport (an all-interfaces server that unpickles what it
    receives): the outer loop moves a rejoining worker's state itself, tagged, in safetensors."""

    def metadata(self) -> str:
        return "state moves over the quorum group"

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        raise RuntimeError("elastic MuLoCo moves state over the quorum group, not torchft's transport")

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        raise RuntimeError("elastic MuLoCo moves state over the quorum group, not torchft's transport")


@contextlib.contextmanager
def _manager_server_bound_to(host: str):
    """torchft's Manager binds its ManagerServer to every interface ("[::]:port"); bind it to `host`.
    The server's clients are this worker's own ranks, so it needs to be reachable inside the
    datacenter only."""
    original = torchft.manager.ManagerServer

    def bound(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[1]
        return original(**{**kwargs, "bind": f"{host}:{port}", "hostname": host})
    torchft.manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft.manager.ManagerServer = original


class NoQuorum(Exception):
    """torchft's quorum request failed (why, in the message): the lighthouse gave this worker no quorum
    (unreachable, its transport failing, or no answer within the request's timeout). No failed attempt
    of the sync, as no quorum formed: the membership asks again."""


class QuorumGroup:
    def __init__(self, worker: int, group_rank: int, group_size: int, lighthouse: str, manager_host: str,
                 key: JobKey | None, backend: str, sync_timeout: timedelta, request_timeout: timedelta, workers: int):
        # gloo: the payload goes through host memory (a WAN); nccl: it stays on the device (a fabric).
        self.device = torch.device("cpu") if backend == "gloo" else comm.compute_device()
        self.group = (_QuorumGloo if backend == "gloo" else _QuorumNCCL)(timeout=sync_timeout)
        self.key, self.request_timeout = key, request_timeout
        # Only the worker's rank 0 talks to the lighthouse (its ManagerServer does); with a job key
        # through an authenticated tunnel, since the lighthouse admits nobody else.
        self.tunnel = Tunnel(host_port(lighthouse), key).start() if key is not None and group_rank == 0 else None
        if self.tunnel is not None:
            lighthouse = f"http://127.0.0.1:{self.tunnel.address[1]}"
        # The worker's own rendezvous store (the launcher's) carries the ManagerServer's address to
        # the worker's other ranks. init_sync=False: every worker initializes the weights from the
        # same seed, so nobody needs the first quorum's state.
        store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        replica_id = f"worker{worker}" if key is None else signed_replica_id(key, worker, store)
        with _manager_server_bound_to(manager_host):
            self.manager = Manager(
                pg=self.group, load_state_dict=None, state_dict=None, min_replica_size=1,
                use_async_quorum=False, init_sync=False, timeout=sync_timeout, quorum_timeout=request_timeout,
                connect_timeout=sync_timeout, rank=group_rank, world_size=group_size,
                store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                lighthouse_addr=lighthouse, replica_id=replica_id, hostname=manager_host,
                checkpoint_transport=_NoTransport())
        # Only members that hold the job secret count (muloco/elastic/authentic_quorum.py); the worker's
        # rank 0 names the others, once per quorum.
        self.quorums = None
        if key is not None:
            own = self.manager._store.get(REPLICA_ID_KEY).decode()  # with torchft's uuid, as the lighthouse has it
            say = (lambda line: print(line, flush=True)) if group_rank == 0 else None
            self.quorums = self.manager._client = AuthenticatedQuorums(self.manager._client, key, own, workers, say)

    def start(self) -> None:
        """Block until this worker is in a quorum. Raises NoQuorum when the request got none, and the
        group's error when the quorum formed but its group could not be set up (a peer failed). torchft
        heals nobody (allow_heal=False): the members behind, and the state they receive, are the elastic
        membership's (`everyone_current` says whether torchft counts them all at the highest committed syncs)."""
        try:
            self.manager.start_quorum(allow_heal=False)
        except (RuntimeError, TimeoutError) as exc:  # what torchft's gRPC client raises
            # torchft keeps the failed request and raises its error again from every later start_quorum and
            # should_commit: forget it, so that the next request is a fresh one.
            self.manager._quorum_future = None
            # Its manager server only logs the lighthouse's own error ("lighthouse quorum failed ... transport
            # error") and lets the request run out its timeout.
            why = (f"no answer within {self.request_timeout.total_seconds():g} s (torchft's log says why)"
                   if isinstance(exc, TimeoutError) else str(exc).split("\n", 1)[0][:300])
            raise NoQuorum(why) from exc
        if self.manager.errored() is not None:
            raise self.manager.errored().original_exception

    def everyone_current(self, size: int) -> bool:
        """Whether torchft counts every member of the quorum at the highest committed syncs. Not known
        when the quorum held members that do not count (their steps were in torchft's count)."""
        return (self.quorums is None or not self.quorums.dropped) and self.manager.num_participants() >= size

    @property
    def epoch(self) -> int:
        """The quorum's id, the same on every member: tags of an earlier quorum do not verify in this one."""
        return self.group.quorum_id

    def wire(self, link: SlowLink | None) -> QuorumWire:
        return QuorumWire(self.group, self.group.rank_in_quorum, self.group.quorum_size, self.device, link, self.key,
                          self.group.lanes)

    @property
    def committed_syncs(self) -> int:
        return self.manager.current_step()

    def set_committed_syncs(self, committed_syncs: int) -> None:
        """After loading a peer's state: count its committed syncs as ours (or one fewer than ours, to
        be caught up at the next sync)."""
        self.manager.load_state_dict({"step": committed_syncs, "batches_committed": self.manager.batches_committed()})

    def report_error(self, exc: Exception) -> None:
        self.manager.report_error(exc)

    def commit(self) -> bool:
        """Whether every rank of this worker finished the sync without error (torchft's
        should_commit: an agreement inside the worker, not across workers)."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        if self.tunnel is not None:
            self.tunnel.close()
