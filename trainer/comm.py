"""Process groups and the collectives run on them: the one place where tensors meet a group.

Each group has a backend, and each backend takes tensors on one kind of device: NCCL only the
accelerator's, gloo only the host's. Callers hand tensors wherever they computed them; every
collective here runs on the group's device, copying in and out only when the caller's tensor lives
elsewhere (hot paths allocate on `group_device(group)` and never copy). So no CPU tensor can reach
an NCCL group, and CPU runs (gloo everywhere) behave exactly as before.

The compute device is chosen once per process, after the launcher's local rank is known
(`init_compute_device`), from DeepSpeed's accelerator abstraction.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
# How long a collective may wait for a peer before the run fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(minutes=int(os.environ.get("MULOCO_COLLECTIVE_TIMEOUT_MIN", "10")))
_compute_device: torch.device | None = None


def init_compute_device(local_rank: int) -> torch.device:
    """Pick this process's device: accelerator `local_rank` where there is one (modulo the number of
    accelerators, so several processes may share one when their groups are on gloo), else the CPU."""
    global _compute_device
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        _compute_device = torch.device("cpu")
    else:
        index = local_rank % accelerator.device_count()
        accelerator.set_device(index)
        _compute_device = torch.device(accelerator.device_name(index))
    return _compute_device


def default_backend() -> str:
    """The backend of the default group when none is asked for: the accelerator's (NCCL), or gloo."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def compute_device() -> torch.device:
    """The device the model, optimizer state and batches live on (the CPU until chosen)."""
    return _compute_device if _compute_device is not None else torch.device("cpu")


def group_device(group=None) -> torch.device:
    """Where a collective on `group` takes its tensors: the accelerator for NCCL, else the host."""
    return compute_device() if dist.get_backend(group) == "nccl" else torch.device("cpu")


def new_group(ranks: list[int], timeout: timedelta = COLLECTIVE_TIMEOUT, backend: str | None = None):
    """Every rank must create every group, in the same order; returns the group (None if not a member
    on backends that say so). `backend=None` is the default group's (NCCL on GPUs, gloo on CPU)."""
    return dist.new_group(ranks, timeout=timeout, backend=backend)


def new_subgroups(all_ranks: list[list[int]], timeout: timedelta = COLLECTIVE_TIMEOUT, backend: str | None = None):
    """Create one group per rank list (every rank creates all of them, in order); return ours."""
    rank, mine = dist.get_rank(), None
    for ranks in all_ranks:
        group = new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine = group
    return mine


def to_compute_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the compute device (non-blocking from pinned host memory)."""
    device = compute_device()
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _run_on_group_device(group, tensors: list[torch.Tensor], collective) -> None:
    """Run `collective(*device_tensors)`; results are copied back into tensors living elsewhere."""
    device = group_device(group)
    moved = [t if t.device == device else t.to(device) for t in tensors]
    collective(*moved)
    for original, on_device in zip(tensors, moved):
        if on_device is not original:
            original.copy_(on_device)


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    _run_on_group_device(group, [tensor], lambda t: dist.all_reduce(t, op=op, group=group))
    return tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    _run_on_group_device(group, [output, input], lambda o, i: dist.all_gather_into_tensor(o, i, group=group))
    return output


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    _run_on_group_device(group, [output, input],
                         lambda o, i: dist.reduce_scatter_tensor(o, i, op=op, group=group))
    return output


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None) -> torch.Tensor:
    _run_on_group_device(group, [output, input], lambda o, i: dist.all_to_all_single(
        o, i, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group))
    return output


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`src` is a global rank."""
    _run_on_group_device(group, [tensor], lambda t: dist.broadcast(t, src=src, group=group))
    return tensor


def barrier(group=None) -> None:
    device = group_device(group)
    # NCCL's barrier is an all-reduce on a device buffer: name ours, so it is not guessed from the rank.
    dist.barrier(group=group, device_ids=[device.index]) if device.type == "cuda" else dist.barrier(group=group)
