"""DeepSpeed's own training dataloader (`deepspeed.initialize(training_data=...)`) under K workers.

DeepSpeed shards it by the `mpu`'s data-parallel rank, which for the hook is the rank inside one worker
(it must be: the same answer sizes the gradient all-reduce and names the ZeRO files), so all K workers
would read the same samples. `shard_across_workers` gives its sampler the K x D readers instead, before
the first batch is drawn, and refuses (one line saying what to do) where it cannot.
"""
from __future__ import annotations

import math

from torch.utils.data import DistributedSampler

from muloco.core.errors import ConfigError


def shard_across_workers(engine, readers: int, reader: int, per_worker: int) -> bool:
    """Give the engine's training dataloader (if DeepSpeed built one) the sampler of reader `reader` of
    `readers`; True when it changed. Its own sampler must be DeepSpeed's default of `per_worker` readers."""
    loader = getattr(engine, "training_dataloader", None)
    if loader is None or readers == per_worker:
        return False
    sampler = getattr(loader, "data_sampler", None)
    fix = (f"pass data_sampler=DistributedSampler(dataset, num_replicas=workers.data_size, rank=workers.data_rank) "
           f"(K x D = {readers} readers)")
    if getattr(loader, "curriculum_learning_enabled", False):
        raise ConfigError(f"DeepSpeed's curriculum-learning dataloader reads by the rank inside one worker, so all "
                          f"workers would read the same samples: build the dataloader yourself and {fix}")
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas == readers:
        return False  # the user's own sampler, already across the workers
    if not isinstance(sampler, DistributedSampler) or sampler.num_replicas != per_worker:
        raise ConfigError(f"DeepSpeed's training dataloader has a sampler of its own ({type(sampler).__name__}) that "
                          f"the outer loop cannot shard across the workers: {fix}")
    if getattr(loader, "data", None) is not None:
        raise ConfigError("DeepSpeed's training dataloader was iterated before attach: attach right after "
                          "deepspeed.initialize, so every worker reads its own samples from the first batch")
    loader.data_sampler = DistributedSampler(sampler.dataset, num_replicas=readers, rank=reader, shuffle=sampler.shuffle,
                                             seed=sampler.seed, drop_last=sampler.drop_last)
    batches = len(loader.data_sampler) / loader.batch_size
    loader.len = int(batches) if loader.dataloader_drop_last else math.ceil(batches)
    return True
