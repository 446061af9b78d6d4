"""MuLoCo in Hugging Face's Trainer (with its DeepSpeed integration), in a few lines:

    workers = muloco.data_parallel_workers(K)                # before the Trainer builds DeepSpeed's engine
    args = TrainingArguments(output_dir=f"out/worker_{workers.worker}", deepspeed=ds_config, ...)
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    outer = attach_to_trainer(trainer, ds_config["muloco"], workers)
    trainer.train()                                          # or train(resume_from_checkpoint=True)

What each Trainer extension point does:
- DeepSpeed's data parallelism stays inside one worker: the Trainer (through accelerate) calls
  `deepspeed.initialize` without an `mpu`, so `attach_to_trainer` gives the workers' `mpu` to DeepSpeed's
  own registry of parallel groups (`deepspeed.utils.groups.mpu`, where the engine looks for one when it is
  given none) before the engine exists. Its data loader already reads 1/(K x D) of the data per rank
  (accelerate shards by the global rank).
- `on_train_begin` (the engine exists, a resumed one already holds its checkpoint): the outer loop
  attaches to `trainer.model_wrapped`, the DeepSpeed engine, with the run's `max_steps` as its last step,
  and, when the Trainer resumed at step N, loads the outer state saved beside OUTPUT_DIR/checkpoint-N.
  accelerate's backward calls the engine's `step()`, which the outer loop wraps.
- `on_save`: this rank's outer state into the checkpoint's DeepSpeed tag folder. Each worker needs an
  output folder of its own (the K workers' DeepSpeed files share names); the Trainer writes
  `trainer_state.json` and DeepSpeed its `latest` on the first process only, so the first rank of every
  other worker writes them into its own folder too, and `resume_from_checkpoint=True` finds them.
- `on_train_end`: the syncs in flight land and the outer loop detaches.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

from deepspeed.utils import groups
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from muloco.core.durable import write_text_durably
from muloco.core.errors import CheckpointError, ConfigError
from muloco.diloco.config import MuLoCoConfig
from muloco.hook.attach import MuLoCoHook, attach, check
from muloco.hook.workers import Workers

TRAINER_STATE = "trainer_state.json"  # what the Trainer resumes its own counters from


class MuLoCoCallback(TrainerCallback):
    """The outer loop on a Trainer's DeepSpeed engine (made by `attach_to_trainer`)."""

    def __init__(self, trainer: Trainer, config, workers: Workers, attach_options: dict):
        self.trainer, self.config, self.workers, self.options = trainer, config, workers, attach_options
        self.outer: MuLoCoHook | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        if not hasattr(engine, "global_steps"):
            raise ConfigError("the Trainer did not build a DeepSpeed engine: pass TrainingArguments(deepspeed=...)")
        self.outer = attach(engine, self.config, self.workers, last_step=state.max_steps, **self.options)
        if state.global_step > 0:  # resumed: the engine already holds checkpoint-N's DeepSpeed files
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if not folder.is_dir():
                raise CheckpointError(f"the Trainer resumed at step {state.global_step}, but {folder} is not there: "
                                      f"resume from the run's own output_dir (resume_from_checkpoint=True)")
            self.outer.load(folder / _tag(engine))

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        tag = _tag(self.trainer.model_wrapped)
        self.outer.save(folder / tag)
        topology = self.workers.topology
        first_of_its_worker = topology.rank % topology.sizes.ranks_per_worker == 0
        if first_of_its_worker and topology.rank != 0:  # the Trainer's first process wrote worker 0's
            state.save_to_json(str(folder / TRAINER_STATE))
            write_text_durably(folder / "latest", tag)

    def on_train_end(self, args, state, control, **kwargs):
        if self.outer is not None:
            self.outer.detach()


def _tag(engine) -> str:
    """The tag the Trainer's DeepSpeed checkpoints are saved under (DeepSpeed's default)."""
    return f"global_step{engine.global_steps}"


def attach_to_trainer(trainer: Trainer, config: MuLoCoConfig | dict | str | Path, workers: Workers, *,
                      worker_id: int | None = None, config_dir: str | Path | None = None,
                      start: Literal["check", "worker0"] = "check",
                      log: Callable[[dict, int], None] | None = None) -> MuLoCoCallback:
    """The outer loop in `trainer` (see the module docstring); the options are `muloco.attach`'s. Call it
    after data_parallel_workers and before trainer.train()."""
    check(config, workers.topology.sizes.world, worker_id=worker_id, config_dir=config_dir)
    if trainer.args.deepspeed is None:
        raise ConfigError("the Trainer has no DeepSpeed config: pass TrainingArguments(deepspeed=ds_config)")
    groups.mpu = workers.mpu  # DeepSpeed's engine looks here for the mpu the Trainer does not pass
    callback = MuLoCoCallback(trainer, config, workers, {"worker_id": worker_id, "config_dir": config_dir,
                                                         "start": start, "log": log})
    trainer.add_callback(callback)
    return callback
