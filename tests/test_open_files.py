"""A blend of more prefixes than the descriptor limit would let Megatron hold open (trainer/open_files.py):
checked, built and read, from scratch and from the index cache, every sample from the prefix Megatron's
BlendedDataset names, while the rank holds a bounded number of maps; Megatron's own builder fails under the
same limit. The soft limit is raised to the hard one and said once; a hard limit too low for reading data is
one line. (benchmarks/large_blend.py trains on 10,000 prefixes under `ulimit -n 1024`.)"""
from __future__ import annotations

import errno
import gc
import os
import resource

import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from tools.synthetic_data import write_numbered_datasets

from muloco.core.errors import ConfigError
from trainer import open_files
from trainer.config import DataConfig
from trainer.data import TokenizerInfo, build_datasets, check_data, run_blends
from trainer.file_limit import (MIN_OPEN_DATA_FILES, RESERVED_FILES, check_open_file_limit, data_file_capacity,
                                raise_open_file_limit)
from trainer.open_files import OpenFiles

PREFIXES = 200
SOFT_LIMIT = 180  # Megatron holds 3 descriptors per prefix: 600 for the blend
SEQ = 8


@pytest.fixture
def soft_limit(monkeypatch):
    """Lower the soft descriptor limit to `value` for the test (the hard one stays, so it can be restored).
    The garbage collector waits until the limit is back: Megatron's half-built datasets raise in their
    finalizers, and pytest's report of that opens files, which under the lowered limit fails the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(open_files, "_open_files", None)  # sized anew from the lowered limit

    def lower(value: int) -> None:
        gc.disable()
        resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))

    yield lower
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    gc.enable()
    gc.collect()  # Megatron's half-built datasets, and the descriptors they hold


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_blend_of_more_prefixes_than_the_limit_allows_open_builds_and_reads(tmp_path, soft_limit, process_group):
    prefixes = write_numbered_datasets(tmp_path / "data", PREFIXES)
    blend = tmp_path / "blend"
    blend.write_text("".join(f"1 {prefix}\n" for prefix in prefixes))
    data = DataConfig(data_args_path=str(blend), split="50,50,0", vocab_size=PREFIXES + 1)
    tokenizer = TokenizerInfo(PREFIXES + 1, 0)
    soft_limit(SOFT_LIMIT)
    before = _open_descriptors()
    check_data(data)
    run_blends(data, SEQ)
    cache = str(tmp_path / "cache")
    for build in ("from scratch", "from the cache"):  # the second maps Megatron's cached sample indices
        datasets = build_datasets(data, tokenizer, SEQ, seed=1, train_samples=2 * PREFIXES, valid_samples=PREFIXES,
                                  cache_dir=cache)
        for dataset in (datasets.train, datasets.valid):
            for index in range(len(dataset)):
                assert (dataset[index]["tokens"] == dataset.dataset_index[index] + 1).all(), (build, index)
            assert set(dataset.dataset_index.tolist()) == set(range(PREFIXES))  # every prefix was read
        assert len(open_files.open_files()) <= data_file_capacity(SOFT_LIMIT) < PREFIXES
        assert _open_descriptors() <= before + data_file_capacity(SOFT_LIMIT) + 8, build

    # Megatron's own datasets under the same limit: every prefix keeps its files open, past the limit.
    config = GPTDatasetConfig(blend=(prefixes, [1.0] * PREFIXES), split="50,50,0", random_seed=1, sequence_length=SEQ,
                              tokenizer=tokenizer, path_to_cache=str(tmp_path / "megatron_cache"),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    with pytest.raises(Exception) as refused:  # an OSError, or Megatron's own error for a cache it cannot write
        BlendedMegatronDatasetBuilder(GPTDataset, [2 * PREFIXES, PREFIXES, 0], lambda: True, config).build()
    chain = [refused.value]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    assert any(isinstance(error, OSError) and error.errno == errno.EMFILE for error in chain), chain
    del refused, chain


def test_the_set_of_maps_keeps_the_most_recently_read_and_makes_room_when_the_process_runs_out():
    opened = []

    def opener(path: str) -> list[str]:
        opened.append(path)
        return [path]

    files = OpenFiles(capacity=2)
    for path in ("a", "b", "a", "c", "a", "b"):
        assert files.get(path, opener) == [path]
    assert opened == ["a", "b", "c", "b"] and len(files) == 2  # b was evicted by c, a kept by being read

    def exhausted(path: str) -> list[str]:  # the rest of the process took what 10 maps had left
        if len(files) > 10:
            raise OSError(errno.EMFILE, "Too many open files")
        return [path]

    files = OpenFiles(capacity=100)
    for index in range(20):
        files.get(str(index), opener)
    assert files.get("new", exhausted) == ["new"]
    assert files.capacity == len(files) == 10  # half of what it held
    with pytest.raises(OSError, match="Permission denied"):
        files.get("other", lambda path: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied")))


def test_the_soft_limit_is_raised_to_the_hard_one_and_a_hard_limit_too_low_is_one_line(soft_limit):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_limit(64)
    needed = RESERVED_FILES + 2 * MIN_OPEN_DATA_FILES
    with pytest.raises(ConfigError, match=rf"^a blend of 600 prefixes needs ~{needed} open files per rank; ulimit -n "
                                          r"is 64 \(hard limit \S+\): raise the hard limit"):
        check_open_file_limit(600)
    assert raise_open_file_limit() == f"open files: raised the soft limit (ulimit -n) from 64 to the hard limit {hard}"
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    assert raise_open_file_limit() is None  # said once: nothing more to raise
    check_open_file_limit(600)
