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

import errno
import inspect
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from muloco.core.errors import ConfigError

ReduceOp = dist.ReduceOp
# How long a collective may wait for a peer before the run fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(minutes=int(os.environ.get("MULOCO_COLLECTIVE_TIMEOUT_MIN", "10")))
_compute_device: torch.device | None = None


def init_compute_device(local_rank: int) -> torch.device:
    """Pick this process's device: accelerator `local_rank` where there is one (modulo the number of
    accelerators, so several processes may share one when their groups are on gloo), else the CPU.
    DeepSpeed takes LOCAL_RANK for the device index (its engine calls set_device(LOCAL_RANK)), so
    where the two differ LOCAL_RANK is rewritten to the device this process uses."""
    global _compute_device
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        _compute_device = torch.device("cpu")
    else:
        index = local_rank % accelerator.device_count()
        accelerator.set_device(index)
        _compute_device = torch.device(accelerator.device_name(index))
        os.environ["LOCAL_RANK"] = str(index)
    return _compute_device


def default_group_options(backend: str, world_size: int) -> dict:
    """init_process_group's device binding: NCCL's communicator is bound to this process's device (an
    eager connect, as DeepSpeed does; none for a world of one, which has no peer); a gloo group is
    bound to no device (its collectives take host tensors; DeepSpeed would bind it to cuda:LOCAL_RANK)."""
    return {"device_id": compute_device()} if backend == "nccl" and world_size > 1 else {}


# Variables by which an MPI launcher or a cloud runner tells DeepSpeed's own discovery the job's ranks.
_DISCOVERED_LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "AZUREML_EXPERIMENT_ID")


def one_rank_without_launcher(environ=os.environ) -> bool:
    """A process started without any launcher (`python trainer/pretrain.py ...`) becomes the one rank of
    a world of one, as `torchrun --nproc-per-node 1` would set it up (a free local port for the
    rendezvous): without this DeepSpeed falls back to MPI discovery and fails on a missing mpi4py.
    Whether it did; a launched rank, or one an MPI launcher started, is left alone."""
    if "RANK" in environ or "WORLD_SIZE" in environ or any(key in environ for key in _DISCOVERED_LAUNCHERS):
        return False
    import socket

    with socket.socket() as probe:  # the OS picks a free port; the rendezvous binds it right after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return True


def init_distributed(backend: str) -> None:
    """The default process group (env:// rendezvous, as the deepspeed and torchrun launchers set it up)
    on this process's device, then DeepSpeed's communication layer over it (its shared-memory file
    already unlinked: `remove_host_allreduce_buffer`). Without a launcher's
    variables (mpirun, AzureML) DeepSpeed's own discovery makes the group."""
    import deepspeed

    launched = all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if launched and not dist.is_initialized():
        check_rendezvous_port()
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT,
                                **default_group_options(backend, int(os.environ.get("WORLD_SIZE", "1"))))
    deepspeed.init_distributed(dist_backend=backend, timeout=COLLECTIVE_TIMEOUT)
    remove_host_allreduce_buffer()


def check_rendezvous_port() -> None:
    """Rank 0 hosts the job's rendezvous store on MASTER_PORT (unless torchrun's agent does): a port
    another job holds (two jobs on one host, both on the launcher's default 29500) is one configuration
    line, not a traceback on one job while the other trains alone."""
    if os.environ["RANK"] != "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    port = int(os.environ["MASTER_PORT"])
    try:
        socket.create_server(("", port)).close()  # where the store listens: every interface, SO_REUSEADDR
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            return  # anything else is the store's own error to report
        raise ConfigError(f"the rendezvous port {port} (MASTER_PORT, the launcher's --master_port) is already in use "
                          f"on this host: another job holds it; give each job on one host its own --master_port") from err


def close_distributed() -> None:
    """After the run, every rank together: destroy the process groups while the interpreter is whole.
    Left to the interpreter's exit, their C++ threads (gloo's, the store's) may be destroyed still
    running, which aborts a rank whose work is done ("terminate called without an active exception")."""
    if dist.is_initialized():
        barrier()  # no rank tears down a group a peer still uses
        dist.destroy_process_group()


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


class Pending:
    """The handle of an async collective: `wait()` blocks until it is done and then copies results
    back into caller tensors that live off the group's device."""

    def __init__(self, work, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self._work, self._copies = work, copies

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        for original, on_device in self._copies:
            original.copy_(on_device)


def _run_on_group_device(group, tensors: list[torch.Tensor], collective, async_op: bool = False) -> Pending | None:
    """Run `collective(*device_tensors)` (which returns a work handle when `async_op`); results are
    copied back into tensors living elsewhere, at once or when the returned handle is waited on."""
    device = group_device(group)
    moved = [t if t.device == device else t.to(device) for t in tensors]
    work = collective(*moved)
    pending = Pending(work if async_op else None,
                      [(o, d) for o, d in zip(tensors, moved) if d is not o])
    if async_op:
        return pending
    pending.wait()
    return None


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    _run_on_group_device(group, [tensor], lambda t: dist.all_reduce(t, op=op, group=group))
    return tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False) -> torch.Tensor | Pending:
    """`input` may be this rank's slot of `output` (in place). With `async_op`, returns a Pending."""
    pending = _run_on_group_device(
        group, [output, input], lambda o, i: dist.all_gather_into_tensor(o, i, group=group, async_op=async_op),
        async_op)
    return pending if async_op else output


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None, op=ReduceOp.SUM) -> torch.Tensor:
    _run_on_group_device(group, [output, input],
                         lambda o, i: dist.reduce_scatter_tensor(o, i, op=op, group=group))
    return output


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None,
                      async_op: bool = False) -> torch.Tensor | Pending:
    """Uneven splits allowed (element counts along dim 0). With `async_op`, returns a Pending."""
    pending = _run_on_group_device(group, [output, input], lambda o, i: dist.all_to_all_single(
        o, i, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group,
        async_op=async_op), async_op)
    return pending if async_op else output


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`src` is a global rank."""
    _run_on_group_device(group, [tensor], lambda t: dist.broadcast(t, src=src, group=group))
    return tensor


def barrier(group=None) -> None:
    device = group_device(group)
    # NCCL's barrier is an all-reduce on a device buffer: name ours, so it is not guessed from the rank.
    dist.barrier(group=group, device_ids=[device.index]) if device.type == "cuda" else dist.barrier(group=group)


def remove_host_allreduce_buffer() -> None:
    """DeepSpeed's CPU all-reduce backs each rank's workspace with a /dev/shm file (~70 MB) that it
    never unlinks, so every CPU run would leave its ranks' files behind, killed runs included. Every
    rank maps every peer's file while DeepSpeed initializes, so once all ranks are past that (the
    barrier) each removes its own name: the mappings stay valid, and no exit path leaves a file."""
    if compute_device().type != "cpu" or not dist.is_initialized():
        return
    barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{dist.get_rank()}")
    Path("/dev/shm", name).unlink(missing_ok=True)


# -- counting bytes (benchmarks and tests only: nothing is counted outside this context) ----------

def bytes_sent(collective: str, arguments: dict) -> int:
    """Bytes that leave this rank in one call of `collective` with these (bound) arguments, for the
    bandwidth-optimal algorithms over g ranks: ring all-reduce 2(g-1)/g n; all-gather (g-1) n_input;
    reduce-scatter (g-1)/g n_input; all-to-all what the rank addresses to the others; broadcast n
    from the source."""
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    group = arguments.get("group")
    g = dist.get_world_size(group)
    if collective == "all_reduce":
        return 2 * (g - 1) * nbytes(arguments["tensor"]) // g
    if collective == "all_gather_into_tensor":
        return (g - 1) * nbytes(arguments["input"])
    if collective == "reduce_scatter_tensor":
        return (g - 1) * nbytes(arguments["input"]) // g
    if collective == "all_to_all_single":
        sent = arguments["input"]
        splits = arguments["input_split_sizes"] or [sent.shape[0] // g] * g
        row = nbytes(sent) // sent.shape[0] if sent.shape[0] else 0
        return (sum(splits) - splits[dist.get_rank(group)]) * row
    if collective == "broadcast":
        return nbytes(arguments["tensor"]) if dist.get_rank() == arguments["src"] else 0
    raise ValueError(f"no byte count defined for {collective!r}")


@contextmanager
def counting_bytes_sent() -> Iterator[dict[str, int]]:
    """While active, every collective called through this module adds the bytes it sends from this
    rank (`bytes_sent`) to the yielded dict, keyed by collective name. Callers must look functions
    up on the module at call time (`comm.all_reduce(...)`) to be counted."""
    counts: dict[str, int] = {}
    module = globals()
    originals = {name: module[name] for name in
                 ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")}

    def counted(name: str, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            counts[name] = counts.get(name, 0) + bytes_sent(name, bound.arguments)
            return original(*args, **kwargs)
        return wrapper

    module.update({name: counted(name, fn) for name, fn in originals.items()})
    try:
        yield counts
    finally:
        module.update(originals)
