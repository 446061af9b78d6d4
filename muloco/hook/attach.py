"""The outer loop attached to a DeepSpeed engine, in a few lines of a user's loop:

    workers = muloco.data_parallel_workers(K)               # after init_distributed, before initialize
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=workers.mpu, ...)
    outer = muloco.attach(engine, muloco_block, workers)    # the outer loop on this engine
    for batch in loader:                                    # the loop, unchanged
        loss = engine(**batch).loss; engine.backward(loss); engine.step()
    outer.detach()                                          # syncs in flight land; the membership is left

The hook point. DeepSpeed (0.19) has no hook after an engine step: the inner optimizer's
`register_step_post_hook` runs once per ZeRO parameter group, before DeepSpeed copies its fp32
master partitions into the model's weights, and on stage 0 before the lr schedule steps. So `attach`
wraps this engine's `step` (an attribute of the instance: other engines and the class are
untouched, and `detach` removes it): after a `step()` that applied an optimizer step
(`engine.was_step_applied()`; micro-steps inside gradient accumulation do not), the outer loop runs
`after_inner_step(engine.global_steps)`.

The position of the run is `engine.global_steps`: a worker that catches up from its peers (the elastic
mode), or that ends an interval at its deadline (`muloco.pace`, wall-clock pacing), moves it and the
lr schedule; a loop that draws its data by step should read it there, and with pacing loop
`while engine.global_steps < last_step` (a slow worker takes fewer steps than the others).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from muloco.core import comm
from muloco.core.errors import ConfigError
from muloco.core.typed_json import load
from muloco.diloco.auth import job_key, resolve_key_file
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.membership import StaticMembership
from muloco.diloco.outer_loop import OuterLoop
from muloco.hook.engine_shards import engine_tensors, plan_signature, refresh_model_weights, refusal
from muloco.hook.workers import Workers

ATTACHED = "_muloco_outer_loop"  # the engine attribute that marks an engine the outer loop is attached to


# -- the engine as the outer loop's host ----------------------------------------------------------

class EngineHost:
    def __init__(self, engine, last_step: int | None):
        self.engine, self.last_step = engine, last_step

    def inner_step(self) -> int:
        return self.engine.global_steps

    def schedule_state(self) -> dict | None:
        scheduler = self.engine.lr_scheduler
        return scheduler.state_dict() if scheduler is not None else None

    def go_on_from(self, step: int, schedule: dict | None) -> None:
        engine = self.engine
        if schedule is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(schedule)
            for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        engine.global_steps = step
        engine.global_samples = step * engine.train_batch_size()

    @property
    def tokens_per_step(self) -> float:
        return float(self.engine.train_batch_size())  # samples: the hook does not know the sequence length

    def inner_lr(self) -> float:
        return self.engine.optimizer.param_groups[0]["lr"]

    def skip_to(self, step: int) -> list[float]:
        engine, lrs = self.engine, []
        while engine.global_steps < step:
            lrs.append(self.inner_lr())
            if engine.lr_scheduler is not None:
                engine.lr_scheduler.step()
            engine.global_steps += 1
        engine.global_samples = step * engine.train_batch_size()
        return lrs

    def weights_written(self) -> None:
        refresh_model_weights(self.engine)  # the model's weights derive from the partitions


class MuLoCoHook:
    """The outer loop attached to one engine (made by `attach`)."""

    def __init__(self, engine, loop: OuterLoop, host: EngineHost):
        self.engine, self.loop = engine, loop
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(loop.attached(host))
        inner_step = engine.step

        def step(*args, **kwargs):
            result = inner_step(*args, **kwargs)
            if engine.was_step_applied():
                loop.after_inner_step(engine.global_steps)
            return result

        engine.step = step
        setattr(engine, ATTACHED, self)

    def __enter__(self) -> MuLoCoHook:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.detach()
        else:  # a failed loop: leave without finishing the syncs in flight (its peers may be gone)
            self._release()
            self._stack.__exit__(kind, error, traceback)

    def detach(self) -> None:
        """Let the syncs in flight land (not applied: the run is over), log their metrics, leave the
        membership and give the engine its own `step` back."""
        self._release()
        self._stack.close()

    def _release(self) -> None:
        if getattr(self.engine, ATTACHED, None) is self:
            del self.engine.step
            delattr(self.engine, ATTACHED)

    @property
    def outer_step(self) -> int:
        return self.loop.state.outer_step

    def global_weights_sha256(self) -> str:
        """sha256 over the worker's global weights (every rank's checksum of its own, in rank order):
        equal on two workers iff they hold bit-identical global weights. Every rank of the worker calls it."""
        mine = torch.frombuffer(bytearray(bytes.fromhex(self.loop.state.checksum())), dtype=torch.uint8)
        group = self.loop.topology.inner_dp_group
        worker = torch.empty(mine.numel() * self.loop.topology.sizes.data, dtype=torch.uint8,
                             device=comm.group_device(group))
        comm.all_gather_into_tensor(worker, mine, group=group)
        return hashlib.sha256(worker.cpu().numpy().tobytes()).hexdigest()

    def state_dict(self) -> dict:
        """The outer state of this rank (its owned tensors), for `client_state` of a DeepSpeed checkpoint."""
        return self.loop.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """After engine.load_checkpoint (which restores the local weights and the inner optimizer)."""
        self.loop.load_state_dict(state)


def _print_record(record: dict, step: int) -> None:
    print("outer " + json.dumps(record, default=str), flush=True)


def attach(engine, config: MuLoCoConfig | dict, workers: Workers, *, worker_id: int | None = None,
           last_step: int | None = None, config_dir: str | Path = ".",
           log: Callable[[dict, int], None] | None = None) -> MuLoCoHook:
    """The outer loop on `engine` (see the module docstring). `config` is the ds_config's "muloco"
    block (a dict, or a MuLoCoConfig); its job secret's key_file is relative to `config_dir`. With an
    `elastic` block each worker is a job of its own (`data_parallel_workers(1)`) that says which worker
    it is (`worker_id`). `last_step`: the run's last inner step, when known: no quorum is asked for past
    it, and after it the final sync (`final_sync`) leaves every worker holding the global weights; without
    it the workers end with their own. `log(record, step)` receives each sync's record on the logging rank (default: printed as
    one JSON line). Every problem is one ConfigError line, before any collective of the outer loop."""
    config = config if isinstance(config, MuLoCoConfig) else load(MuLoCoConfig, config, "muloco")
    topology = workers.topology
    if getattr(engine, ATTACHED, None) is not None:
        raise ConfigError("the outer loop is already attached to this engine (attach once; detach() first)")
    expected = 1 if config.elastic is not None else config.workers
    if topology.sizes.workers != expected:
        raise ConfigError(f"the world was split into {topology.sizes.workers} workers (data_parallel_workers), but "
                          + ("an elastic job is one worker" if config.elastic is not None
                             else f"muloco.workers is {config.workers}"))
    if config.elastic is not None and not (isinstance(worker_id, int) and 0 <= worker_id < config.workers):
        raise ConfigError(f"an elastic worker needs worker_id in 0..{config.workers - 1}, got {worker_id!r}")
    why_not = refusal(engine)
    if why_not:
        raise ConfigError(why_not)
    path = resolve_key_file(config.auth, Path(config_dir)) if config.talks and config.auth != "none" else None
    key = job_key(path, config.auth.job_id if path else "", config.talks, topology.is_logging_rank)
    data_parallel = sorted(dist.get_process_group_ranks(engine.data_parallel_group))
    worker = workers.data_parallel_ranks  # this rank's shard in its worker
    if data_parallel != worker:
        raise ConfigError(f"DeepSpeed's data-parallel group is ranks {data_parallel}, not this worker's {worker}: "
                          f"pass mpu=workers.mpu to deepspeed.initialize so its all-reduce stays inside one worker")
    tensors, replicated = engine_tensors(engine, config.streaming.fragments)
    if config.elastic is not None:
        from muloco.elastic.membership import QuorumMembership  # only elastic runs import torchft

        topology = replace(topology, coords=replace(topology.coords, worker=worker_id))
        membership = QuorumMembership(config, topology, key, worker_id)
    else:
        membership = StaticMembership(config, topology, key)
        different = membership.differing_workers(plan_signature(tensors))
        if different:
            raise ConfigError(f"workers {different} hold other parameters (names, shapes, ZeRO partitions) than "
                              f"worker {topology.coords.worker}: every worker must build the same model with the "
                              f"same ds_config")
    loop = OuterLoop(config, tensors, topology, log or _print_record, membership, replicated)
    return MuLoCoHook(engine, loop, EngineHost(engine, last_step))
