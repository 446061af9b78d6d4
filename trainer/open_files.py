"""The data files a rank holds open: a bounded set of memory maps, shared by every dataset that reads them.

Megatron's IndexedDataset keeps its .idx and .bin mapped from construction on (three descriptors: the .bin's
open file and each map's own), and every GPTDataset loaded from the index cache (on each rank but the one that
built it) keeps its three sample indices mapped: a blend of thousands of prefixes holds tens of thousands of
descriptors and maps on every rank, past `ulimit -n` (1024 by default) and Linux's 65530 maps per process.
Here a file is mapped when read and kept in a least-recently-used set of at most `capacity` maps, half of
what the descriptor limit leaves after RESERVED_FILES; an evicted map is unmapped once no array refers to it,
and mapped again when next read. A blend that fits is held whole, as Megatron holds it; a larger one costs a
map for each read of an evicted file (microseconds, against a training step). At start-up the soft descriptor
limit is raised to the hard one, and a hard limit too low for even the fewest files read at once is one
line before anything is built.
"""
from __future__ import annotations

import errno
import mmap
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

from trainer.file_limit import MIN_OPEN_DATA_FILES, data_file_capacity
from trainer.indexed_files import IDX_FIELDS


class OpenFiles:
    """Memory maps by path, at most `capacity` of them, the least recently read evicted first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._maps: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # Megatron may build datasets in threads

    def get(self, path: str, opener: Callable[[str], Any]) -> Any:
        """The map of `path`, made by `opener(path)` unless held."""
        with self._lock:
            mapped = self._maps.get(path)
            if mapped is not None:
                self._maps.move_to_end(path)
                return mapped
        try:
            mapped = opener(path)
        except OSError as error:  # the rest of the process holds more than RESERVED_FILES: make room, once
            if error.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM) or not self._maps:
                raise
            with self._lock:
                self.capacity = max(MIN_OPEN_DATA_FILES, len(self._maps) // 2)
                self._evict()
            mapped = opener(path)
        with self._lock:
            self._maps[path] = mapped
            self._evict()
        return mapped

    def __len__(self) -> int:
        return len(self._maps)

    def _evict(self) -> None:
        while len(self._maps) > self.capacity:
            self._maps.popitem(last=False)


_open_files: OpenFiles | None = None


def open_files() -> OpenFiles:
    """This process's set, sized from the descriptor limit when first used (after `raise_open_file_limit`)."""
    global _open_files
    if _open_files is None:
        _open_files = OpenFiles(max(MIN_OPEN_DATA_FILES,
                                    data_file_capacity(resource.getrlimit(resource.RLIMIT_NOFILE)[0])))
    return _open_files


class _Index:
    """Megatron's _IndexReader, as IndexedDataset reads it, over one map of the .idx (checked at start-up by
    trainer/indexed_files.py; mapped here again after an eviction, so at the least cost)."""

    sequence_modes = None  # not a multimodal dataset

    def __init__(self, path: str):
        mapped = _map(path)
        _, _, code, sequences, documents = IDX_FIELDS.unpack_from(mapped)
        self.dtype = DType.dtype_from_code(code)
        self.sequence_count, self.document_count = sequences, documents
        self.sequence_lengths = np.frombuffer(mapped, np.int32, sequences, IDX_FIELDS.size)
        self.sequence_pointers = np.frombuffer(mapped, np.int64, sequences, IDX_FIELDS.size + 4 * sequences)
        self.document_indices = np.frombuffer(mapped, np.int64, documents, IDX_FIELDS.size + 12 * sequences)

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> tuple[np.int64, np.int32, None]:
        return self.sequence_pointers[idx], self.sequence_lengths[idx], None


class _Bin:
    """Megatron's _MMapBinReader over one map of the .bin (one descriptor, not its two)."""

    def __init__(self, path: str):
        self._data = _map(path)

    def read(self, dtype: type[np.number], count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._data, dtype=dtype, count=count, offset=offset)


def _map(path: str) -> mmap.mmap | bytes:
    """The file mapped read-only (its map holds one descriptor until unmapped); b"" for an empty one."""
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(handle.fileno()).st_size else b""


class MappedIndexedDataset(IndexedDataset):
    """Megatron's IndexedDataset whose .idx and .bin are mapped when read, through `open_files()`."""

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool, object_storage_config: Any,
                   fast_cache_load: bool = False, sequences_per_dataset: Any = None, dtype_code: Any = None) -> None:
        if multimodal or not mmap or object_storage_config is not None or fast_cache_load or sequences_per_dataset:
            raise ValueError("MappedIndexedDataset reads local, memory-mapped, single-modality data only")
        self.path_prefix, self.multimodal, self.mmap, self.object_storage_config = path_prefix, False, True, None
        self.fast_cache_load, self.sequences_per_dataset, self.dtype_code = False, None, None

    @property
    def index(self) -> _Index:
        return open_files().get(f"{self.path_prefix}.idx", _Index)

    @property
    def bin_reader(self) -> _Bin:
        return open_files().get(f"{self.path_prefix}.bin", _Bin)

    def __del__(self) -> None:
        """Nothing to close: the maps belong to `open_files()` (IndexedDataset's own deletes its attributes)."""


def _sample_index(name: str) -> property:
    """One of a GPTDataset's sample indices: the array built in memory, or, for one Megatron loaded as a
    memory map from its cache, the file's path, mapped through `open_files()` when read."""
    def get(dataset: MappedGPTDataset) -> np.ndarray:
        value = dataset.__dict__[name]
        return open_files().get(value, _load_sample_index) if isinstance(value, str) else value

    def put(dataset: MappedGPTDataset, value: np.ndarray) -> None:
        dataset.__dict__[name] = value.filename if isinstance(value, np.memmap) else value

    return property(get, put)


def _load_sample_index(path: str) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


class MappedGPTDataset(GPTDataset):
    """Megatron's GPTDataset, its prefix's files and its cached sample indices read through `open_files()`."""

    document_index = _sample_index("document_index")
    sample_index = _sample_index("sample_index")
    shuffle_index = _sample_index("shuffle_index")

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: Any) -> MappedIndexedDataset:
        return MappedIndexedDataset(dataset_path, mmap=config.mmap_bin_files)
