"""Asynchronous saves (--async-save, trainer/checkpoint/async_save.py), in process: the real tiny
Megatron model and the real Checkpointer in a world of one, its writer thread held at a gate the test
opens, and the other ranks of a larger world simulated in the one all-reduce that asks who is still
writing. A kill -9 during an asynchronous save is test_checkpoint's crash-mid-save launch."""
import errno
import threading
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron_world import megatron_world_of_one, tiny_model
from tools.trainer_runs import TINY_VOCAB

import trainer.checkpoint.checkpointer as checkpointer_module
from muloco.core import comm
from trainer.checkpoint import CheckpointReader, latest_iteration
from trainer.checkpoint.async_save import BackgroundWrite
from trainer.checkpoint.checkpointer import FAIL_ENV, Checkpointer
from trainer.checkpoint.format import COMPLETE, iteration_dir, rank_file
from trainer.config import build_parser, resolve
from muloco.core.errors import ConfigError
from trainer.model.builder import canonical_names, padded_vocab_size
from muloco.core.topology import ParallelSizes, coordinates
from trainer.training import Trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_ITERS = 8


def _config(tmp_path: Path, root: Path, *flags: str):
    args = build_parser().parse_args([
        "--ds_config", str(REPO_ROOT / "ds_configs" / "cpu_tiny_muon.json"), "--model", "tiny", "--data-path", "x",
        "--vocab-size", str(TINY_VOCAB), "--train-iters", str(TRAIN_ITERS), "--run-dir", str(tmp_path / "run"),
        "--save", str(root), *flags])
    return resolve(args, 1)


@pytest.fixture(scope="module")
def world():
    with megatron_world_of_one():
        yield


@pytest.fixture
def trainer(world):
    """The trainer's hook mechanism around the real tiny model, an AdamW and an lr schedule."""
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    bare = Trainer.__new__(Trainer)
    bare._step_hooks, bare.step, bare.model, bare.extra_state = OrderedDict(), 0, model, {}
    bare.engine = SimpleNamespace(optimizer=optimizer, lr_scheduler=scheduler,
                                  counters=lambda: {"global_steps": bare.step})
    return bare


def advance(trainer: Trainer, steps: int = 1) -> None:
    """Training moves on: every weight and moment changes in place (as the engine's step does)."""
    for _ in range(steps):
        for p in trainer.model.parameters():
            p.grad = torch.randn_like(p)
        trainer.engine.optimizer.step()
        trainer.engine.lr_scheduler.step()
        trainer.step += 1


def checkpointer(trainer: Trainer, tmp_path: Path, root: Path, *flags: str) -> Checkpointer:
    trainer.config = _config(tmp_path, root, *flags)
    sizes = ParallelSizes(1, 1, 1, 1)
    topology = SimpleNamespace(rank=0, sizes=sizes, coords=coordinates(0, sizes))
    return Checkpointer(trainer.config, topology, trainer, canonical_names(trainer.model), TINY_VOCAB,
                        padded_vocab_size(TINY_VOCAB, 1))


class HeldWrites:
    """Rank files wait at a gate before they are written; `order` records each write's start and end.
    With `open_on_wait`, the gate opens when the training thread first waits for a writer, so a test
    that expects no wait sees its write never finish."""

    def __init__(self, monkeypatch, open_on_wait: bool = False):
        self.gate, self.order = threading.Event(), []
        real = checkpointer_module.write_rank_file

        def held(f, state):
            self.order.append(("start", state["step"]))
            assert self.gate.wait(60), "the gate never opened"
            digest = real(f, state)
            self.order.append(("end", state["step"]))
            return digest

        monkeypatch.setattr(checkpointer_module, "write_rank_file", held)
        if open_on_wait:
            join = BackgroundWrite.join
            monkeypatch.setattr(BackgroundWrite, "join", lambda write: self.gate.set() or join(write))

    def open(self) -> None:
        self.gate.set()

    def began(self, step: int) -> None:
        """Wait until the writer thread of step `step`'s save has begun its write."""
        deadline = time.monotonic() + 60
        while ("start", step) not in self.order:
            assert time.monotonic() < deadline, f"the write of step {step} never began"
            time.sleep(0.01)


@pytest.fixture
def held(monkeypatch):
    writes = []
    yield lambda **kw: writes.append(HeldWrites(monkeypatch, **kw)) or writes[-1]
    for w in writes:  # a failing test must not leave a writer thread waiting
        w.open()


def test_an_async_save_writes_the_bytes_of_a_synchronous_save_while_training_moves_on(trainer, tmp_path, held):
    advance(trainer, 3)
    synchronous = checkpointer(trainer, tmp_path, tmp_path / "sync")
    synchronous.save(3)
    background = checkpointer(trainer, tmp_path, tmp_path / "async", "--async-save")
    writes = held()
    background.save(3)
    writes.began(3)
    assert writes.order == [("start", 3)] and latest_iteration(tmp_path / "async") is None
    weights = [p.clone() for p in trainer.model.parameters()]
    advance(trainer)  # the file is written after the weights and moments moved
    assert not any(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters()))
    writes.open()
    background.wait_for_save()
    assert latest_iteration(tmp_path / "async") == 3
    files = [rank_file(iteration_dir(root, 3), 0) for root in (tmp_path / "sync", tmp_path / "async")]
    assert files[0].read_bytes() == files[1].read_bytes()
    metas = [CheckpointReader(root).meta for root in (tmp_path / "sync", tmp_path / "async")]
    assert metas[0].rank_files == metas[1].rank_files
    assert (metas[0].config["async_save"], metas[1].config["async_save"]) == (False, True)


def test_latest_moves_only_after_every_rank_has_written_and_training_does_not_wait(trainer, tmp_path, held,
                                                                                    monkeypatch):
    root = tmp_path / "ckpt"
    saver = checkpointer(trainer, tmp_path, root, "--async-save", "--save-interval", "4")
    peers_writing = [0]  # the other ranks of the world still writing, in the all-reduce that asks
    all_reduce = comm.all_reduce
    monkeypatch.setattr(comm, "all_reduce", lambda t, **kw: all_reduce(t, **kw) + peers_writing[0])
    writes = held()
    with saver.attached_to(trainer):
        advance(trainer, 4)
        assert trainer._run_step_hooks()["checkpoint_seconds"] >= 0  # the save of step 4 began
        writes.began(4)
        advance(trainer)
        assert trainer._run_step_hooks() == {}  # its file is not written: training goes on
        assert latest_iteration(root) is None and not (iteration_dir(root, 4) / COMPLETE).exists()
        assert not saver._in_flight.write.done()

        writes.open()
        saver._in_flight.write.join()  # this rank's file is durable, another rank's is not
        peers_writing[0] = 1
        advance(trainer)
        trainer._run_step_hooks()
        assert latest_iteration(root) is None and not (iteration_dir(root, 4) / COMPLETE).exists()

        peers_writing[0] = 0  # every rank has written: published at the next step boundary
        advance(trainer)
        trainer._run_step_hooks()
        assert latest_iteration(root) == 4 and saver._in_flight is None
    assert CheckpointReader(root).rank_state(0)["step"] == 4


def test_a_second_save_waits_for_the_first_and_the_run_end_waits_for_the_last(trainer, tmp_path, held):
    root = tmp_path / "ckpt"
    saver = checkpointer(trainer, tmp_path, root, "--async-save", "--save-interval", "4")
    writes = held(open_on_wait=True)  # a write finishes only if the training thread waits for it
    with saver.attached_to(trainer):
        advance(trainer, 4)
        trainer._run_step_hooks()
        advance(trainer, 4)
        trainer._run_step_hooks()  # step 8, the last: saved again before the first was written
        writes.began(8)
        assert writes.order[:3] == [("start", 4), ("end", 4), ("start", 8)] and latest_iteration(root) == 4
    assert writes.order == [("start", 4), ("end", 4), ("start", 8), ("end", 8)]
    assert latest_iteration(root) == 8 and (iteration_dir(root, 8) / COMPLETE).exists()
    assert CheckpointReader(root).rank_state(0)["step"] == 8


def test_a_run_ending_in_an_error_publishes_nothing_and_keeps_the_previous_checkpoint(trainer, tmp_path, held,
                                                                                     monkeypatch):
    root = tmp_path / "ckpt"
    saver = checkpointer(trainer, tmp_path, root, "--async-save", "--save-interval", "2")
    held(open_on_wait=True)
    with pytest.raises(RuntimeError, match="a rank failed"):
        with saver.attached_to(trainer):
            advance(trainer, 2)
            trainer._run_step_hooks()
            saver.wait_for_save()
            advance(trainer, 2)
            trainer._run_step_hooks()  # step 4's save is in flight
            for collective in ("all_reduce", "all_gather_into_tensor", "broadcast"):  # the others may be gone
                monkeypatch.setattr(comm, collective, lambda *a, **kw: pytest.fail("a collective after an error"))
            raise RuntimeError("a rank failed")
    assert rank_file(iteration_dir(root, 4), 0).is_file()  # written (its writer was joined), not published
    assert latest_iteration(root) == 2 and not (iteration_dir(root, 4) / COMPLETE).exists()
    assert CheckpointReader(root).rank_state(0)["step"] == 2


def test_a_full_disk_during_an_async_save_stops_in_one_line_with_the_previous_checkpoint(trainer, tmp_path,
                                                                                       monkeypatch, capsys):
    root = tmp_path / "ckpt"
    saver = checkpointer(trainer, tmp_path, root, "--async-save", "--save-interval", "2")
    monkeypatch.setenv(FAIL_ENV, f"4:0:{errno.ENOSPC}")
    with pytest.raises(SystemExit) as stopped:
        with saver.attached_to(trainer):
            for _ in range(TRAIN_ITERS):
                advance(trainer)
                trainer._run_step_hooks()
    assert stopped.value.code == 1 and trainer.step <= 6
    lines = [line for line in capsys.readouterr().err.splitlines() if "checkpoint error" in line]
    assert lines == [f"checkpoint error: could not save step 4 in {iteration_dir(root, 4)}: rank 0: [Errno 28] No space "
                     f"left on device (1 of 1 ranks failed); temporary files removed, {root / 'latest'} still names "
                     "step 2"]
    assert latest_iteration(root) == 2 and not iteration_dir(root, 4).exists()


def test_async_save_needs_a_save_folder(tmp_path):
    args = build_parser().parse_args(["--ds_config", str(REPO_ROOT / "ds_configs" / "cpu_tiny_muon.json"),
                                      "--data-path", "x", "--async-save"])
    with pytest.raises(ConfigError, match="--async-save needs --save DIR"):
        resolve(args, 1)
