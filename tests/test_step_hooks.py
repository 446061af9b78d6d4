"""The trainer's one extension point: step hooks run after each optimizer step in registration order,
see the step already counted, return values to log, and detach through their handle or the
components' context managers (also when training raises)."""
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from trainer.checkpoint.checkpointer import Checkpointer
from muloco.diloco.outer_loop import OuterLoop
from trainer.outer_host import attached_to_trainer
from trainer.training import Trainer


def bare_trainer(step: int = 0) -> Trainer:
    trainer = Trainer.__new__(Trainer)  # the hook mechanism only; no model or engine
    trainer.step, trainer._step_hooks = step, OrderedDict()
    trainer.config = SimpleNamespace(schedule=SimpleNamespace(train_iters=10))
    return trainer


def test_hooks_run_in_order_and_remove():
    trainer, calls = bare_trainer(step=7), []
    first = trainer.register_step_hook(lambda step: calls.append(("first", step)) or {"a": 1})
    trainer.register_step_hook(lambda step: calls.append(("second", step)) or {"a": 2, "b": 3})
    assert trainer._run_step_hooks() == {"a": 2, "b": 3}
    first.remove()
    assert trainer._run_step_hooks() == {"a": 2, "b": 3}
    assert calls == [("first", 7), ("second", 7), ("second", 7)]


def test_outer_loop_and_checkpointer_detach_when_the_block_ends_or_raises():
    trainer, synced = bare_trainer(step=3), []
    outer = OuterLoop.__new__(OuterLoop)
    outer.after_inner_step, outer.pacer = synced.append, None  # fixed-H syncs: no pacing
    left = []
    outer.membership = SimpleNamespace(join=lambda loop: None, leave=lambda: left.append(True))
    outer.background = ThreadPoolExecutor(max_workers=1)
    outer.background.submit(lambda: None).result()  # its thread is running
    saver = Checkpointer.__new__(Checkpointer)
    saver._after_step, saver._in_flight = lambda step: {"checkpoint_seconds": 0.5}, None
    with pytest.raises(RuntimeError):
        with attached_to_trainer(outer, trainer), saver.attached_to(trainer):
            assert trainer._run_step_hooks() == {"checkpoint_seconds": 0.5}
            raise RuntimeError("training failed")
    assert synced == [3] and not trainer._step_hooks and left == [True]  # it left its membership too
    with pytest.raises(RuntimeError, match="after shutdown"):  # and stopped its background thread
        outer.background.submit(lambda: None)
