"""Shared test fixtures: repository paths and the sample corpus shipped in `corpus/`.

`--sample-corpus-only` runs just the tests that read the sample corpus (those requesting the
`shakespeare` fixture, directly or through another fixture): test_fresh_clone runs them in a clone
with nothing beside it, proving the repository carries everything they need."""
import os
import time
from pathlib import Path

import pytest

from trainer.diloco.auth import KEY_FILE_ENV, write_new_key

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO_ROOT / "corpus" / "shakespeare"


# DeepSpeed's CPU communication op keeps one shared-memory buffer per rank and launch in /dev/shm and
# never unlinks it (about 70 MB each); the suite's launches, killed ones included, would leave gigabytes.
SHARED_MEMORY = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def remove_deepspeed_shm_buffers():
    """At the end of the session, unlink the buffers this session's launches created."""
    started = time.time()
    yield
    for path in SHARED_MEMORY.glob("deepspeed_allreduce_buffer_*"):  # nothing where there is no /dev/shm
        try:
            if path.stat().st_mtime >= started:
                path.unlink()
        except FileNotFoundError:  # another process removed it first
            pass


@pytest.fixture(scope="session", autouse=True)
def job_secret(tmp_path_factory) -> Path:
    """Workers that talk need a job secret: the suite runs with one (authentication on, the default),
    in $MULOCO_AUTH_KEY_FILE for every run and launch it starts."""
    path = tmp_path_factory.mktemp("secret") / "job.key"
    write_new_key(path)
    previous = os.environ.get(KEY_FILE_ENV)
    os.environ[KEY_FILE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(KEY_FILE_ENV, None)
    else:
        os.environ[KEY_FILE_ENV] = previous


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """The Nemotron-CC-layout sample corpus (train/ and valid/ folders of .jsonl.zstd shards)."""
    return SAMPLE_CORPUS


def pytest_addoption(parser):
    parser.addoption("--sample-corpus-only", action="store_true",
                     help="run only the tests that read the sample corpus (the `shakespeare` fixture)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--sample-corpus-only"):
        return
    keep = [item for item in items if "shakespeare" in getattr(item, "fixturenames", ())]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
