"""The parameters one TP rank of each pipeline stage holds, read off Megatron's GPTModel built on the meta device in
one process that joins a fake T x P world, so that Megatron's own layers decide the shard shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from muloco.diloco.compression import compression_group, rows_shape
from trainer.config import check_model_shape
from trainer.model.presets import ModelShape
from trainer.model.sharding import sharding_of


@dataclass(frozen=True)
class ShardParam:
    """One parameter as one TP rank of one pipeline stage holds it."""
    name: str
    shape: tuple[int, ...]
    tensor_parallel: bool  # split across TP ranks (False: replicated, e.g. norms)
    transposed_on_wire: bool  # row-parallel weights are compressed by columns
    embedding_or_output: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def group(self) -> str:
        return compression_group(self.shape, self.embedding_or_output)

    @property
    def wire_shape(self) -> tuple[int, int]:
        """(rows, columns) as compressed: row-parallel weights by columns."""
        return rows_shape((self.shape[1], self.shape[0]) if self.transposed_on_wire else self.shape)

    @property
    def muon(self) -> bool:
        """Routed to Muon when the inner optimizer is Muon (trainer.optim.routing's rule)."""
        return len(self.shape) == 2 and not self.embedding_or_output


def build_stage_shards(shape: ModelShape, vocab_size: int, tensor: int, pipeline: int) -> list[list[ShardParam]]:
    """Parameters of TP rank 0 of every pipeline stage, from Megatron's GPTModel built on meta."""
    # Imported here: megatron-core and the fake backend are only needed for building.
    from megatron.core import parallel_state as mps
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from megatron_patches import apply_cpu_shims_if_needed
    from trainer.model.builder import build_model, padded_vocab_size

    check_model_shape(shape, tensor, pipeline)
    vocab = padded_vocab_size(vocab_size, tensor)
    apply_cpu_shims_if_needed()
    stages = []
    for stage in range(pipeline):
        # A single process cannot join a real T x P world; the fake backend lets it be any rank.
        dist.init_process_group("fake", rank=stage * tensor, world_size=tensor * pipeline, store=FakeStore())
        try:
            mps.initialize_model_parallel(tensor, pipeline, order="tp-pp-dp", create_gloo_process_groups=False)
            with torch.device("meta"):
                model = build_model(shape, vocab)
            stages.append([ShardParam(name, tuple(p.shape), sharding_of(name).partition_dim is not None,
                                      sharding_of(name).partition_dim == 1,
                                      name.endswith(("word_embeddings.weight", "output_layer.weight")))
                           for name, p in model.named_parameters()])
        finally:
            mps.destroy_model_parallel()
            dist.destroy_process_group()
    return stages


def parameter_count(stages: list[list[ShardParam]], tensor: int) -> int:
    """Global count: TP-split parameters times T, replicated ones once."""
    return sum(p.numel * (tensor if p.tensor_parallel else 1) for stage in stages for p in stage)
