"""The progress line of a preprocessing run (or partition): plain lines a batch log keeps readable,
at most one per interval, with input files done, records and (decompressed) bytes read, tokens/s and an ETA
from the input bytes still to do. Records and bytes grow with every chunk, so a file that takes long (a
compressed one inflating far) still shows motion before it is done."""
from __future__ import annotations

import sys
import time
from typing import TextIO

PROGRESS_INTERVAL_S = 30.0


class ProgressLine:
    def __init__(self, label: str, input_files: int, input_bytes: int, interval_s: float = PROGRESS_INTERVAL_S,
                 stream: TextIO = sys.stderr):
        self._label, self._input_files, self._input_bytes = label, input_files, input_bytes
        self._interval_s, self._stream = interval_s, stream
        self._start = time.monotonic()
        self._last_print = self._start
        self.files_done = self._bytes_done = self._bytes_this_run = self.tokens = 0
        self.records = self.read_bytes = 0  # of the chunks tokenized in this run

    def chunk_done(self, records: int, read_bytes: int) -> None:
        """A chunk tokenized: its records (lines, parquet rows) and the decompressed bytes they hold."""
        self.records += records
        self.read_bytes += read_bytes

    def add_tokens(self, tokens: int) -> None:
        self.tokens += tokens

    def file_done(self, size: int, reused: bool = False) -> None:
        """An input file finished (its size in bytes on disk); a reused one counts as done but not towards the rate."""
        self.files_done += 1
        self._bytes_done += size
        if not reused:
            self._bytes_this_run += size

    def maybe_print(self) -> None:
        if time.monotonic() - self._last_print >= self._interval_s:
            self.print()

    def print(self) -> None:
        now = time.monotonic()
        self._last_print = now
        seconds = max(now - self._start, 1e-9)
        remaining = self._input_bytes - self._bytes_done
        if remaining <= 0:
            eta = "0:00:00"
        elif self._bytes_this_run:
            eta = _clock(remaining * seconds / self._bytes_this_run)
        else:
            eta = "unknown"
        print(f"progress: {self._label}input files {self.files_done}/{self._input_files} "
              f"({self._bytes_done / 1e6:.1f} of {self._input_bytes / 1e6:.1f} MB), {self.records} records "
              f"({self.read_bytes / 1e6:.1f} MB decompressed), {self.tokens} tokens, {self.tokens / seconds:.0f} "
              f"tokens/s, ETA {eta}", file=self._stream, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
