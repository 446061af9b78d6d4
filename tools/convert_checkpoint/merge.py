"""Full (T=1) weights of a checkpoint, streamed by canonical name one pipeline stage at a time, so
memory holds one stage's memory-mapped rank files and one merged tensor.

Which weights: a MuLoCo/DiLoCo checkpoint holds the outer loop's global weights (the same on every
worker, each inner-DP replica holding the shards it owns) and each worker's own weights, which equal
the global ones only when it was saved right after a sync (meta.json's `workers_hold_one_model`). An
export takes the global weights unless asked for one worker's; a checkpoint without an outer loop
(data parallel, an import) holds one model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from trainer.checkpoint import CheckpointError, CheckpointReader
from muloco.core.errors import ConfigError
from trainer.model.sharding import sharding_of, unshard

REPLICA = 0  # inner-DP replicas of a worker hold the same weights


@dataclass(frozen=True)
class WeightSource:
    worker: int | None  # None: the outer loop's global weights
    workers_hold_one_model: bool | None  # as the checkpoint recorded it (None: not recorded)

    @classmethod
    def of(cls, reader: CheckpointReader, worker: int | None) -> "WeightSource":
        """The global weights (worker None) where the checkpoint has an outer loop, else its one model;
        or worker k's own weights."""
        workers = reader.meta.sizes.workers
        if worker is not None and not 0 <= worker < workers:
            raise ConfigError(f"--worker {worker}: {reader.directory} holds workers 0..{workers - 1}")
        has_global = "muloco" in reader.meta.extra_state
        one_model = True if reader.meta.weights_only else reader.meta.workers_hold_one_model
        return cls(None if worker is None and has_global else (worker or 0), one_model)

    def describe(self) -> str:
        held = {True: "the workers held one model", False: "the workers held different models (saved between "
                "outer syncs)", None: "not recorded whether the workers held one model"}[self.workers_hold_one_model]
        what = "the global (outer) weights" if self.worker is None else f"worker {self.worker}'s weights"
        return f"{what}; {held}"

    def metadata(self, step: int) -> dict:
        """What an exported config.json records about its weights."""
        return {"weights": "global" if self.worker is None else f"worker {self.worker}", "step": step,
                "workers_hold_one_model": self.workers_hold_one_model}

    @property
    def probe_worker(self) -> int | None:
        """The worker whose recorded probe logits these weights must reproduce; None when no probe was
        recorded from them (the global weights while the workers held other ones)."""
        if self.worker is not None:
            return self.worker
        return 0 if self.workers_hold_one_model else None


def full_weights(reader: CheckpointReader, source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    sizes = reader.meta.sizes
    worker = 0 if source.worker is None else source.worker
    for stage in range(sizes.pipeline):
        replicas = [reader.stage_ranks(worker, d, stage) for d in range(sizes.data)]
        for name in reader.rank_state(replicas[REPLICA][0])["model"]:
            if source.worker is None:
                shards = [_global_shard(reader, [ranks[t] for ranks in replicas], name) for t in range(sizes.tensor)]
                yield name, unshard(shards, sharding_of(name))
            else:
                yield name, reader.full_tensor(replicas[REPLICA], name, lambda s: s["model"][name])
        for rank in {r for ranks in replicas for r in ranks}:
            reader.close(rank)


def _global_shard(reader: CheckpointReader, replica_ranks: list[int], name: str) -> torch.Tensor:
    """One TP shard of parameter `name`'s global weights, from the inner-DP replica that owns it."""
    for rank in replica_ranks:
        owned = reader.rank_state(rank)["extra"]["muloco"]["global_weights"]
        if name in owned:
            return owned[name]
    raise CheckpointError(f"{reader.directory}: no rank of {replica_ranks} holds the global weights of {name}")


def recorded_probe(reader: CheckpointReader, worker: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [1, L], logits [1, L, vocab]) the sharded training model of `worker` produced when it saved."""
    last = reader.meta.sizes.pipeline - 1
    probes = [reader.rank_state(r)["probe"] for r in reader.stage_ranks(worker, REPLICA, last)]
    # The output layer is vocabulary-parallel: TP ranks hold consecutive slices of the logits.
    logits = torch.cat([p["logits"] for p in probes], dim=-1)[..., :reader.meta.vocab_size]
    return probes[0]["tokens"], logits
