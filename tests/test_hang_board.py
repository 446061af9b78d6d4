"""The hang line names the rank that stopped (or, all alive, the one still busy that the others wait for): each rank's watchdog publishes its progress on the job's
store; the one that fires names the rank whose heartbeat went silent first (or, every rank alive, the
one furthest behind), raises the alarm so every other rank exits within a poll, and kills a stopped
sibling of its own launcher. Start-up and resume are watched with their own timeout, by default in
proportion to the data. Three processes
on one FileStore stand for the ranks of a job (the launched case is test_faults' frozen rank)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from trainer.config import DataConfig
from trainer.data import STARTUP_BYTES_PER_S, STARTUP_FLOOR_S, STARTUP_S_PER_PREFIX, startup_timeout_s
from trainer.progress_board import Progress, ProgressBoard, stopped_first
from trainer.watchdog import HANG_EXIT_CODE, Watchdog

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(rank: int, step: int | None, advanced_at: float, beat_at: float) -> Progress:
    return Progress(rank, f"rank {rank}", step, "training", advanced_at, beat_at, "h", 1, 1)


def test_the_rank_silent_longest_is_named_else_the_one_furthest_behind():
    now = 1000.0
    alive = [_record(0, 12, 900, 999), _record(1, 11, 950, 999), _record(2, 12, 800, 999)]
    assert stopped_first(alive, now, silent_after_s=5).rank == 1  # behind by a step
    assert stopped_first([*alive, _record(3, 12, 990, 980), _record(4, 12, 990, 960)], now, 5).rank == 4
    assert stopped_first([_record(0, None, 5, 999), _record(1, 3, 1, 999)], now, 5).rank == 0  # still starting
    assert stopped_first([], now, 5) is None


BUSY = "in megatron/core/datasets/gpt_dataset.py:712 (_get_num_epochs)"
WAITS = "waiting in barrier on ranks of the world, called from trainer/data.py:232 (build_datasets)"


def test_at_start_up_the_rank_still_computing_is_named_before_the_ones_waiting_for_it(tmp_path):
    """Every rank alive and none past start-up: rank 1 loops in Megatron's index builder while ranks 0
    and 2 wait for it in a barrier (an empty split); the line names rank 1 and what it is doing."""
    now = 1000.0
    records = [Progress(r, f"rank {r}", None, "start-up", 10.0 + r, 999, "h", 1, 1, BUSY if r == 1 else WAITS)
               for r in range(3)]
    assert stopped_first(records, now, silent_after_s=5).rank == 1
    store = dist.FileStore(str(tmp_path / "store"), 3)
    boards = [ProgressBoard(store, r, 3) for r in range(3)]
    for record, board in zip(records, boards):
        board.publish(record.description, None, "start-up", time.time() - 60, record.doing)
    watchdog = Watchdog(600, "rank 0", poll_s=0.2, board=boards[0])
    try:
        watchdog.enter("start-up", 60)
        line = watchdog.hang_line(61, watchdog._stopped_first())
    finally:  # entering armed faulthandler's backstop, which would end this process 90 s later
        watchdog.stop()
    assert re.fullmatch(r"hang detected: rank 1 is still busy \(start-up for 6\d s: in megatron/core/datasets/"
                        r"gpt_dataset\.py:712 \(_get_num_epochs\)\); rank 0 made no progress for 61 s during "
                        r"start-up before the first step: not running", line), line


def test_the_start_up_limit_defaults_to_a_floor_plus_a_term_per_prefix_and_per_byte_of_data(tmp_path):
    sizes = {"a": 25_000_000, "b": 5_000_000}
    for name, size in sizes.items():
        (tmp_path / f"{name}.idx").write_bytes(b"")
        with open(tmp_path / f"{name}.bin", "wb") as f:
            f.truncate(size)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    blend = DataConfig(data_path=("1", a, "2", b), valid_data_path=(a,))  # a prefix counts once
    assert startup_timeout_s(blend) == \
        STARTUP_FLOOR_S + 2 * STARTUP_S_PER_PREFIX + sum(sizes.values()) / STARTUP_BYTES_PER_S
    assert startup_timeout_s(DataConfig(data_path=(b,))) == \
        STARTUP_FLOOR_S + STARTUP_S_PER_PREFIX + sizes["b"] / STARTUP_BYTES_PER_S
    assert startup_timeout_s(DataConfig(data_path=(b,))) < 600  # minutes, not an hour


def test_a_board_round_trips_records_and_the_alarm(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    boards = [ProgressBoard(store, r, 2) for r in range(2)]
    assert boards[0].read() == [] and boards[0].alarm() is None
    boards[1].publish("rank 1 (worker 0)", 7, "resume", 123.0)
    (record,) = boards[0].read()
    assert (record.rank, record.description, record.step, record.phase, record.advanced_at) == \
        (1, "rank 1 (worker 0)", 7, "resume", 123.0)
    assert (record.pid, record.parent_pid) == (os.getpid(), os.getppid())
    store.set("rank/0", "{not json")  # a half-written or foreign record is skipped, not fatal
    assert [r.rank for r in boards[1].read()] == [1]
    boards[1].raise_alarm("rank 1 (worker 0)")
    assert boards[0].alarm() == "rank 1 (worker 0)"


RANK = textwrap.dedent("""
    import sys, time
    import torch.distributed as dist
    from trainer.progress_board import ProgressBoard
    from trainer.watchdog import Watchdog
    path, rank, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    board = ProgressBoard(dist.FileStore(path, 3), rank, 3)
    w = Watchdog(timeout, f"rank {rank}", poll_s=0.2, board=board)
    with w.watching("start-up", timeout):
        w.enter("training", timeout)
        w.pet(5)
        print("stepping", flush=True)
        time.sleep(120)
""")


def _rank(tmp_path, rank: int, timeout_s: float) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "store"), str(rank), str(timeout_s)],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert process.stdout.readline() == "stepping\n"
    return process


@pytest.mark.launch
def test_the_firing_rank_names_the_stopped_one_and_the_whole_job_ends(tmp_path):
    stopped, waiting = _rank(tmp_path, 1, 60), _rank(tmp_path, 2, 60)  # would wait a minute on their own
    try:
        time.sleep(0.5)  # both have published
        os.kill(stopped.pid, signal.SIGSTOP)
        firing = _rank(tmp_path, 0, 2.5)
        started = time.monotonic()
        assert firing.wait(timeout=30) == HANG_EXIT_CODE
        line = firing.stderr.read().strip()
        assert re.fullmatch(r"hang detected: rank 1 stopped first \(training after step 5, silent for \d+ s\); "
                            r"rank 0 made no progress for 3 s after step 5: in <string>:\d+ \(<module>\)", line), line
        assert stopped.wait(timeout=10) == -signal.SIGKILL  # a sibling of the same parent, stopped: killed
        assert waiting.wait(timeout=10) == HANG_EXIT_CODE
        assert time.monotonic() - started < 10
        assert waiting.stderr.read().strip() == "stopping: rank 0 detected a hang (see its line); every rank exits"
    finally:
        for process in (stopped, waiting):
            process.kill()
            process.wait()


@pytest.mark.launch
def test_start_up_is_watched_with_its_own_timeout(tmp_path):
    script = ("import time\nfrom trainer.watchdog import Watchdog\n"
              "w = Watchdog(100, 'rank 3', poll_s=0.05)\n"
              "with w.watching('start-up', 0.5):\n    time.sleep(30)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert result.returncode == HANG_EXIT_CODE
    assert re.fullmatch(r"hang detected: rank 3 made no progress for 1 s during start-up before the first step: "
                        r"in <string>:5 \(<module>\)", result.stderr.strip()), result.stderr
