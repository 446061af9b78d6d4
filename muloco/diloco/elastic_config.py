"""The muloco block's "elastic" sub-block: each worker (datacenter) is its own job, and the K jobs
meet only in a fault-tolerant outer group (muloco/elastic/__init__.py).

    "muloco": {
      "workers": 3, ...,
      "sync_timeout_s": 30,           a peer that does not answer within this is dropped from the sync
      "elastic": {
        "lighthouse": "http://10.0.0.1:29510",   the torchft lighthouse; "" reads $TORCHFT_LIGHTHOUSE
        "quorum_timeout_s": 600,      the longest a worker waits at a sync for its quorum (a restarted
                                      worker waits for its peers' next sync); a lighthouse that gives it
                                      none is asked again, with backoff, until then
        "quorum_request_timeout_s": 60,  a quorum request the lighthouse has not answered by then is
                                      asked again (keep it above the lighthouse's --join-timeout-s)
        "max_attempts": 3,            attempts of one sync (each with a fresh quorum) before the job stops
        "min_workers": 2,             the smallest quorum a sync runs with (default min(2, K): no worker trains
                                      alone unless told); a smaller one is asked again until quorum_timeout_s
        "manager_host": "127.0.0.1"   the address torchft's manager server binds on the worker's rank 0 (its
                                      clients are the worker's own ranks: a worker on several nodes needs
                                      an address its other nodes reach inside the datacenter)
      }
    }
Each launch names its worker with `--worker-id k`. Across hosts, the peers dial each worker's rendezvous
store (the launcher's MASTER_ADDR, which torchft's quorum advertises) and its gloo sockets (the address its
host name resolves to, or GLOO_SOCKET_IFNAME's interface): `check_addresses` refuses loopback ones there.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from muloco.core.errors import ConfigError
from muloco.core.network import GLOO_INTERFACE_ENV, gloo_on_loopback, host_port, is_loopback
from muloco.core.typed_json import ConfigBlock, setting

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


@dataclass(frozen=True)
class ElasticConfig(ConfigBlock):
    lighthouse: str = setting("", doc=f"the torchft lighthouse, `http://HOST:PORT`; empty: ${LIGHTHOUSE_ENV}")
    quorum_timeout_s: float = setting(600.0, gt=0, doc="the longest a worker waits at a sync for its quorum (a "
                                                       "restarted worker waits for its peers' next sync); a "
                                                       "lighthouse that gives it none is asked again, with "
                                                       "backoff, until then")
    # torchft's manager server only logs a lighthouse it cannot reach: its request waits out this timeout.
    quorum_request_timeout_s: float = setting(60.0, gt=0, doc="a quorum request the lighthouse has not answered "
                                                              "by then is asked again (keep it above the "
                                                              "lighthouse's --join-timeout-s)")
    max_attempts: int = setting(3, ge=1, doc="attempts of one sync, each with a fresh quorum, before the job stops")
    # Absent: min(2, K), so that a worker whose peers never come (or all died) does not go on alone
    # unnoticed, while a job of K >= 3 survives the loss of any K - 2 workers.
    min_workers: int | None = setting(None, ge=1, doc="the smallest quorum a sync runs with (at most `workers`; "
                                                      "absent: min(2, K)); a smaller one is asked again, with "
                                                      "backoff, until quorum_timeout_s, then the job stops; 1 lets a "
                                                      "worker train alone (it says so); give the lighthouse the same "
                                                      "--min-workers")
    manager_host: str = setting("127.0.0.1", doc="the address torchft's manager server binds on the worker's rank 0 "
                                                 "(a worker on several nodes needs one its other nodes reach)")

    def smallest_quorum(self, workers: int) -> int:
        """min_workers, or its default for K workers."""
        return min(2, workers) if self.min_workers is None else self.min_workers

    def lighthouse_address(self) -> str:
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not address:
            raise ConfigError(f"elastic workers need the lighthouse's address: muloco.elastic.lighthouse or ${LIGHTHOUSE_ENV}")
        return address


def check_worker_id(worker_id: int | None, workers: int, elastic: bool) -> None:
    if elastic and worker_id is None:
        raise ConfigError("an elastic worker needs --worker-id k (0 <= k < muloco.workers)")
    if not elastic and worker_id is not None:
        raise ConfigError("--worker-id is for elastic workers (a muloco.elastic block); without one the launcher's "
                          "world holds every worker")
    if elastic and not 0 <= worker_id < workers:
        raise ConfigError(f"--worker-id {worker_id} is outside 0..{workers - 1} (muloco.workers = {workers})")


def check_addresses(elastic: ElasticConfig, backend: str, environ: Mapping[str, str] = os.environ) -> None:
    """Where the lighthouse is on another host, so are the peers: refuse an address only this host
    reaches where they (or this worker's other nodes) dial it. One ConfigError line naming the setting."""
    lighthouse = elastic.lighthouse or environ.get(LIGHTHOUSE_ENV, "")
    try:
        lighthouse_host = host_port(lighthouse)[0]
    except ValueError:
        return  # no lighthouse yet, or one that is no address: lighthouse_address() says so where it is used
    if is_loopback(lighthouse_host):
        return  # a rehearsal on one host
    where = f"the lighthouse ({lighthouse}) and the peers are on other hosts"
    store = environ.get("MASTER_ADDR", "")
    if store and is_loopback(store):
        raise ConfigError(f"MASTER_ADDR={store} is loopback, but {where} and dial this worker's rendezvous store "
                          f"there: launch with a routable master address (deepspeed --hostfile FILE --no_ssh "
                          f"--node_rank 0 --master_addr ADDR; torchrun --master-addr ADDR)")
    why = gloo_on_loopback(environ) if backend == "gloo" else None
    if why:
        raise ConfigError(f"{why}, so gloo's outer sockets would be loopback ones, but {where}: set "
                          f"{GLOO_INTERFACE_ENV} to this host's interface they reach")
    ranks, on_host = environ.get("WORLD_SIZE", "1"), environ.get("LOCAL_WORLD_SIZE", environ.get("LOCAL_SIZE", ""))
    if on_host and ranks != on_host and is_loopback(elastic.manager_host):
        raise ConfigError(f"muloco.elastic.manager_host {elastic.manager_host} is loopback, but this worker's "
                          f"{ranks} ranks span several hosts ({on_host} here), whose ranks dial it: set it to this "
                          f"host's address inside the datacenter")
