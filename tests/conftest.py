"""Shared test fixtures: repository paths and the sample corpus that CI lays beside the clone."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO_ROOT.parent / "shared" / "corpus" / "shakespeare"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """The Nemotron-CC-layout sample corpus (train/ and valid/ folders of .jsonl.zstd shards)."""
    if not SHARED_CORPUS.is_dir():
        pytest.fail(f"sample corpus not found at {SHARED_CORPUS}; CI copies ../shared beside the clone")
    return SHARED_CORPUS
