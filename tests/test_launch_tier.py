"""The `launch` mark is kept honest (tests/launch_tier.py): an unmarked test cannot start a process,
however it tries, and a marked one can."""
import multiprocessing
import os
import subprocess
import sys

import pytest
from launch_tier import UnmarkedLaunch


def _fork():
    if os.fork() == 0:  # the guard let it through: the child must not go on running the suite
        os._exit(0)


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"]),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    _fork,
], ids=["subprocess", "multiprocessing", "fork"])
def test_an_unmarked_test_that_starts_a_process_fails_naming_the_mark(start):
    with pytest.raises(UnmarkedLaunch, match=r"test_an_unmarked_test.* starts a process: mark it @pytest\.mark\.launch"):
        start()


@pytest.mark.launch
def test_a_marked_test_starts_processes():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
