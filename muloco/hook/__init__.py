"""The outer loop on any DeepSpeed engine (a user's own training loop, not this project's trainer):

- workers: the world split into K workers, and the `mpu` that keeps DeepSpeed's data parallelism
  inside one worker;
- engine_shards: what the engine's inner optimizer updates on this rank (the shard the outer loop
  keeps state for), and the engines it cannot attach to;
- attach: the outer loop wrapped around the engine's `step`.

The public names are `muloco.attach` and `muloco.data_parallel_workers`.
"""
