"""This trainer as a host of the outer loop (muloco/diloco/outer_loop.py): its Megatron parameters
described for the plan, and the trainer's step, lr schedule and step hook as the loop's `Host`.

The description: row-parallel weights are compressed by columns (so results do not depend on T); the
embedding and output head are the "embedding" compression group; streaming fragments are contiguous
layer ranges, the embedding riding with the first fragment and the head with the last; a
TP-replicated copy (a norm on TP rank > 0) does not count in worker-wide sums.
"""
from __future__ import annotations

import contextlib

import torch

from muloco.diloco.outer_loop import OuterLoop
from muloco.diloco.plan import SyncedTensor, TensorSpec, synced_tensors
from trainer.model.sharding import sharding_of


def fragment_of(name: str, num_layers: int, fragments: int) -> int:
    """Contiguous layer ranges; the embedding rides with the first fragment, the head with the last."""
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return layer * fragments // num_layers
    return 0 if "embedding" in name else fragments - 1


def megatron_tensors(named_params: list[tuple[str, torch.nn.Parameter]], canonical: dict[str, str], tp_rank: int,
                     num_layers: int, fragments: int) -> list[SyncedTensor]:
    """What this rank syncs: its Megatron parameters, by canonical name."""
    specs = []
    for local_name, p in named_params:
        name = canonical[local_name]
        partition_dim = sharding_of(name).partition_dim
        specs.append(TensorSpec(name=name, tensor_parallel_dim=partition_dim,
                                embedding_or_head=getattr(p, "is_embedding_or_output_parameter", False),
                                fragment=fragment_of(name, num_layers, fragments),
                                replicated=partition_dim is None and tp_rank != 0))
    return synced_tensors([p for _, p in named_params], specs, fragments)


class TrainerHost:
    """The outer loop's view of a Trainer (trainer/training.py)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.last_step = trainer.config.schedule.train_iters

    def inner_step(self) -> int:
        return self.trainer.step

    def schedule_state(self) -> dict:
        return self.trainer.engine.lr_scheduler.state_dict()

    def go_on_from(self, step: int, schedule: dict | None) -> None:
        engine = self.trainer.engine
        engine.lr_scheduler.load_state_dict(schedule)
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
        # The trainer's step is the run's one counter (step hooks see it already counting their step);
        # the engine's counters follow it, and the data position is the step.
        self.trainer.step = step
        engine.set_step(step)

    def weights_written(self) -> None:
        pass  # the inner optimizer updates the parameters themselves: nothing derives from them

    @property
    def tokens_per_step(self) -> float:
        config = self.trainer.config
        return config.batch.per_worker * config.model.seq_length

    def inner_lr(self) -> float:
        return self.trainer.engine.optimizer.param_groups[0]["lr"]

    def skip_to(self, step: int) -> list[float]:
        # The schedule steps as the engine's step would have stepped it; the data position is the step.
        engine, lrs = self.trainer.engine, []
        while self.trainer.step < step:
            lrs.append(self.inner_lr())
            engine.lr_scheduler.step()
            self.trainer.step += 1
        engine.set_step(step)
        return lrs


@contextlib.contextmanager
def attached_to_trainer(outer: OuterLoop, trainer):
    """`with attached_to_trainer(outer, trainer): trainer.train()`: the outer loop syncs after each of
    the trainer's optimizer steps inside the block (a trainer step hook; `after_inner_step` is looked
    up at every step, so a wrapper installed later still runs)."""
    with outer.attached(TrainerHost(trainer)):
        handle = trainer.register_step_hook(lambda step: outer.after_inner_step(step))
        try:
            yield outer
        finally:
            handle.remove()
