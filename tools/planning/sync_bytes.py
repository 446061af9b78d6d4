"""Bytes per outer sync: each rank's payloads as the compressor sizes them, through the collectives' accounting
(headers, verdicts and tags included)."""
from __future__ import annotations

from dataclasses import dataclass

from muloco.core.errors import ConfigError
from muloco.diloco.auth import TAG_BYTES
from muloco.diloco.compression import Compressor
from muloco.diloco.config import CompressionConfig
from muloco.diloco.membership import STATIC_HEADER_BYTES
from muloco.diloco.packing import row_split
from muloco.diloco.payload_checks import CLAIM_BYTES
from tools.planning.inputs import PlanInputs
from tools.planning.shards import ShardParam
from tools.planning.synced import WirePiece, config_of_group, hook_synced, owned_by_replica


def sync_bytes_sent(params: list[ShardParam | WirePiece], compression: CompressionConfig, collective: str,
                    workers: int, outer_rank: int, authenticated: bool = True) -> int:
    """Bytes one rank sends in one outer sync of `params` (averaging.py's accounting), the header
    (norm claim, skip-vote ballot, the worker's steps and weights digest: every rank sends it to the K-1
    others, with or without params) and, when authenticated, the tags included."""
    if workers == 1:
        return 0
    headers = (workers - 1) * (CLAIM_BYTES + STATIC_HEADER_BYTES)
    tags = (workers - 1) * TAG_BYTES if authenticated else 0

    def nbytes(p: ShardParam | WirePiece, shape) -> int:
        size = Compressor(config_of_group(compression, p.group)).payload_nbytes(shape)
        if size is None:
            raise ConfigError("zstd payload sizes depend on the data; plan without zstd")
        return size

    if collective == "all_gather":
        return (workers - 1) * sum(nbytes(p, p.wire_shape) for p in params) + headers + tags
    chunk = [0] * workers  # S_j: bytes of row chunk j over all tensors
    for p in params:
        rows, cols = p.wire_shape
        for j, count in enumerate(row_split(rows, workers)):
            chunk[j] += nbytes(p, (count, cols))
    verdicts = workers + CLAIM_BYTES  # ahead of each owner's re-quantized chunk
    return (sum(s for j, s in enumerate(chunk) if j != outer_rank) + (workers - 1) * (max(chunk) + verdicts)
            + headers + 2 * tags)


@dataclass
class SyncBytes:
    per_rank_max: int  # the busiest rank
    per_rank_mean: float  # what the trainer logs as bytes_sent_per_rank
    per_worker: int  # all ranks of one datacenter together (mean over workers)
    uncompressed_per_rank_max: int  # the same sync without compression, for the ratio


def outer_sync_bytes(stages: list[list[ShardParam]], inputs: PlanInputs) -> SyncBytes:
    K, D = inputs.sizes.workers, inputs.sizes.data
    synced = [[owned_by_replica(stage, D, d) if inputs.hook_zero is None else hook_synced(stage, inputs.hook_zero, D, d)
               for d in range(D)] for stage in stages]

    def per_rank(compression: CompressionConfig) -> list[int]:
        # TP ranks of a stage hold identically shaped shards, so stage 0's TP rank 0 stands for all T.
        return [sync_bytes_sent(params, compression, inputs.muloco.collective, K, k, inputs.authenticated)
                for k in range(K) for stage in synced for params in stage]

    sent = per_rank(inputs.compression)
    raw = per_rank(CompressionConfig("none"))
    total = sum(sent) * inputs.sizes.tensor  # over every rank of the world
    return SyncBytes(max(sent), total / inputs.sizes.world, round(total / inputs.sizes.workers), max(raw))
