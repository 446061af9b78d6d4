"""The real tiny Megatron model in a single-process world, built inside a test."""
from __future__ import annotations

from contextlib import contextmanager

from tools.trainer_runs import TINY_VOCAB


@contextmanager
def megatron_world_of_one(seed: int = 1234):
    """A single-process gloo world with Megatron's groups (T = P = D = 1) and the CPU shims, for
    building the real model inside a test."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_cpu_shims_if_needed

    apply_cpu_shims_if_needed()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        mps.destroy_model_parallel()
        dist.destroy_process_group()


def tiny_model(seed: int = 1234):
    """The tiny preset's GPTModel with the trainer's initial weights (inside megatron_world_of_one)."""
    from trainer.model.builder import build_model, initialize_weights, padded_vocab_size
    from trainer.model.presets import PRESETS

    model = build_model(PRESETS["tiny"], padded_vocab_size(TINY_VOCAB, 1))
    initialize_weights(model, PRESETS["tiny"], seed)
    return model
