"""DeepSpeed's Muon runs its Newton-Schulz iteration in half precision wherever the CPU offers it
(deepspeed/runtime/zero/muon/original_muon.py `ns_compute_dtype`: fp16 for the default "gram" form
where oneDNN has fp16, as on CPUs with AVX512-FP16 or AMX; bf16 for "standard"), and in fp32
elsewhere. In half precision the last-bit differences of ZeRO 1/2's gradient reduction order against
a plain sum grow to ~4e-3 of the weights in 9 steps: as large as the wrong outer step an exactness
test must catch, and only on some machines. The tests that hold DeepSpeed's Muon to a reference run
Newton-Schulz in fp32, in the reference and in every launched rank alike."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def newton_schulz_in_fp32() -> Iterator[None]:
    """DeepSpeed's Newton-Schulz in fp32 within the block, on any CPU (its iterations look the dtype up
    in their module when they run or are compiled)."""
    from deepspeed.runtime.zero.muon import original_muon

    chosen = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    try:
        yield
    finally:
        original_muon.ns_compute_dtype = chosen
