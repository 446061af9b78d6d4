"""dataprep.index_code: Megatron's indexed_dataset module reached without megatron.core's `__init__` (checked by the
modules a fresh interpreter looks up, not with a clock), writing the same .idx as the ordinary import; the ordinary
import wherever the shortcut does not apply, with nothing of the shortcut left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from dataprep import index_code

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [5, 1, 33, 8]


def reference_idx(tmp_path: Path) -> bytes:
    """The .idx of documents LENGTHS long by Megatron's builder, imported the ordinary way (this process's)."""
    builder = IndexedDatasetBuilder(str(tmp_path / "reference.bin"), dtype=np.uint16)
    builder.sequence_lengths.extend(LENGTHS)
    builder.document_indices.extend(range(1, len(LENGTHS) + 1))
    builder.finalize(str(tmp_path / "reference.idx"))
    return (tmp_path / "reference.idx").read_bytes()


# In a fresh interpreter (this one holds megatron.core): `setup` runs, then load_index_code() (twice: one import),
# recording every megatron module looked up (so imported); then an .idx is written by dataprep's write_index, and the
# interpreter prints what it recorded and whether megatron.core is the real package once imported the ordinary way.
PROBE = """
import importlib, json, sys
looked_up = []

class Recorder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith("megatron"):
            looked_up.append(name)
        return None

sys.meta_path.insert(0, Recorder)
from dataprep import index_code
from dataprep.indexed_writer import write_index
import numpy as np
exec(sys.argv[1])
module = index_code.load_index_code()
assert index_code.load_index_code() is module
left = sorted(name for name in sys.modules if name.startswith("megatron.core"))
ordinary = importlib.import_module(index_code.INDEX_MODULE)
write_index(sys.argv[2], np.uint16, json.loads(sys.argv[3]))
print(json.dumps({"looked_up": looked_up, "left": left, "file": module.__file__, "ordinary": module is ordinary,
                  "real_package": hasattr(sys.modules["megatron.core"], "__version__")}))
"""


def probe(setup: str, idx: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, setup, str(idx), json.dumps(LENGTHS)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.launch
def test_the_shortcut_runs_megatrons_module_without_its_package_and_writes_the_same_idx(tmp_path: Path):
    imported = probe("", tmp_path / "shortcut.idx")
    assert imported["left"] == [], "the shortcut left modules of megatron.core behind"
    assert not imported["ordinary"], "the shortcut did not apply: the ordinary import ran"
    assert Path(imported["file"]).parts[-4:] == ("megatron", "core", "datasets", "indexed_dataset.py")
    before_ordinary = imported["looked_up"][:imported["looked_up"].index("megatron.core.datasets.indexed_dataset") + 1]
    assert {"megatron.core.utils", "megatron.core.parallel_state", "megatron.core.tensor_parallel"}.isdisjoint(
        before_ordinary), before_ordinary
    assert imported["real_package"], "megatron.core imported after the shortcut is not the whole package"
    assert (tmp_path / "shortcut.idx").read_bytes() == reference_idx(tmp_path)


@pytest.mark.launch
@pytest.mark.parametrize("setup", [
    "index_code.STAND_INS = {}",  # megatron.core.utils needs the package's import order: the shortcut fails
    "import megatron.core",  # the package is already there: the ordinary import costs nothing
])
def test_where_the_shortcut_does_not_apply_the_ordinary_import_runs(setup: str, tmp_path: Path):
    imported = probe(setup, tmp_path / "ordinary.idx")
    assert imported["ordinary"] and imported["real_package"]
    assert "megatron.core.parallel_state" in imported["left"]
    assert (tmp_path / "ordinary.idx").read_bytes() == reference_idx(tmp_path)


# The shortcut's rules on a package of its own shape: an `__init__` and a utils module that must not run, a module
# that imports one helper from utils (the helper defined elsewhere in the package), and modules the shortcut cannot
# vouch for.
FAKE_FILES = {
    "core/__init__.py": "raise RuntimeError('the package __init__ ran')",
    "core/utils.py": "raise RuntimeError('utils ran')",
    "core/_rank_utils.py": "def log_single_rank(*args, **kwargs):\n    pass",
    "core/datasets/__init__.py": "",
    "core/datasets/indexed.py": "from fakemegatron.core.utils import log_single_rank",
    "core/datasets/needs_more.py": "from fakemegatron.core.utils import log_single_rank, parallel_helper",
    "core/datasets/binds_a_module.py": "import fakemegatron.core._rank_utils\n"
                                       "from fakemegatron.core.utils import log_single_rank",
}


@pytest.fixture
def fake_megatron(tmp_path: Path, monkeypatch) -> Iterator[None]:
    for name, text in FAKE_FILES.items():
        (tmp_path / "fakemegatron" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fakemegatron" / name).write_text(text + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(index_code, "PACKAGE", "fakemegatron.core")
    monkeypatch.setattr(index_code, "STAND_INS", {"fakemegatron.core.utils": "fakemegatron.core._rank_utils"})
    yield
    for name in [name for name in sys.modules if name.startswith("fakemegatron")]:
        del sys.modules[name]


def fake_modules_left() -> list[str]:
    return sorted(name for name in sys.modules if name.startswith("fakemegatron.core"))


def test_the_shortcut_runs_neither_the_package_init_nor_utils_and_leaves_nothing(fake_megatron, monkeypatch):
    monkeypatch.setattr(index_code, "INDEX_MODULE", "fakemegatron.core.datasets.indexed")
    module = index_code.import_without_package_init()
    assert module is not None and module.__name__ == "fakemegatron.core.datasets.indexed"
    assert module.log_single_rank.__module__ == "fakemegatron.core._rank_utils"
    assert fake_modules_left() == []


@pytest.mark.parametrize("name", ["needs_more", "binds_a_module"])
def test_a_module_the_shortcut_cannot_serve_whole_gets_none_and_leaves_nothing(name: str, fake_megatron, monkeypatch):
    monkeypatch.setattr(index_code, "INDEX_MODULE", f"fakemegatron.core.datasets.{name}")
    assert index_code.import_without_package_init() is None
    assert fake_modules_left() == []


def test_an_imported_package_gets_none(fake_megatron, monkeypatch):
    monkeypatch.setitem(sys.modules, "fakemegatron.core", sys.modules[__name__])
    monkeypatch.setattr(index_code, "INDEX_MODULE", "fakemegatron.core.datasets.indexed")
    assert index_code.import_without_package_init() is None
