"""Shared test fixtures: repository paths and the sample corpus shipped in `corpus/`."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO_ROOT / "corpus" / "shakespeare"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """The Nemotron-CC-layout sample corpus (train/ and valid/ folders of .jsonl.zstd shards)."""
    return SAMPLE_CORPUS
