"""Nothing is left behind by a failure: a write that fails removes its temporary file, and a resumed
run's metrics.jsonl holds each step once."""
from __future__ import annotations

import errno
import os

import pytest

from trainer.checkpoint.format import LATEST, latest_iteration, publish
from trainer.durable import write_durably


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
