"""One rank of a K-rank torchrun launch on CPU as one whole worker of a preset's real model (T = P =
D = 1): what benchmarks/outer_sync_bytes.py and benchmarks/outer_auth_overhead.py sync."""
from __future__ import annotations

from datetime import timedelta

TIMEOUT = timedelta(minutes=10)


def worker_model(model: str, vocab_size: int):
    """(model, topology, shape) after init_process_group("gloo") and Megatron's groups."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_cpu_shims_if_needed, initialize_megatron_groups
    from trainer.model.builder import build_model, initialize_weights, padded_vocab_size
    from trainer.model.presets import PRESETS
    from muloco.core.topology import ParallelSizes, build_topology

    dist.init_process_group("gloo", timeout=TIMEOUT)
    apply_cpu_shims_if_needed()
    topology = build_topology(ParallelSizes(dist.get_world_size(), 1, 1, 1), TIMEOUT)
    initialize_megatron_groups(topology, TIMEOUT)
    model_parallel_cuda_manual_seed(0)
    shape = PRESETS[model]
    built = build_model(shape, padded_vocab_size(vocab_size, 1))
    initialize_weights(built, shape, seed=0)
    return built, topology, shape
