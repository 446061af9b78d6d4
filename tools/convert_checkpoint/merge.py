"""Full (T=1) weights of a checkpoint, streamed by canonical name one pipeline stage at a time, so
memory holds one stage's memory-mapped rank files and one merged tensor."""
from __future__ import annotations

from typing import Iterator

import torch

from trainer.checkpoint import CheckpointReader

EXPORTED_WORKER, EXPORTED_REPLICA = 0, 0  # after an outer sync every worker and replica holds the same weights


def full_weights(reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
    for stage in range(reader.meta.sizes.pipeline):
        ranks = reader.stage_ranks(EXPORTED_WORKER, EXPORTED_REPLICA, stage)
        for name in reader.rank_state(ranks[0])["model"]:
            yield name, reader.full_tensor(ranks, name, lambda s: s["model"][name])
        for rank in ranks:
            reader.close(rank)


def recorded_probe(reader: CheckpointReader) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [1, L], logits [1, L, vocab]) the sharded training model produced when it saved."""
    last = reader.meta.sizes.pipeline - 1
    probes = [reader.rank_state(r)["probe"] for r in reader.stage_ranks(EXPORTED_WORKER, EXPORTED_REPLICA, last)]
    # The output layer is vocabulary-parallel: TP ranks hold consecutive slices of the logits.
    logits = torch.cat([p["logits"] for p in probes], dim=-1)[..., :reader.meta.vocab_size]
    return probes[0]["tokens"], logits
