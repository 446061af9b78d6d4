"""Checkpoints: every rank writes its own shard; resumes are exact; other layouts are resharded.

On-disk format (`--save DIR`):

    DIR/latest                       text: the step of the newest complete checkpoint
    DIR/iter_{step:07d}/
        rank_{global_rank:05d}.pt    one per rank (torch.save dict, see below)
        meta.json                    rank 0: sizes K/D/P/T, model shape, vocab (padded and not),
                                     the rank -> (worker, data, pipeline, tensor) map, resolved config
        tokenizer.model              rank 0: copy of --tokenizer-model, when one was used
        complete                     rank 0, after every rank's file is durable

A rank file holds, under canonical parameter names (global layer indices, same at every P):
`model` (this rank's TP shard), `optimizer` (hyperparameters per param group and per-parameter
state), `scheduler` (the lr scheduler's state_dict), `engine` (DeepSpeed's step/sample counters),
`step`, `rng` (python, numpy, torch, accelerator, Megatron's RNG tracker), `extra` (each
`trainer.extra_state` component's state_dict, e.g. the MuLoCo outer loop) and, on last-stage ranks,
`probe`: token ids and this shard's logits of the training model, the reference that the Hugging
Face exporter's `--verify` checks the merged weights against.

Publishing is atomic: each rank writes to a temporary name, fsyncs and renames; after a barrier rank
0 writes `meta.json`, then `complete`, then moves `latest` by rename. A crash mid-save leaves the
previous checkpoint and `latest` untouched; the next save removes incomplete iterations and
temporary files.

Loading (`--load DIR`) resumes from `latest`. Same layout: every rank reads its own file and the
run continues bit for bit. Different T, P or D (same K): model weights and the inner optimizer's
state (elementwise, so laid out like its parameter) are merged and re-cut with the shared TP layout
mapping; RNG states are then re-seeded. A different K, model shape or vocabulary, or a layout change
with state that cannot be resharded (the MuLoCo outer loop's), stops with a message naming the
difference.
"""
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.format import CheckpointError, CheckpointMeta, CheckpointReader, latest_iteration

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMeta", "CheckpointReader", "latest_iteration"]
