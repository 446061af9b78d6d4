"""The suite's two tiers. A test that starts a process (a launcher and its ranks, a worker, a tool run
as a command) is marked `launch`; `pytest -m "not launch"` runs every other test, in process, in a
few minutes: the tier to run before each commit.

The marks are kept honest here rather than by hand: while an unmarked test sets up or runs, starting
a process fails it with a line naming the mark to add, so a launch cannot slip into the fast tier."""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

MARK = "launch"


class UnmarkedLaunch(AssertionError):
    pass


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARK}: starts processes (launchers, workers, commands); "
                                       f"`-m 'not {MARK}'` is the in-process tier")


@contextmanager
def _processes_refused(nodeid: str) -> Iterator[None]:
    def refuse(*args, **kwargs):
        raise UnmarkedLaunch(f"{nodeid} starts a process: mark it @pytest.mark.{MARK} (or its module's "
                             f"pytestmark) so that the in-process tier leaves it out")

    # Every way the suite starts a process: subprocess (and so the launchers), multiprocessing, a fork.
    targets = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
               (os, "fork"), (os, "posix_spawn")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item) -> Iterator[None]:
    if item.get_closest_marker(MARK) is not None:
        return (yield)
    with _processes_refused(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # a module's fixture that launches is set up here
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))
