"""The README's Usage block is a chain a new user can run top to bottom: each step reads what an earlier
one wrote (tokenizer -> data -> trained checkpoint -> export -> samples -> import -> continued training ->
export back), then the planner.

The block is taken from README.md as it stands and run by `bash -e` in a folder that stands for the
checkout (the repository's files linked in, nothing the block writes), on the sample corpus placed where
the block reads Nemotron-CC input files. Only its sizes change, by the textual replacements of TINY below, each
of which must match (a README edit that drops a knob fails here, instead of launching 8 ranks of the 150m
model). Nothing else is replaced: a step whose input no earlier step writes stops the chain and fails
the test."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from tools.trainer_runs import launch_port
from tools.trainer_runs import EXTENSIONS_ENV

README = REPO_ROOT / "README.md"
# (pattern, replacement, why): the tiny sizes a test can afford, on one CPU rank.
TINY = [
    (r"--num_gpus 8", "--num_gpus 1 --master_port {port}", "one CPU rank, on a port of its own"),
    (r"ds_configs/gpu_150m_muloco_k1\.json", "ds_configs/cpu_tiny_muon.json",
     "a CPU config (the GPU one is planned for 8 ranks in bf16 and the 150m model)"),
    (r"--model 150m", "--model tiny", "the tiny preset"),
    (r"--train-iters 10000", "--train-iters 2", "two steps per run"),
    (r"--vocab-size 32000", "--vocab-size 1024", "a vocabulary the sample corpus fills"),
    (r"--processes 16", "--processes 1", "one preprocessing process"),
    (r"(?m)^python tools/compare_methods\.py .*$", "# (the method comparison: tests/test_compare_*.py)",
     "the comparison trains several runs: minutes"),
]
# What the chain leaves behind, step by step (relative to the checkout).
ARTIFACTS = [
    "tok/spm.model", "data/cc_text_document.bin", "data/cc_text_document.idx", "ckpt/150m/latest",
    "hf/150m/config.json", "hf/150m/tokenizer.json", "ckpt/150m-imported/latest", "ckpt/150m-continued/latest",
    "hf/150m-continued/config.json",
]
# Paths the block reads that no step writes: the user's corpus and the repository's own files.
GIVEN = ("data/nemotron-cc", "ds_configs/", "trainer/", "tools/", "tok/llama3/", "hf/Qwen3-8B")
# Flags naming what a command reads, and what it writes.
READS = ("--input", "--load", "--from-hf", "--data-path", "--tokenizer-model", "--model", "--ds_config")
WRITES = ("--save", "--output-prefix", "--out")
TIMEOUT_S = 420  # under pytest-timeout's 600 s (setup.cfg), so this test kills its own launches first


def usage_block(readme: str) -> str:
    """The first ```bash block after the `## Usage` heading."""
    section = readme.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "README.md's Usage section has no ```bash block"
    return match.group(1)


def tiny(block: str) -> str:
    for pattern, replacement, why in TINY:
        block, count = re.subn(pattern, lambda _: replacement.format(port=launch_port()), block)
        assert count, f"README.md's Usage block no longer has {pattern!r} ({why}): update TINY in this test"
    return block


def commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists (continuation lines joined, comments dropped)."""
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_step_reads_what_an_earlier_step_wrote():
    """The chain checked without running it: every path a command reads is written by an earlier
    command (a --save, an --output-prefix and its files) or given (the corpus, the repository)."""
    written: list[str] = []
    unchained = []
    for argv in commands(usage_block(README.read_text())):
        for arg, value in zip(argv, argv[1:]):
            if arg in READS and "/" in value:  # --model 150m names a preset, --model hf/150m a folder
                if not (value.startswith(GIVEN) or any(_written_by(value, w) for w in written)):
                    unchained.append(f"{' '.join(argv[:3])} ... {arg} {value}")
        written += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in WRITES]
    assert unchained == [], "read before any step writes it: " + "; ".join(unchained)


def _written_by(path: str, written: str) -> bool:
    """`path` is what a --save or --output-prefix `written` wrote: the folder, a file in it, or the prefix's
    files (tok/spm -> tok/spm.model, data/cc -> data/cc_text_document)."""
    return path == written or (path.startswith(written) and path[len(written)] in "/._")


def _checkout(folder: Path, corpus: Path) -> None:
    """`folder` as a checkout the block runs in: the repository's files linked in, the sample corpus where
    the block reads Nemotron-CC input files, and the environment running the tests as .venv."""
    for entry in REPO_ROOT.iterdir():
        if entry.name not in {".git", ".venv", "data", "tok", "hf", "ckpt", "runs", "demo_data"}:
            (folder / entry.name).symlink_to(entry)
    (folder / "data").mkdir()
    (folder / "data" / "nemotron-cc").symlink_to(corpus)
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "activate").write_text(
        f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"\n")


@pytest.mark.trains
@pytest.mark.launch
def test_the_usage_block_runs_top_to_bottom(tmp_path, shakespeare):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _checkout(checkout, shakespeare)
    script = checkout / "usage.sh"
    script.write_text(tiny(usage_block(README.read_text())))
    env = {**os.environ, **EXTENSIONS_ENV, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    # bash -e: the first command that fails stops the chain; -x: the output says which one it was.
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-x", str(script)], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the Usage block did not finish in {TIMEOUT_S} s:\n{output[-8000:]}")
    assert proc.returncode == 0, f"the Usage block failed (exit {proc.returncode}):\n{output[-10000:]}"
    assert output.count("verify passed") == 3, output[-6000:]  # export, import, export back
    missing = [a for a in ARTIFACTS if not (checkout / a).exists()]
    assert missing == [], f"the chain did not write {missing}"
    print(f"Usage block: {time.perf_counter() - start:.0f} s")
