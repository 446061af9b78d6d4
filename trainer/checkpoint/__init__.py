"""Checkpoints: every rank writes its own shard; resumes are exact; other layouts are resharded.

The on-disk format (safetensors rank files plus JSON; nothing is pickled), the integrity checks,
retention and the handling of a full or read-only disk are described in
trainer/checkpoint/format.py, and the rank file itself in muloco/core/rank_file.py.

Loading (`--load DIR`) resumes from `latest`. Same layout: every rank reads its own file and the
run continues bit for bit. Different T, P or D (same K): model weights and the inner optimizer's
state (elementwise, so cut like its parameter) are merged and re-cut with the shared TP sharding
rules (trainer/model/sharding.py); RNG states are then re-seeded. A different K, model shape or
vocabulary, or a layout change with state that cannot be resharded (the MuLoCo outer loop's), stops
with a message naming the difference.

`--load DIR --load-worker W` is a start, not a resume: this run takes worker W's weights, inner
optimizer state and step from a checkpoint written with any K (and layout, resharded as above), with
its own lr, weight decay and schedule at that step, without the outer loop's state or RNG states. A
run with an outer loop builds it after the load, so it starts at the loaded weights with zero
momentum (K workers branching from a data-parallel state, as tools/compare/alignment.py needs).
"""
from muloco.core.errors import CheckpointError
from trainer.checkpoint.format import CheckpointMeta, CheckpointReader, latest_iteration

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMeta", "CheckpointReader", "latest_iteration"]


def __getattr__(name: str):
    # The checkpointer imports Megatron and DeepSpeed: the readers of checkpoints (the converter, the planner, a
    # run's checks before it starts) import this package without paying for them.
    if name != "Checkpointer":
        raise AttributeError(f"module 'trainer.checkpoint' has no attribute {name!r}")
    from trainer.checkpoint.checkpointer import Checkpointer

    return Checkpointer
