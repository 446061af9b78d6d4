"""Trust under faults: a crafted rank file runs nothing, a flipped byte is caught, a full disk fails
in one line with the previous checkpoint intact, a frozen rank ends the job with a `hang detected:`
line, and bad data or output folders stop the run before it starts. (SIGTERM preemption with an exact
resume is in test_checkpoint's MuLoCo test, which shares its launches.)"""
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _ckpt_runs import REPO_ROOT, Launch, launch, reference_checkpoint

from trainer.checkpoint import CheckpointError, CheckpointReader, latest_iteration
from trainer.checkpoint.checkpointer import FAIL_ENV
from trainer.checkpoint.format import prune, rank_file
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from trainer.config import DataConfig
from muloco.core.errors import ConfigError

pytestmark = pytest.mark.timeout(900)
HANG_TIMEOUT_S = 10


def _checkpoint_copy(base: Path, dst: Path, step: int = 6) -> Path:
    shutil.copytree(reference_checkpoint(base) / "ckpt" / f"iter_{step:07d}", dst / f"iter_{step:07d}")
    (dst / "latest").write_text(f"{step}\n")
    return dst


def _convert(ckpt: Path, out: Path, *flags: str, capsys) -> tuple[int, str]:
    """`python -m tools.convert_checkpoint` in this process: (exit code, stderr)."""
    from tools.convert_checkpoint.__main__ import main

    code = main(["--load", str(ckpt), "--save", str(out), *flags])
    return code, capsys.readouterr().err


class _CreatesMarker:
    """Unpickling this calls open(marker, "w"): a stand-in for os.system in a crafted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.mark.launch
def test_a_crafted_pickle_in_place_of_a_rank_file_runs_nothing(base, tmp_path, capsys):
    ckpt = _checkpoint_copy(base, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    victim = rank_file(ckpt / "iter_0000006", 0)
    victim.write_bytes(pickle.dumps({"model": _CreatesMarker(marker)}))
    with pytest.raises(CheckpointError, match=f"rank file {victim} is damaged"):
        CheckpointReader(ckpt).rank_state(0)
    with pytest.raises(CheckpointError, match=f"rank file {victim} is not a checkpoint rank file in safetensors"):
        CheckpointReader(ckpt, verify_checksums=False).rank_state(0)
    code, err = _convert(ckpt, tmp_path / "hf", "--no-verify-checksums", capsys=capsys)  # the exporter's reads
    assert code == 2 and f"checkpoint error: rank file {victim} is not a checkpoint rank file" in err, err
    assert not marker.exists(), "reading the checkpoint ran code"

    # An old-format (pickled) checkpoint is refused by its meta.json, before any rank file is opened.
    meta = json.loads((ckpt / "iter_0000006" / "meta.json").read_text())
    (ckpt / "iter_0000006" / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(CheckpointError, match="unpickling can run code"):
        CheckpointReader(ckpt)
    assert not marker.exists()


@pytest.mark.launch
def test_a_flipped_byte_inside_tensor_data_is_caught(base, tmp_path, capsys):
    ckpt = _checkpoint_copy(base, tmp_path / "ckpt")
    path = rank_file(ckpt / "iter_0000006", 1)
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x10  # inside the last tensors' bytes: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"rank file {path} is damaged: its SHA-256 is"):
        CheckpointReader(ckpt).rank_state(1)
    CheckpointReader(ckpt, verify_checksums=False).rank_state(1)  # unchecked, it loads: the damage is silent
    code, err = _convert(ckpt, tmp_path / "hf", capsys=capsys)
    assert code == 2 and f"checkpoint error: rank file {path} is damaged" in err, err


def test_rank_files_round_trip_and_are_plain_safetensors(tmp_path):
    import random

    import numpy as np
    from safetensors.torch import load_file

    state = {"model": {"w": torch.randn(3, 5), "h": torch.randn(4, dtype=torch.bfloat16)},
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
             "groups": [{"betas": (0.9, 0.99), "kind": "muon", "nesterov": False}], "by_index": {3: None}}
    path = tmp_path / "r.safetensors"
    with open(path, "wb") as f:
        write_rank_file(f, state)
    assert len(load_file(path)) == 4  # w, h, numpy state, torch state: safetensors itself reads them
    back = to_plain(read_rank_file(path))
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["model"]["h"].dtype == torch.bfloat16
    assert back["rng"]["python"] == state["rng"]["python"] and back["groups"] == state["groups"]
    assert (back["rng"]["numpy"][1] == state["rng"]["numpy"][1]).all() and back["rng"]["numpy"][1].dtype == np.uint32
    assert back["by_index"] == {3: None}
    with open(tmp_path / "x", "wb") as f, pytest.raises(TypeError, match="got object"):
        write_rank_file(f, {"bad": object()})


def test_keep_last_prunes_old_complete_checkpoints_but_never_latest(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"iter_{step:07d}").mkdir()
        (tmp_path / f"iter_{step:07d}" / "complete").write_text("")
    (tmp_path / "iter_0000010").mkdir()  # a save in progress: not complete, not counted
    (tmp_path / "latest").write_text("4\n")  # e.g. resumed from 4 while newer iterations exist
    assert prune(tmp_path, keep_last=2) == [2]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000006", "iter_0000008",
                                                               "iter_0000010"]


def test_keep_last_keeps_the_checkpoint_of_the_best_validation_loss(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"iter_{step:07d}").mkdir()
        (tmp_path / f"iter_{step:07d}" / "complete").write_text("")
    (tmp_path / "latest").write_text("8\n")
    # step 6's is unknown yet (its evaluation follows its save), 10 has no checkpoint
    assert prune(tmp_path, keep_last=1, val_losses={2: 3.1, 4: 2.9, 8: 3.0, 10: 1.0}) == [2, 6]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000008"]


@pytest.mark.launch
def test_a_full_disk_on_one_rank_fails_in_one_line_and_keeps_the_previous_checkpoint(base, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = launch(base, 2, tmp_path / "run", "--save", str(ckpt), "--save-interval", "2",
                    env={FAIL_ENV: f"4:1:{errno.ENOSPC}"})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    lines = [line for line in output.splitlines() if "checkpoint error" in line]
    expected = (f"checkpoint error: could not save step 4 in {ckpt / 'iter_0000004'}: rank 1: [Errno 28] No space "
                f"left on device (1 of 2 ranks failed); temporary files removed, {ckpt / 'latest'} still names step 2")
    assert lines == [expected], output[-4000:]
    assert f'File "{REPO_ROOT / "trainer"}' not in output, "a rank ended in a traceback"
    assert latest_iteration(ckpt) == 2 and not (ckpt / "iter_0000004").exists()
    assert not list(ckpt.glob("**/*.tmp.*"))
    reader = CheckpointReader(ckpt)
    assert all(reader.rank_state(r)["step"] == 2 for r in range(2))


@pytest.mark.launch
def test_a_frozen_rank_ends_the_job_with_a_hang_line(base, tmp_path):
    run = Launch(base, 2, tmp_path / "run", "--hang-timeout-s", str(HANG_TIMEOUT_S), train_iters=100_000)
    try:
        run.wait_for("[3/")
        os.kill(run.rank_pid(1), signal.SIGSTOP)
        stopped = time.monotonic()
        code = run.finish(timeout_s=HANG_TIMEOUT_S + 90)
        elapsed = time.monotonic() - stopped
    finally:
        run.kill()
    assert code not in (0, None, -signal.SIGKILL), run.output[-4000:]
    # Within 10 s of the detection (which comes HANG_TIMEOUT_S after rank 0's last step), not after the
    # launcher's 30 s grace for the stopped rank, which cannot act on its SIGTERM.
    assert elapsed < HANG_TIMEOUT_S + 10, f"the job took {elapsed:.0f} s to exit"
    hang = [line for line in run.output.splitlines() if line.startswith("hang detected:")]
    assert len(hang) == 1, run.output[-4000:]
    assert re.match(r"hang detected: rank 1 \(worker 0, data 1, pipeline 0, tensor 0\) stopped first \(training"
                    r"( after step \d+)?, silent for \d+ s\); rank 0 \(worker 0, data 0, pipeline 0, tensor 0\) made no "
                    r"progress for \d+ s after step \d+: waiting in \w+ on ranks \[0, 1\], called from trainer/",
                    hang[0]), hang[0]
    print(hang[0])  # shown with -s: what an operator sees


@pytest.mark.launch
def test_the_watchdog_names_where_a_stuck_thread_waits(tmp_path):
    script = ("import time\nfrom trainer.watchdog import Watchdog\n"
              "w = Watchdog(0.5, 'rank 7', poll_s=0.05)\nw.start()\nw.pet(4)\ntime.sleep(30)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    from trainer.watchdog import HANG_EXIT_CODE

    assert result.returncode == HANG_EXIT_CODE
    assert re.match(r"hang detected: rank 7 made no progress for \d+ s after step 4: in <string>:6 \(<module>\)$",
                    result.stderr.strip()), result.stderr


def test_the_hang_line_names_the_collective_past_logging_wrappers_and_its_caller():
    import threading

    from trainer.watchdog import describe_wait

    # Stand-ins for torch's collective and the decorator that logs around it, in files named like torch's.
    namespace = {"released": threading.Event()}
    for source, file in (("def all_reduce(tensor, group=None):\n    released.wait(30)\n", "distributed_c10d.py"),
                         ("def wrapper(*args, **kwargs):\n    return all_reduce(*args, **kwargs)\n", "c10d_logger.py")):
        code = compile(source, os.path.join("site-packages", "torch", "distributed", file), "exec")
        exec(code, namespace)  # noqa: S102 - our own source, under torch's file names
    # ... called through another package's decorator (typing_extensions' deprecation wrapper).
    exec(compile("def deprecated_wrapper(*args):\n    return wrapper(*args)\n",  # noqa: S102
                 os.path.join("site-packages", "typing_extensions.py"), "exec"), namespace)

    def reduce_loss():
        namespace["deprecated_wrapper"](torch.zeros(1))

    thread = threading.Thread(target=reduce_loss)
    thread.start()
    try:
        time.sleep(0.2)
        line = describe_wait(sys._current_frames()[thread.ident])
    finally:
        namespace["released"].set()
        thread.join()
    expected_caller = f"tests/test_faults.py:{reduce_loss.__code__.co_firstlineno + 1} (reduce_loss)"
    assert line == f"waiting in all_reduce on ranks of the world, called from {expected_caller}"


def _data_with_meta(tmp_path: Path, max_token_id: int, **meta) -> str:
    """Ten documents whose largest token id is `max_token_id`, with the .meta.json preprocessing writes."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "cc_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(10):
        builder.add_document(torch.arange(100) + max_token_id - 99, [100])
    builder.finalize(f"{prefix}.idx")
    prefix.with_name(prefix.name + ".meta.json").write_text(json.dumps(
        {"documents": 10, "tokens": 1000, "vocab_size": 2000, "tokenizer_sha256": "0" * 64,
         "max_token_id": max_token_id, **meta}))
    return str(prefix)


def test_data_that_does_not_fit_the_tokenizer_is_refused_before_start(shakespeare, tmp_path):
    from tokenizer.identity import tokenizer_identity
    from tokenizer.interface import load_tokenizer
    from tokenizer.train import TokenizerTrainingConfig, train_tokenizer
    from trainer.data import check_data

    prefix = _data_with_meta(tmp_path, max_token_id=1500)
    check_data(DataConfig(data_path=[prefix], vocab_size=2000))
    with pytest.raises(ConfigError, match=(rf"^{prefix}.bin: the data holds token id 1500, but the vocabulary "
                                           r"of --vocab-size has only 1000 ids")):
        check_data(DataConfig(data_path=[prefix], vocab_size=1000))

    corpus = shakespeare / "train"
    spm = train_tokenizer(TokenizerTrainingConfig(inputs=(str(corpus),), output_prefix=tmp_path / "spm",
                                                  vocab_size=400, max_chars=30_000, num_threads=1)).model_path
    with pytest.raises(ConfigError, match=rf"token id 1500, but the vocabulary of --tokenizer-model {spm} has only "
                                          r"400 ids"):
        check_data(DataConfig(data_path=[prefix], tokenizer_model=str(spm)))
    identity = tokenizer_identity(load_tokenizer(spm))
    check_data(DataConfig(data_path=[_data_with_meta(tmp_path, max_token_id=399, tokenizer_sha256=identity)],
                          tokenizer_model=str(spm)))
    file_digest = hashlib.sha256(Path(spm).read_bytes()).hexdigest()  # what data made before the identity records
    check_data(DataConfig(data_path=[_data_with_meta(tmp_path, max_token_id=399, tokenizer_sha256=file_digest)],
                          tokenizer_model=str(spm)))
    with pytest.raises(ConfigError, match=rf"tokenized with a tokenizer whose SHA-256 is {'0' * 64}, but "
                                          rf"--tokenizer-model {spm} has {identity}"):
        check_data(DataConfig(data_path=[_data_with_meta(tmp_path, max_token_id=399)], tokenizer_model=str(spm)))


def test_output_folders_that_cannot_be_written_are_refused_before_start(tmp_path, monkeypatch):
    from muloco.core.durable import check_writable_folder

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"--save {blocker}/ckpt: {blocker} is not a folder"):
        check_writable_folder(blocker / "ckpt", "--save")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == read_only else real_access(p, mode))
    with pytest.raises(ConfigError, match=f"--run-dir {read_only}/run would be created in {read_only}, which is not "
                                          "writable"):
        check_writable_folder(read_only / "run", "--run-dir")
    check_writable_folder(tmp_path / "new" / "run", "--run-dir")
    assert not (tmp_path / "new").exists()


def test_a_planted_pickle_in_the_data_index_cache_is_refused(tmp_path):
    import numpy as np

    from trainer.data import refuse_unsafe_index_cache

    cache = tmp_path / "data_cache"
    cache.mkdir()
    np.save(cache / "abc-GPTDataset-train-document_index.npy", np.arange(10, dtype=np.int32))
    refuse_unsafe_index_cache(cache)  # what Megatron writes passes
    marker = tmp_path / "pwned"
    planted = cache / "abc-GPTDataset-train-sample_index.npy"
    planted.write_bytes(pickle.dumps(_CreatesMarker(marker)))  # numpy.load(allow_pickle=True) would unpickle it
    with pytest.raises(ConfigError, match=f"data index cache file {planted} is not a plain .npy array"):
        refuse_unsafe_index_cache(cache)
    np.save(planted, np.array([_CreatesMarker(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match=f"data index cache file {planted} holds Python objects"):
        refuse_unsafe_index_cache(cache)
    assert not marker.exists()


def test_exit_interval_and_duration_stop_every_rank_after_the_same_step(monkeypatch):
    from types import SimpleNamespace

    from muloco.core import comm
    from trainer.preemption import Preemption

    def config(**changes):
        return SimpleNamespace(**{"exit_signal_handler": False, "exit_interval": None, "exit_duration_in_mins": None,
                                  "save": "ckpt", **changes})

    every_third = Preemption(config(exit_interval=3), checkpointer=None, is_logging_rank=False)
    assert [s for s in range(1, 10) if every_third.should_stop(s)] == [3, 6, 9]

    # The duration is each rank's own clock: the stop is agreed by a sum over the world, here a world
    # in which another rank already ran out of time while this one did not.
    sums = []
    monkeypatch.setattr(comm, "all_reduce", lambda t, **kw: sums.append(t.clone()) or t + torch.tensor([0.0, 1.0]))
    timed = Preemption(config(exit_duration_in_mins=60), checkpointer=None, is_logging_rank=False)
    assert timed.should_stop(5) == "--exit-duration-in-mins 60 reached"
    assert sums[-1].tolist() == [0.0, 0.0]
    timed.signalled = True
    assert timed.should_stop(6) == "SIGTERM received by 1 rank(s); --exit-duration-in-mins 60 reached"


def test_preemption_flags_need_a_save_folder():
    from trainer.config import build_parser, resolve

    args = build_parser().parse_args(["--ds_config", str(REPO_ROOT / "ds_configs" / "cpu_tiny_muon.json"),
                                      "--exit-signal-handler", "--keep-last", "0"])
    with pytest.raises(ConfigError, match=r"--keep-last must be >= 1, got 0; --exit-signal-handler save a checkpoint "
                                          r"before exiting: give --save DIR"):
        resolve(args, world_size=1)
