"""What a rank's saved state may hold, checked against this run before anything of it is loaded.

A checkpoint is input like any other: its SHA-256 in meta.json proves only that the bytes are the
ones meta.json names, not that they make sense. So the tree is held to this run's own form:

- `step`: an integer >= 0, the iteration's;
- `model`: exactly this rank's parameter names, each a tensor of its parameter's shape and dtype
  (`copy_` would broadcast a smaller one), finite;
- `optimizer`: this optimizer's param groups (same kinds and keys, finite non-negative
  hyperparameters) and per-parameter state of known names, each tensor shaped like its parameter, in
  its dtype or bf16 (Muon's momentum_dtype; the optimizer takes either as its own dtype);
- `scheduler`, `engine`, `rng` and each `extra` component: the form of this run's own state (same
  keys, kinds, tensor shapes and dtypes; lists of the same length where this run's is not empty),
  numbers finite, counters equal to the step; RNG states a scratch generator accepts. Without the
  optimizer (--no-load-optim) the scheduler is not loaded either (the lr follows this run's schedule
  at the step), so it need only be plain data: its per-group lists may be another optimizer's.

A checkpoint of another inner optimizer (Muon's groups where this run has AdamW's) is said as such.

Every violation is named by its dotted field; `check_rank_state` raises one CheckpointError naming
the file and the first few.
"""
from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from muloco.core.errors import CheckpointError
from trainer.checkpoint.format import CheckpointReader, rank_file
from muloco.core.rank_file import to_plain
from trainer.checkpoint.state import capture_rng, optimizer_change

REQUIRED = ("step", "model", "optimizer", "scheduler", "engine", "extra")
OPTIONAL = ("rng", "probe")  # a resharded state has no RNG; only last-stage ranks save a probe
_SHOWN = 4  # violations named in the message


def checked_rank_state(reader: CheckpointReader, rank: int, params: Mapping[str, torch.Tensor], own: dict,
                       skipped: tuple[str, ...] = ()) -> dict:
    """Rank `rank`'s state in `reader`, fully read and checked, but for the parts `skipped` (not loaded)."""
    saved = reader.rank_state(rank)
    state = to_plain({key: saved[key] for key in saved if key not in skipped})
    check_rank_state(state, f"rank file {rank_file(reader.directory, rank)}", reader.meta.step, params, own, skipped)
    return state


def check_rank_state(state: Mapping, source: str, step: int, params: Mapping[str, torch.Tensor], own: dict,
                     skipped: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError naming `source` unless `state` has this run's form (`own`: this run's
    `optimizer_groups`, `scheduler`, `engine`, `rng` and `extra` states, as `own_form` gives them);
    `skipped` parts (--no-load-optim, --no-load-rng) are not loaded, so need not be there."""
    problems = state_problems(state, step, params, own, skipped)
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise CheckpointError(f"{source}: " + "; ".join(problems[:_SHOWN]) + more)


def own_form(trainer) -> dict:
    """This run's own state, the form a checkpoint's must have (nothing large is copied)."""
    engine = trainer.engine
    return {"optimizer_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
            "scheduler": engine.lr_scheduler.state_dict(), "engine": engine.counters(), "rng": capture_rng(),
            "extra": dict(trainer.extra_state)}  # each component checks its own state (state_problems)


def state_problems(state: Any, step: int, params: Mapping[str, torch.Tensor], own: dict,
                   skipped: tuple[str, ...] = ()) -> list[str]:
    if not isinstance(state, Mapping):
        return [f"the state must be a dict, got {_kind(state)}"]
    problems = [f"{key} is missing" for key in REQUIRED if key not in state and key not in skipped]
    problems += [f"{key} is not a known part of a rank's state" for key in state if key not in (*REQUIRED, *OPTIONAL)]
    if problems:
        return problems
    if not _is_int(state["step"]) or state["step"] != step:
        problems.append(f"step must be the iteration's, {step}, got {_show(state['step'])}")
    problems += _model_problems(state["model"], params)
    loads_optimizer = "optimizer" not in skipped
    if loads_optimizer:
        change = optimizer_change(state["optimizer"].get("param_groups") if isinstance(state["optimizer"], Mapping)
                                  else None, own["optimizer_groups"])
        if change:  # the scheduler's per-group lists differ too: one cause, said once
            return [f"optimizer: {change}"]
        problems += _optimizer_problems(state["optimizer"], params, own["optimizer_groups"])
        _conform(state["scheduler"], own["scheduler"], "scheduler", problems)
    else:
        _plain(state["scheduler"], "scheduler", problems)
    _conform(state["engine"], own["engine"], "engine", problems)
    problems += _extra_problems(state["extra"], own["extra"])
    if "rng" in state:
        _conform(state["rng"], own["rng"], "rng", problems)
        problems += _generator_problems(state["rng"])
    if not problems:  # the counters follow the step
        counters = [("engine.global_steps", state["engine"].get("global_steps"))]
        if loads_optimizer:
            counters.insert(0, ("scheduler.last_epoch", state["scheduler"].get("last_epoch")))
        for where, value in counters:
            if value != step:
                problems.append(f"{where} must be the step, {step}, got {_show(value)}")
    if state.get("probe") is not None and not isinstance(state["probe"], Mapping):
        problems.append(f"probe must be a dict or null, got {_kind(state['probe'])}")
    return problems


def _extra_problems(extra: Any, components: Mapping[str, Any]) -> list[str]:
    """The extra components' states (the MuLoCo outer loop's snapshot), each checked by its component."""
    if not isinstance(extra, Mapping) or set(extra) != set(components):
        return [f"extra must hold the states of {sorted(components)}, got {_kind(extra)}"]
    return [f"extra.{name}: {problem}" for name, component in components.items()
            for problem in component.state_problems(extra[name])]


def check_weight(value: Any, name: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    """One weight taken alone (--finetune, a weights-only start), whole (unsharded, as at T=1): a finite
    floating-point tensor of the parameter's full shape (any float dtype: `copy_` converts it, but it
    would broadcast a smaller shape). Returns it, or raises CheckpointError naming `source` and `name`."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or tuple(value.shape) != shape:
        raise CheckpointError(f"{source}: model.{name} must be a floating-point tensor of shape {shape} "
                              f"(unsharded), got {_typed_kind(value)}")
    if not bool(torch.isfinite(value).all()):
        raise CheckpointError(f"{source}: model.{name} holds NaN or infinite values")
    return value


def _model_problems(model: Any, params: Mapping[str, torch.Tensor]) -> list[str]:
    if not isinstance(model, Mapping):
        return [f"model must be a dict of tensors, got {_kind(model)}"]
    problems = []
    missing, unexpected = sorted(set(params) - set(model)), sorted(set(model) - set(params))
    if missing:
        problems.append(f"model lacks this rank's parameters {missing[:3]}")
    if unexpected:
        problems.append(f"model holds parameters this rank does not have: {unexpected[:3]}")
    for name in sorted(set(params) & set(model)):
        _tensor_like(model[name], params[name], f"model.{name}", problems)
    return problems


def _optimizer_problems(optimizer: Any, params: Mapping[str, torch.Tensor], own_groups: list[dict]) -> list[str]:
    problems: list[str] = []
    if not isinstance(optimizer, Mapping) or set(optimizer) != {"param_groups", "state"}:
        return [f"optimizer must be a dict of param_groups and state, got {_kind(optimizer)}"]
    groups, per_param = optimizer["param_groups"], optimizer["state"]
    if not isinstance(groups, list) or len(groups) != len(own_groups):
        got = f"{len(groups)}" if isinstance(groups, list) else _kind(groups)
        return [f"optimizer.param_groups must be a list of {len(own_groups)} groups, got {got}"]
    for i, (group, own) in enumerate(zip(groups, own_groups)):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(group, Mapping) or group.get("kind") != own.get("kind"):
            problems.append(f"{where} must be a {own.get('kind')} group (a different inner optimizer?)")
            continue
        _conform(group, own, where, problems)
        problems += [f"{where}.{key} must be >= 0, got {value!r}" for key, value in group.items()
                     if _is_number(value) and value < 0]
    if not isinstance(per_param, Mapping):
        return [*problems, f"optimizer.state must be a dict, got {_kind(per_param)}"]
    for name, entries in per_param.items():
        where = f"optimizer.state.{name}"
        if name not in params:
            problems.append(f"{where} is not a parameter of this rank")
        elif not isinstance(entries, Mapping):
            problems.append(f"{where} must be a dict, got {_kind(entries)}")
        else:
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    _tensor_like(value, params[name], f"{where}.{key}", problems, also_dtype=torch.bfloat16)
                elif not (_is_number(value) and value >= 0):
                    problems.append(f"{where}.{key} must be a tensor or a number >= 0, got {_show(value)}")
    return problems


def _tensor_like(value: Any, like: torch.Tensor, where: str, problems: list[str],
                 also_dtype: torch.dtype | None = None) -> None:
    if (not isinstance(value, torch.Tensor) or value.dtype not in (like.dtype, also_dtype)
            or value.shape != like.shape):
        also = f" (or {str(also_dtype).removeprefix('torch.')})" if also_dtype is not None else ""
        problems.append(f"{where} must be {_typed_kind(like)}{also}, got {_typed_kind(value)}")
    elif value.is_floating_point() and not bool(torch.isfinite(value).all()):
        problems.append(f"{where} holds NaN or infinite values")


def _conform(value: Any, own: Any, where: str, problems: list[str]) -> None:
    """`value` must have the form of `own`, this run's value at the same place."""
    if isinstance(own, torch.Tensor):
        _tensor_like(value, own, where, problems)
    elif isinstance(own, np.ndarray):
        if not isinstance(value, np.ndarray) or value.dtype != own.dtype or value.shape != own.shape:
            problems.append(f"{where} must be a {own.dtype} array of shape {own.shape}, got {_kind(value)}")
    elif isinstance(own, Mapping):
        if not isinstance(value, Mapping):
            problems.append(f"{where} must be a dict, got {_kind(value)}")
        elif own and set(value) != set(own):
            problems.append(f"{where} must hold the keys {sorted(map(str, own))[:6]}, got {sorted(map(str, value))[:6]}")
        elif own:
            for key in own:
                _conform(value[key], own[key], f"{where}.{key}", problems)
        else:  # a part this run has not filled yet (error feedback before the first sync)
            _plain(value, where, problems)
    elif isinstance(own, (list, tuple)):
        if type(value) is not type(own):
            problems.append(f"{where} must be a {type(own).__name__}, got {_kind(value)}")
        elif own and len(value) != len(own):
            problems.append(f"{where} must hold {len(own)} items, got {len(value)}")
        elif own:
            for i, (v, o) in enumerate(zip(value, own)):
                _conform(v, o, f"{where}[{i}]", problems)
        else:  # this run's is empty (no overlapped sync in flight): any length, plain values
            _plain(value, where, problems)
    elif own is None or isinstance(own, (bool, str)):
        if type(value) is not type(own):
            problems.append(f"{where} must be {_kind(own)}, got {_show(value)}")
    elif isinstance(own, int):
        if not _is_int(value):
            problems.append(f"{where} must be an integer, got {_show(value)}")
    elif isinstance(own, float):
        if not _is_number(value):
            problems.append(f"{where} must be a finite number, got {_show(value)}")


def _plain(value: Any, where: str, problems: list[str]) -> None:
    """Parts with no counterpart in this run: any tree of tensors, finite numbers, strings and None."""
    if isinstance(value, Mapping):
        for key, v in value.items():
            _plain(v, f"{where}.{key}", problems)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]", problems)
    elif isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            problems.append(f"{where} holds NaN or infinite values")
    elif isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{where} must be a finite number, got {value!r}")


def _generator_problems(rng: Mapping) -> list[str]:
    """The host generators' states, tried on scratch generators (the run's own are not touched)."""
    problems = []
    for key, load in (("python", lambda s: random.Random().setstate(s)),
                      ("numpy", lambda s: np.random.RandomState().set_state(s)),
                      ("torch", lambda s: torch.Generator().set_state(s))):
        try:
            load(rng[key])
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as err:
            problems.append(f"rng.{key} is not a {key} generator state ({str(err)[:80]})")
    return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, (type(None), bool, int, float, str)) else _kind(value)


def _typed_kind(value: Any) -> str:
    """A tensor with its dtype and shape ("a float32 tensor of shape (128,)"); anything else as _kind."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return _kind(value)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            tuple: "a tuple"}.get(type(value), "a dict" if isinstance(value, Mapping) else type(value).__name__)
