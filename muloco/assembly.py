"""The outer loop assembled for a host, one way for every host (this project's trainer and the
DeepSpeed hook): the job secret, the membership (the single world's K workers, or the elastic job's
torchft quorum), the loop, and the checks every worker runs with its peers before the first inner step
(muloco/diloco/agreement.py: the same plan and job secret, the same starting weights)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from muloco.core.topology import Topology
from muloco.diloco.agreement import check_start
from muloco.diloco.auth import job_key
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.membership import StaticMembership
from muloco.diloco.outer_loop import OuterLoop
from muloco.diloco.plan import SyncedTensor


def assemble_outer_loop(config: MuLoCoConfig, tensors: list[SyncedTensor], topology: Topology,
                        log: Callable[[dict, int], None], *, key_file: Path | None, step: int,
                        replicated: bool = True, worker_id: int | None = None, take_worker_zeros: bool = False,
                        weights_written: Callable[[], None] = lambda: None) -> OuterLoop:
    """Every rank calls it, at inner step `step`. `key_file`: the job secret's (None: the workers do not
    talk, or auth is off). An elastic job is worker `worker_id` (its topology already says so)."""
    key = job_key(key_file, config.auth.job_id if key_file else "", config.talks, topology.is_logging_rank)
    if config.elastic is not None:
        from muloco.elastic.membership import QuorumMembership  # only elastic runs import torchft

        membership = QuorumMembership(config, topology, key, worker_id)
    else:
        membership = StaticMembership(config, topology, key)
    loop = OuterLoop(config, tensors, topology, log, membership, replicated, key=key)
    try:
        check_start(loop, step, take_worker_zeros, weights_written)
    except BaseException:
        loop.close()
        raise
    return loop
