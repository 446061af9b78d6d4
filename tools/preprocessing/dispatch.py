"""Handing chunks to the tokenizing processes, a bounded number at a time, and publishing each finished chunk's
part (its .idx written here, by Megatron's code, which this process imports beside the first chunks)."""
from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Self

import numpy as np

from dataprep.chunks import Chunk
from dataprep.index_code import load_index_code
from dataprep.parts import ChunkStats, publish_part
from dataprep.progress import ProgressLine
from tools.preprocessing.config import PreprocessConfig
from tools.preprocessing.tokenize_worker import StrictModeError, init_process, tokenize_chunk

CHUNKS_IN_FLIGHT_PER_PROCESS = 2  # bounds the decompressed bytes held for the processes


def _input_order(chunk: Chunk) -> tuple[int, int]:
    return chunk.file_index, chunk.index


@dataclass(frozen=True)
class _Part:
    """Where a chunk handed out goes, and once tokenized, what its .idx needs."""

    chunk: Chunk
    prefix: str
    fingerprint: str
    stats: ChunkStats | None = None
    lengths: list[int] | None = None


class ChunkDispatcher:
    """Hands chunks to the process pool, a bounded number at a time, publishes each finished one's part (its .idx
    written here, by Megatron's code) and reports it."""

    def __init__(self, config: PreprocessConfig, dtype: type[np.number], on_done: Callable[[Chunk, ChunkStats], None],
                 progress: ProgressLine):
        # fork: the processes inherit the already-imported tokenizer modules for free.
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        self._progress_queue = context.Queue()
        self._pool = ProcessPoolExecutor(max_workers=config.processes, mp_context=context,
                                         initializer=init_process, initargs=(config, self._progress_queue))
        self._dtype = dtype
        self._max_in_flight = CHUNKS_IN_FLIGHT_PER_PROCESS * config.processes
        self._in_flight: dict[Future, _Part] = {}
        # Megatron's .idx code (about the cost of `import torch`: dataprep.index_code) is imported by a thread while
        # the first chunks are tokenized, on a core the processes leave (or beside them); their parts wait for it in
        # _unpublished.
        self._index_code: threading.Thread | None = None
        self._unpublished: list[_Part] = []
        self._on_done = on_done
        self._progress = progress
        self.new_stats: list[ChunkStats] = []
        self._reported: StrictModeError | None = None  # the strict error _collect raised, already the first
        self.first_submit: float | None = None
        self.last_done: float | None = None

    def submit(self, chunk: Chunk, payload: bytes | None, fingerprint: str, prefix: str) -> None:
        while len(self._in_flight) >= self._max_in_flight:
            self._collect()
        if self.first_submit is None:
            self.first_submit = time.monotonic()
        self._in_flight[self._pool.submit(tokenize_chunk, chunk, payload, prefix)] = _Part(chunk, prefix, fingerprint)
        if self._index_code is None:  # after the first submit: the pool's processes are forked, none mid-import
            self._index_code = threading.Thread(target=load_index_code, name="load-index-code", daemon=True)
            self._index_code.start()

    def finish(self) -> None:
        while self._in_flight:
            self._collect()
        self._publish()

    def _collect(self) -> None:
        done, _ = wait(self._in_flight, timeout=0.2, return_when=FIRST_COMPLETED)
        while not self._progress_queue.empty():
            self._progress.add_tokens(self._progress_queue.get())
        for future in sorted(done, key=lambda f: _input_order(self._in_flight[f].chunk)):
            part = self._in_flight.pop(future)
            try:
                stats, lengths = future.result()
            except StrictModeError as error:
                self._reported = self.first_bad_record(error, _input_order(part.chunk))
                raise self._reported from None
            self._unpublished.append(replace(part, stats=stats, lengths=lengths))
            self.last_done = time.monotonic()
        if not self._index_code.is_alive():
            self._publish()
        self._progress.maybe_print()

    def _publish(self, report: bool = True) -> None:
        """Publish the parts tokenized so far (once Megatron's .idx code is imported); `report` them to on_done."""
        if self._index_code is not None:
            self._index_code.join()
        parts, self._unpublished = self._unpublished, []
        for part in parts:
            publish_part(part.prefix, self._dtype, part.lengths, part.stats, part.fingerprint)
            if report:
                self.new_stats.append(part.stats)
                self._on_done(part.chunk, part.stats)

    def first_bad_record(self, error: StrictModeError, order: tuple[int, int] | None = None) -> StrictModeError:
        """--strict stops at the first bad record in input order, but the chunks finish in any order: the
        earliest strict error among the chunks in flight before `order` (None: all of them; chunks are
        handed out in input order, so no chunk before it is still to come), else `error`."""
        earlier = sorted((f for f, part in self._in_flight.items()
                          if order is None or _input_order(part.chunk) < order),
                         key=lambda f: _input_order(self._in_flight[f].chunk))
        wait(earlier)
        return next((f.exception() for f in earlier if isinstance(f.exception(), StrictModeError)), error)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if isinstance(exc, StrictModeError) and exc is not self._reported:  # the planner's: after every chunk
                first = self.first_bad_record(exc)
                if first is not exc:
                    raise first from None
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            if exc is not None:  # the chunks that finished, published all the same: the rerun reuses them
                for future, part in self._in_flight.items():
                    if future.done() and not future.cancelled() and future.exception() is None:
                        stats, lengths = future.result()
                        self._unpublished.append(replace(part, stats=stats, lengths=lengths))
                self._publish(report=False)
