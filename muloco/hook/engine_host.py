"""A DeepSpeed engine as the outer loop's host (muloco/diloco/outer_loop.py's `Host`): its step
counter is the run's position, its lr scheduler the schedule a member that catches up takes, and
under ZeRO 1/2 (or the bf16 optimizer) the model's weights derive from the fp32 master partitions the
outer loop writes."""
from __future__ import annotations

from muloco.hook.engine_shards import refresh_model_weights


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
