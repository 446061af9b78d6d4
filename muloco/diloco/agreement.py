"""What the K workers of one world (the single-world mode) must agree on outside the syncs, checked in
one exchange that every rank sees whole (so every rank decides alike): at the start, the same plan
(model, ds_config, ZeRO partitions), the same job secret and the same starting weights (or, when asked,
worker 0's taken by every worker); after a resume, the same outer and inner step and the same global
weights. Each sync checks the step and the weights again in its header (membership.py).

The elastic mode needs none of this: a member whose weights or step differ is left out of the sync and
caught up from its peers (muloco/elastic/membership.py).
"""
from __future__ import annotations

import struct
from typing import Callable

import torch

from muloco.core.errors import ConfigError, DisagreementError
from muloco.diloco.membership import StaticMembership, disagreement
from muloco.diloco.plan import plan_signature

_POSITION = "<qqd"  # outer step, inner step, digest of the rank's global weights


def _by_shard(loop, outer_step: int, step: int, digest: float, context: str
              ) -> list[tuple[list[bytes], list[tuple[int, int, float]]]]:
    """For each shard position (d, p, t), its K workers' plan signatures and positions (outer step,
    inner step, weights digest): every rank's row reaches every rank, so every rank decides alike."""
    mine = plan_signature(loop.tensors) + struct.pack(_POSITION, outer_step, step, digest)
    rows = loop.membership.gather(mine, context)
    per_worker = loop.topology.sizes.ranks_per_worker
    strangers = sorted({rank // per_worker for rank, row in enumerate(rows) if row is None})
    if strangers:
        raise ConfigError(f"worker{'s' if len(strangers) > 1 else ''} {', '.join(map(str, strangers))} failed the "
                          f"job secret's tag: every worker needs the same secret (muloco.auth.key_file or "
                          f"$MULOCO_AUTH_KEY_FILE) and job_id")
    shards = [rows[s::per_worker] for s in range(per_worker)]
    return [([row[:32] for row in shard], [struct.unpack(_POSITION, row[32:]) for row in shard]) for shard in shards]


def _first_disagreement(shards) -> str | None:
    return next((why for _, positions in shards if (why := disagreement(positions)) is not None), None)


def check_start(loop, step: int, take_worker_zeros: bool, weights_written: Callable[[], None]) -> None:
    """Before the first inner step: the same plan everywhere (ConfigError), and the same starting weights
    (DisagreementError), or worker 0's taken by every worker with `take_worker_zeros` (said once)."""
    if not isinstance(loop.membership, StaticMembership):
        return
    shards = _by_shard(loop, loop.state.outer_step, step, loop.state.digest(list(loop.state.global_weights)),
                       "the workers' first exchange")
    different = sorted({k for plans, _ in shards for k, plan in enumerate(plans) if plan != plans[0]})
    if different:
        raise ConfigError(f"workers {different} hold other parameters (names, shapes, ZeRO partitions) than worker 0: "
                          f"every worker must build the same model with the same ds_config")
    disagree = _first_disagreement(shards)
    if disagree is None:
        return
    if not take_worker_zeros:
        raise DisagreementError(f"at the start, {disagree}; seed every worker's model alike, or let every worker "
                                f"take worker 0's weights (attach(..., start='worker0'))")
    _take_worker_zeros(loop)
    weights_written()
    if loop.topology.is_logging_rank:
        print("outer loop: the workers started from different weights; every worker takes worker 0's", flush=True)


def check_resumed(loop, outer_step: int, step: int, digest: float) -> None:
    """Before a resumed worker takes its checkpoint's outer state (at `outer_step` and inner `step`, its
    global weights' `digest`): every worker resumed at the same steps with the same global weights."""
    if not isinstance(loop.membership, StaticMembership):
        return
    disagree = _first_disagreement(_by_shard(loop, outer_step, step, digest, "the workers' exchange after a resume"))
    if disagree is not None:
        raise DisagreementError(f"after the resume, {disagree}")


@torch.no_grad()
def _take_worker_zeros(loop) -> None:
    """Every tensor this rank syncs (and the global weights kept for it) := worker 0's."""
    tensors = [t.tensor for t in loop.tensors]
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tensors]) if tensors \
        else torch.empty(0, dtype=torch.uint8)
    theirs = loop.membership.from_worker_zero(flat, "worker 0's starting weights")
    offset = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        t.copy_(theirs[offset:offset + size].clone().view(t.dtype).view(t.shape).to(t.device))  # clone: aligned
        offset += size
    with loop.state.lock:
        for i, weights in loop.state.global_weights.items():
            weights.copy_(loop.tensors[i].tensor.detach())
