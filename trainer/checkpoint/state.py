"""What one rank saves and restores: model shard, inner optimizer and lr scheduler state, the step (and,
as a record, DeepSpeed's counters, which follow it), RNG states and the trainer's extra components, all keyed by canonical parameter name so
that a rank file does not depend on how parameters are numbered locally."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from muloco.core.errors import CheckpointError
from trainer.schedule import ScheduleConfig, lr_multiplier


def to_host(obj: Any, copy: bool = False) -> Any:
    """`obj` with its containers rebuilt and every tensor on the host. With `copy`, each tensor is a
    copy that training cannot change (an asynchronous save writes it while training goes on): an
    accelerator's tensors go into pinned host memory (torch's caching host allocator reuses it from
    one save to the next), copied asynchronously; the caller waits once for all (copy_to_host)."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        if tensor.device.type == "cpu":
            return tensor.clone() if copy else tensor
        if not copy:
            return tensor.cpu()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_host(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v, copy) for v in obj)
    return obj


def copy_to_host(obj: Any) -> Any:
    """`to_host(obj, copy=True)`, its asynchronous device-to-host copies finished."""
    copied = to_host(obj, copy=True)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.synchronize()
    return copied


def capture_rng() -> dict:
    accelerator = get_accelerator()
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": None if accelerator.device_name() == "cpu" else accelerator.get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["accelerator"] is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def optimizer_state(optimizer: torch.optim.Optimizer, name_of: dict[torch.Tensor, str]) -> dict:
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "state": {name_of[p]: dict(s) for p, s in optimizer.state.items()}}


# The inner optimizer (--optimizer) whose param groups have these kinds (trainer/optim/inner.py): Muon
# takes the hidden matrices in a muon group and the rest in an adamw one; AdamW takes everything.
_OPTIMIZER_OF_GROUP_KINDS = {("adamw",): "adamw", ("adamw", "muon"): "muon"}


def optimizer_change(saved_groups: Any, own_groups: list[dict]) -> str | None:
    """The change of inner optimizer between a checkpoint's param groups and this run's, said as the
    user chose it (--optimizer); None where both are the same optimizer or the saved groups are not
    an inner optimizer's."""
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
        return None
    saved = _OPTIMIZER_OF_GROUP_KINDS.get(tuple(g.get("kind") for g in saved_groups))
    own = _OPTIMIZER_OF_GROUP_KINDS.get(tuple(g.get("kind") for g in own_groups))
    if saved is None or own is None or saved == own:
        return None
    return (f"the checkpoint's inner optimizer is {saved}, this run's {own}: resume with --optimizer {saved}, or "
            f"with --no-load-optim to start {own} afresh at the loaded step")


def _check_group_kinds(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    kinds = [g.get("kind") for g in optimizer.param_groups]
    saved_kinds = [g.get("kind") for g in saved_groups]
    if kinds != saved_kinds:
        raise CheckpointError(optimizer_change(saved_groups, optimizer.param_groups)
                              or f"checkpoint optimizer has param groups {saved_kinds}, this run {kinds} "
                                 "(a different inner optimizer?)")


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict, param_of: dict[str, torch.Tensor]) -> None:
    _check_group_kinds(optimizer, saved["param_groups"])
    for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
        group.update(hyper)
    optimizer.state.clear()
    for name, s in saved["state"].items():
        param = param_of[name]  # state lives beside its parameter (on the accelerator in a GPU run)
        optimizer.state[param] = {k: v.to(param.device, copy=True) if isinstance(v, torch.Tensor) else v
                                  for k, v in s.items()}


def with_run_hyperparameters(state: dict, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """`state` (another run's) with this run's optimizer hyperparameters and peak lrs: a start from it
    keeps its position in the lr schedule (the step) and its optimizer moments, and takes its lr, weight
    decay and schedule from this run's config, at that position."""
    _check_group_kinds(optimizer, state["optimizer"]["param_groups"])
    step = state["scheduler"]["last_epoch"]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for group, base_lr, multiplier in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * multiplier(step)
    schedule = {**state["scheduler"], "base_lrs": list(scheduler.base_lrs), "_last_lr": [g["lr"] for g in groups]}
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups}, "scheduler": schedule}


def holds_global_weights(saved: dict) -> bool:
    """Whether a captured rank state's weights are its outer loop's global weights (the shards this rank
    owns of them; the other replicas of its worker check theirs). True without an outer loop."""
    outer = saved["extra"].get("muloco")
    if outer is None:
        return True
    return all(torch.equal(saved["model"][name], weight) for name, weight in outer["global_weights"].items())


def capture(trainer, name_of: dict[torch.Tensor, str], probe: dict | None, copy: bool = False) -> dict:
    """This rank's whole state at the end of step `trainer.step` (RNG first: nothing may draw before),
    on the host; with `copy`, in tensors of its own (see to_host), else CPU tensors may be the trainer's."""
    engine = trainer.engine
    return (copy_to_host if copy else to_host)({
        "rng": capture_rng(),
        "step": trainer.step,
        "model": {name_of[p]: p for p in trainer.model.parameters()},
        "optimizer": optimizer_state(engine.optimizer, name_of),
        "scheduler": engine.lr_scheduler.state_dict(),
        "engine": engine.counters(),
        "extra": {k: component.state_dict() for k, component in trainer.extra_state.items()},
        "probe": probe,
    })


def schedule_at_step(engine, step: int, schedule: ScheduleConfig) -> None:
    """A fresh inner optimizer's lr at `step` of this run's schedule (the scheduler resumes from there)."""
    scheduler = engine.lr_scheduler
    lrs = [base * lr_multiplier(step, schedule) for base in scheduler.base_lrs]
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": step, "_last_lr": lrs})
    for group, lr in zip(engine.optimizer.param_groups, lrs):
        group["lr"] = lr


@torch.no_grad()
def restore(trainer, state: dict, param_of: dict[str, torch.Tensor]) -> None:
    """Inverse of `capture`, for a state checked by trainer/checkpoint/schema.py; a state without
    "rng" (a resharded one, or --no-load-rng) leaves the fresh seeds, one without "optimizer"
    (--no-load-optim) the fresh inner optimizer, at this run's lr schedule."""
    for name, p in param_of.items():
        p.copy_(state["model"][name])
    engine = trainer.engine
    if "optimizer" in state:
        restore_optimizer(engine.optimizer, state["optimizer"], param_of)
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    else:
        schedule_at_step(engine, state["step"], trainer.config.schedule)
    trainer.step = state["step"]
    engine.set_step(trainer.step)
    for k, component in trainer.extra_state.items():
        component.load_state_dict(state["extra"][k])
    if "rng" in state:
        restore_rng(state["rng"])
