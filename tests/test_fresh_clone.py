"""A user who clones the repository has nothing beside it: the tests that read the sample corpus
pass in a fresh clone of the committed tree inside an empty folder (no ../shared, no data). Tests
that go on to launch a training run (marked `trains`) are left out there: past preprocessing they
read nothing of the corpus, and the main suite runs them."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = [pytest.mark.launch, pytest.mark.timeout(1500)]  # every test here starts processes


def test_sample_corpus_tests_pass_in_a_fresh_clone(tmp_path):
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "empty" / "clone"  # its parent holds nothing else
    clone.parent.mkdir()
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    assert not (clone.parent.parent / "shared").exists() and os.listdir(clone.parent) == ["clone"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--sample-corpus-only", "tests"],
        cwd=clone, env={**os.environ, "PYTHONPATH": str(clone)}, capture_output=True, text=True, timeout=1400)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 25 and "failed" not in summary, summary
