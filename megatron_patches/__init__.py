"""Everything that adapts megatron-core to this trainer.

- `cpu`: shims that let megatron-core run without an accelerator (buffer device, RNG tracker), and
  the device megatron-core allocates its own buffers on.
- `parallel_state`: Megatron's groups for our K x D x P x T topology, with Megatron's "data
  parallel" narrowed to the inner DP group of one worker.
"""
from megatron_patches.cpu import apply_cpu_shims_if_needed, megatron_device
from megatron_patches.parallel_state import DeepSpeedMpu, initialize_megatron_groups

__all__ = ["DeepSpeedMpu", "apply_cpu_shims_if_needed", "initialize_megatron_groups", "megatron_device"]
