"""Which members of torchft's quorum count: those whose replica id the job secret signed.

The gateway (muloco/elastic/tunnel.py) keeps strangers off the lighthouse's public port, but torchft's
lighthouse itself listens on its host's loopback without authentication (torchft 0.2.0 binds it to a TCP
address only), so any process on that host can ask it for quorums and be in every one. A member that
then sends nothing made every attempt's group fail to form, and the job stopped after max_attempts.

So each worker's replica id carries a tag under the job secret over its worker id, a fresh nonce and
the address of its rendezvous store: `worker{k}:{nonce}:{tag}@{store}/{k}`, to which torchft appends
`:{uuid}` (torchft reads a worker's place from the digits ending its id, and those of its first field). Every quorum result torchft's manager server hands this rank passes through
`AuthenticatedQuorums`, which keeps the members whose tag verifies and drops the rest before torchft
configures the group: the group, its rank and size, and the store its members meet at (one of
theirs, never a stranger's) are those of the signed members alone. A stranger in the lighthouse's
quorum thus costs no attempt at all, only, while it is in, the membership's check of who is behind
(torchft's count of the members at the highest step included the stranger's claim). One that copies a signed id it has seen (the lighthouse shows
every member the others' ids) makes that worker id appear twice: both copies are dropped, so the
copied worker sits those quorums out (its request gets no quorum and is asked again, until
quorum_timeout_s) while its peers go on. A member signed as a worker outside the job's K (a job sharing
the secret with another K) is left out too. The worker's rank 0 names the members it left out in one
line per quorum: the lighthouse's own network (muloco/elastic/private_network.py) keeps strangers off
torchft's port, and where the kernel refused one, this line is where they show.
"""
from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Callable

from muloco.diloco.auth import JobKey

_NONCE_HEX = 16
_TAG_HEX = 32
_SHOWN_ID_CHARS = 64  # of a stranger's replica id in a log line (it chose the id: any length, any characters)
_SHOWN_MEMBERS = 8  # named in the line; the rest counted


def _tag(key: JobKey, name: str, nonce: str, store: str) -> str:
    return key.mac(b"quorum member", name.encode(), nonce.encode(), store.encode()).hex()[:_TAG_HEX]


def signed_replica_id(key: JobKey, worker: int, store: str) -> str:
    """The replica id a worker gives torchft (which appends `:{uuid}`); its leading `worker{k}` is what
    torchft reads the worker's place from."""
    name, nonce = f"worker{worker}", secrets.token_hex(_NONCE_HEX // 2)
    return f"{name}:{nonce}:{_tag(key, name, nonce, store)}@{store}/{worker}"


@dataclass(frozen=True)
class SignedMember:
    worker: str  # "worker{k}"
    store: str  # HOST:PORT of its rendezvous store


def verify(key: JobKey, replica_id: str) -> SignedMember | None:
    """The member a replica id names when its tag verifies, else None."""
    head, _, _uuid = replica_id.rpartition(":")
    claim, at, place = head.partition("@")
    store, _, worker = place.rpartition("/")
    parts = claim.split(":")
    if not at or len(parts) != 3 or parts[0] != f"worker{worker}":
        return None
    name, nonce, tag = parts
    if not hmac.compare_digest(tag, _tag(key, name, nonce, store)):
        return None
    return SignedMember(name, store)


@dataclass(frozen=True)
class FilteredQuorum:
    """What torchft's Manager reads of a quorum result (a torchft QuorumResult), for the signed members only."""
    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    replica_ids: list[str]


class AuthenticatedQuorums:
    """Stands in for torchft's ManagerClient (the Manager's `_client`): its quorum results hold only the
    signed members of this job's `workers` workers. `dropped` is how many members the last result left
    out; `say` (the worker's rank 0 passes one) gets one line per quorum naming them."""

    def __init__(self, client, key: JobKey, own_replica_id: str, workers: int,
                 say: Callable[[str], None] | None = None):
        self._client, self._key, self._own, self._workers, self._say = client, key, own_replica_id, workers, say
        self.dropped = 0
        self._said_quorum: int | None = None

    def __getattr__(self, name):  # should_commit, _checkpoint_metadata: torchft's own
        return getattr(self._client, name)

    def _why_left_out(self, member: SignedMember | None, names: list[str]) -> str | None:
        """Why a quorum member does not count (None: it does), given the worker names signed in the quorum."""
        if member is None:
            return "not signed by the job secret"
        if member.worker not in {f"worker{k}" for k in range(self._workers)}:
            return f"signed as {member.worker}, not one of this job's workers 0..{self._workers - 1}"
        if names.count(member.worker) > 1:
            return f"one of {names.count(member.worker)} members signed as {member.worker} (a copied id)"
        return None

    def _quorum(self, group_rank: int, *args, **kwargs):
        result = self._client._quorum(group_rank, *args, **kwargs)
        signed = {rid: verify(self._key, rid) for rid in result.replica_ids}
        names = [m.worker for m in signed.values() if m is not None]
        why_not = {rid: self._why_left_out(m, names) for rid, m in signed.items()}
        kept = [rid for rid in result.replica_ids if why_not[rid] is None]
        self.dropped = len(result.replica_ids) - len(kept)
        if not self.dropped:
            return result
        self._name_strangers(result.quorum_id, {rid: why for rid, why in why_not.items() if why is not None})
        if self._own not in kept:
            raise RuntimeError(f"quorum {result.quorum_id} holds another member signed as this worker (a copy of its "
                               f"replica id): this worker sits it out")
        rank = kept.index(self._own)
        # torchft's counts of members at the highest step included the dropped ones: count every signed
        # member as current (so that the worker can commit) and let the membership find who is behind.
        return FilteredQuorum(
            quorum_id=result.quorum_id, replica_rank=rank, replica_world_size=len(kept),
            recover_src_manager_address="", recover_src_replica_rank=None, recover_dst_replica_ranks=[],
            store_address=signed[kept[group_rank % len(kept)]].store, max_step=result.max_step,
            max_replica_rank=rank, max_world_size=len(kept), heal=False, replica_ids=kept)

    def _name_strangers(self, quorum_id: int, strangers: dict[str, str]) -> None:
        """One line per quorum (torchft asks again within one, on a retry) naming the members left out."""
        if self._say is None or quorum_id == self._said_quorum:
            return
        self._said_quorum = quorum_id
        own = verify(self._key, self._own)
        shown = "; ".join(f"{_shown(rid)} ({why})" for rid, why in list(strangers.items())[:_SHOWN_MEMBERS])
        if len(strangers) > _SHOWN_MEMBERS:
            shown += f"; and {len(strangers) - _SHOWN_MEMBERS} more"
        self._say(f"worker {own.worker.removeprefix('worker')}: quorum {quorum_id} holds {len(strangers)} member(s) "
                  f"not among this job's {self._workers} workers, left out: {shown}")


def _shown(replica_id: str) -> str:
    """A replica id as a log line can hold it: printable ASCII, cut short."""
    cut = replica_id[:_SHOWN_ID_CHARS]
    return ascii(cut)[1:-1] + ("..." if len(replica_id) > _SHOWN_ID_CHARS else "")
