"""This rank's place in the fault-tolerant outer group, on torchft.

Every rank of an elastic worker runs a torchft `Manager`; the worker's local rank 0 also runs the
worker's `ManagerServer`, which heartbeats to the lighthouse and asks it for a quorum on behalf of
the worker's D x P x T ranks. A quorum is the set of workers that are alive and at the sync; the
Manager then reconfigures its gloo group so that it joins rank (d, p, t) of every worker in the
quorum (a fresh rendezvous per quorum, through a live member's store), and a worker that is behind
the others (its Manager has committed fewer syncs) receives their state from a live peer over
torchft's HTTP checkpoint transport before the sync goes on.

Why torchft and not a home-made protocol: its Rust lighthouse already does quorum with heartbeats
and join timeouts, its Manager already does peer-to-peer state transfer, reconfigurable process
groups and a per-worker commit agreement; the outer loop only decides what is averaged.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions
from torchft import Manager
from torchft.process_group import ProcessGroupGloo

from trainer.diloco.collectives import CollectiveStats, Wire
from trainer.diloco.link import SlowLink

ADVERTISE_ENV = "MULOCO_ELASTIC_HOST"  # the address peers reach this worker's servers at (default: hostname)


class QuorumWire(Wire):
    """The outer exchange (trainer.diloco.collectives.Wire) on the current quorum's gloo group: the
    rank is this worker's place in the quorum, the size the quorum's size. Valid for one quorum."""

    def __init__(self, group: ProcessGroupGloo, rank: int, size: int, link: SlowLink | None):
        self.group, self.link = group, link
        self.device = torch.device("cpu")
        self.rank, self.size = rank, size
        self.stats = CollectiveStats()

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.group.allgather_into_tensor_coalesced([output], [input], AllgatherOptions()).wait()

    def _all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                         input_sizes: list[int]) -> None:
        self.group.alltoall_base(output, input, output_sizes, input_sizes, AllToAllOptions()).wait()

    def _all_reduce(self, buffer: torch.Tensor) -> None:
        self.group.allreduce([buffer], AllreduceOptions()).wait()


class QuorumGroup:
    def __init__(self, worker: int, group_rank: int, group_size: int, lighthouse: str, sync_timeout: timedelta,
                 quorum_timeout: timedelta, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]):
        self.group = ProcessGroupGloo(timeout=sync_timeout)
        # The worker's own rendezvous store (the launcher's) carries the ManagerServer's address to
        # the worker's other ranks. init_sync=False: every worker initializes the weights from the
        # same seed, so nobody needs the first quorum's state.
        self.manager = Manager(
            pg=self.group, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
            use_async_quorum=False, init_sync=False, timeout=sync_timeout, quorum_timeout=quorum_timeout,
            connect_timeout=sync_timeout, rank=group_rank, world_size=group_size,
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse, replica_id=f"worker{worker}",
            hostname=os.environ.get(ADVERTISE_ENV, socket.gethostname()))

    def start(self) -> None:
        """Block until this worker is in a quorum (healing from a peer first if it is behind);
        raises when the quorum or the state transfer failed."""
        self.manager.start_quorum()
        if self.manager.errored() is not None:
            raise self.manager.errored().original_exception

    def wire(self, link: SlowLink | None) -> QuorumWire:
        return QuorumWire(self.group, self.manager.participating_rank(), self.manager.num_participants(), link)

    @property
    def committed_syncs(self) -> int:
        return self.manager.current_step()

    def report_error(self, exc: Exception) -> None:
        self.manager.report_error(exc)

    def commit(self) -> bool:
        """Whether every rank of this worker finished the sync without error (torchft's
        should_commit: an agreement inside the worker, not across workers)."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
