"""Nothing is left behind by a failure: a write that fails removes its temporary file, and a resumed
run's metrics.jsonl holds each step once."""
from __future__ import annotations

import errno
import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.checkpoint.format import LATEST, latest_iteration, publish
from muloco.core.durable import write_durably


def test_a_failed_durable_write_removes_its_temporary_file(tmp_path):
    target = tmp_path / "latest"
    target.write_text("2\n")

    def disk_full(f):
        f.write(b"4")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left"):
        write_durably(target, disk_full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert target.read_text() == "2\n"


def test_a_publish_on_a_full_disk_leaves_no_temporary_and_latest_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / LATEST).write_text("2\n")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        publish(tmp_path, 4)
    monkeypatch.undo()
    assert latest_iteration(tmp_path) == 2
    assert not list(tmp_path.glob("**/*.tmp.*")), sorted(str(p) for p in tmp_path.rglob("*"))


def test_a_resumed_run_keeps_each_step_of_metrics_jsonl_once(tmp_path, capsys):
    from trainer.metrics import MetricsLogger

    tensorboard = tmp_path / "tensorboard"
    first = MetricsLogger(str(tmp_path), str(tensorboard), total_steps=10, enabled=True)
    first.start(0)
    for step in range(1, 9):
        first.log({"step": step, "loss": 1.0 / step}, step)
    first.log({"step": 6, "outer_step": 2}, 6, prefix="outer")
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # killed in the middle of a record

    resumed = MetricsLogger(str(tmp_path), str(tensorboard), total_steps=10, enabled=True)
    resumed.start(6)  # the checkpoint it goes on from
    for step in range(7, 11):
        resumed.log({"step": step, "loss": 0.0}, step)
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10]  # step 6's train and outer records, each once
    assert f"{tmp_path / 'metrics.jsonl'}: dropped 3 records past step 6" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp.*"))
    events = EventAccumulator(str(tensorboard))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (s, pytest.approx(1.0 / s)) for s in range(1, 7)] + [(s, 0.0) for s in range(7, 11)]
