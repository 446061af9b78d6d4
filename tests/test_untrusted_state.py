"""What a worker or a run reads from others is parsed, never unpickled, and stays in its folder: a
pickled state from a quorum member is refused and runs nothing, the state's bytes round-trip and a
truncation is refused, no code outside the tests can unpickle what it reads (a walk over its syntax
tree), and a checkpoint's tokenizer path cannot leave the checkpoint's folder."""
from __future__ import annotations

import ast
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from muloco.core.rank_file import RankFileError, state_from_bytes, state_to_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]


class _CreatesMarker:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_state_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(RankFileError, match="not a state in safetensors format"):
        state_from_bytes(pickle.dumps({"global_weights": _CreatesMarker(marker)}), "the state from quorum member 1")
    assert not marker.exists()


def test_state_bytes_round_trip_and_truncations_are_refused():
    state = {"outer_step": 3, "skipped": 0, "step": 12, "global_weights": {"w": torch.randn(4, 5)},
             "momentum": {"w": torch.zeros(4, 5)}, "scheduler": {"last_epoch": 12, "lr_lambdas": [None]}}
    data = state_to_bytes(state)
    back = state_from_bytes(data, "x")
    assert torch.equal(back["global_weights"]["w"], state["global_weights"]["w"]) and back["step"] == 12
    for cut in (0, 7, 9, len(data) // 2, len(data) - 1):
        with pytest.raises(RankFileError):
            state_from_bytes(data[:cut], "x")


CODE_DIRS = ("trainer", "tools", "dataprep", "tokenizer", "megatron_patches", "scripts", "benchmarks")


def test_nothing_in_the_project_can_unpickle_what_it_reads():
    """No pickle import, no torch.load without weights_only=True, no torchft Manager left with its
    default (HTTP, pickling) checkpoint transport, anywhere outside the tests."""
    problems = []
    for path in sorted(p for d in CODE_DIRS for p in (REPO_ROOT / d).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(REPO_ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names):
                    problems.append(f"{where}:{node.lineno} imports a pickler")
                if any(n == "HTTPTransport" for n in names):
                    problems.append(f"{where}:{node.lineno} imports torchft's HTTPTransport")
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                keywords = {k.arg: k.value for k in node.keywords}
                if name.endswith("torch.load") or name == "load" and "weights_only" in keywords:
                    value = keywords.get("weights_only")
                    if not (isinstance(value, ast.Constant) and value.value is True):
                        problems.append(f"{where}:{node.lineno} torch.load without weights_only=True")
                if name in ("Manager", "torchft.Manager") and "checkpoint_transport" not in keywords:
                    problems.append(f"{where}:{node.lineno} torchft Manager with its default checkpoint transport")
                if name.endswith(("np.load", "numpy.load")) and isinstance(keywords.get("allow_pickle"), ast.Constant) \
                        and keywords["allow_pickle"].value:
                    problems.append(f"{where}:{node.lineno} numpy.load(allow_pickle=True)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["../../outside/secret.model", "/etc/passwd", "sub/../../x.model", "link.model"])
def test_a_checkpoint_whose_tokenizer_path_leaves_its_folder_is_refused(tmp_path, name):
    from trainer.checkpoint import CheckpointReader
    from trainer.checkpoint.format import CheckpointError

    folder = tmp_path / "ckpt" / "iter_0000010"
    folder.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.model").write_text("secret")
    (folder / "link.model").symlink_to(tmp_path / "outside" / "secret.model")
    (folder / "tokenizer.model").write_text("ours")
    reader = CheckpointReader.__new__(CheckpointReader)
    reader.directory, reader.meta = folder, SimpleNamespace(tokenizer_model=name)
    with pytest.raises(CheckpointError, match="is not a file in the checkpoint's folder"):
        reader.tokenizer_path
    reader.meta = SimpleNamespace(tokenizer_model="tokenizer.model")
    assert reader.tokenizer_path.read_text() == "ours"
