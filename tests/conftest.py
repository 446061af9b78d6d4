"""Shared test fixtures: repository paths and the sample corpus shipped in `corpus/`.

`--sample-corpus-only` runs just the tests that read the sample corpus (those requesting the
`shakespeare` fixture, themselves or through a fixture of their module) and launch no training run:
test_fresh_clone runs them in a clone with nothing beside it, proving the repository carries everything
they need."""
import os
from pathlib import Path

import pytest

from muloco.diloco.auth import KEY_FILE_ENV, write_new_key

# The `launch` mark and its check (tests/launch_tier.py); the Hugging Face models of the import tests,
# built once per session for every module using them (tests/hf_models.py).
pytest_plugins = ["launch_tier", "hf_models"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO_ROOT / "corpus" / "shakespeare"
# Every process the suite starts imports this checkout, whichever one the environment's editable
# install names (a second worktree sharing the venv): no script edits sys.path.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="session", autouse=True)
def remove_own_shared_memory_files():
    """DeepSpeed's CPU communication op keeps a ~70 MB /dev/shm file per rank; the trainer unlinks
    each as soon as every rank has mapped it, but a rank killed before that leaves its file. At the
    end of the session, remove those of this session's launches (named by their master ports), and
    nobody else's: other jobs may share this machine."""
    yield
    from tools.trainer_runs import LAUNCH_PORTS, shared_memory_files

    for port in LAUNCH_PORTS:
        for path in shared_memory_files(port):
            path.unlink(missing_ok=True)


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


@pytest.fixture
def process_group(tmp_path):
    """A world of one process (gloo): Megatron's BlendedDataset asks torch.distributed for the rank when it
    writes its cache."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    """The session's temporary root: the launched runs' dataset and reference run (tests/_ckpt_runs.py)
    are made there once and shared by every module."""
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """The sample corpus in Nemotron-CC form (train/ and valid/ folders of .jsonl.zstd files)."""
    return SAMPLE_CORPUS


def pytest_sessionstart(session):
    # On a machine where matplotlib has never run, its first import builds a font cache by running
    # fc-list: a process, which the in-process tier refuses inside whichever unmarked test plots first.
    import matplotlib.font_manager  # noqa: F401


def pytest_addoption(parser):
    parser.addoption("--sample-corpus-only", action="store_true",
                     help="run only the tests that read the sample corpus (the `shakespeare` fixture's users) "
                          "and launch no training run")


def _reads_the_sample_corpus(item) -> bool:
    """The test names the `shakespeare` fixture, or a fixture of its own module does. A test that
    reaches the corpus only through another module's fixture (a tokenizer trained on it) reads
    nothing more of it, so running it in the clone would add launches, not readers."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None or item.get_closest_marker("trains"):  # a training launch reads its prepared dataset
        return False
    if "shakespeare" in info.argnames:
        return True
    return any(defs[-1].func.__module__ == item.module.__name__ and "shakespeare" in defs[-1].argnames
               for defs in info.name2fixturedefs.values())


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--sample-corpus-only"):
        return
    keep = [item for item in items if _reads_the_sample_corpus(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
