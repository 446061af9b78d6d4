"""Shims that let megatron-core run on CPU with gloo; applied only when no accelerator exists.

megatron-core assumes CUDA in the places we reach: it allocates buffers on
`torch.cuda.current_device()`, builds the default causal mask and the pipeline schedules' token
counters on "cuda", synchronizes CUDA after pipeline sends, and its RNG tracker forks CUDA generator
states. On CPU we point those at the CPU and give the tracker CPU generator states with the same
fork semantics.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch

_applied = False


def accelerator_present() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() != "cpu"


class CpuRNGStatesTracker:
    """Megatron's tracker API (add/fork/get_states/set_states) over CPU generator states."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@functools.lru_cache(maxsize=8)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _TorchOnCpu(types.ModuleType):
    """`torch` as seen by a module that hard-codes device="cuda": such tensors are made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def megatron_device() -> torch.device:
    """The device megatron-core allocates its own buffers on (RoPE's frequencies, masks): the current
    CUDA device where an accelerator exists, the CPU under the shims. A model built elsewhere must run there."""
    apply_cpu_shims_if_needed()
    return torch.device(torch.cuda.current_device())


def apply_cpu_shims_if_needed() -> bool:
    """Install the shims once when running without an accelerator; return whether they are active."""
    global _applied
    if _applied:
        return True
    if accelerator_present():
        return False
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils

    torch.cuda.current_device = lambda: torch.device("cpu")  # buffers Megatron allocates land on CPU
    torch.cuda.manual_seed = lambda seed: None  # no CUDA generator to seed
    torch.cuda.synchronize = lambda device=None: None  # CPU collectives are synchronous
    schedules.torch = _TorchOnCpu("torch")
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random._CUDA_RNG_STATE_TRACKER = None  # rebuilt from the class above on next use
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask  # imported by name there
    _applied = True
    return True
