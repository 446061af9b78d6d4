"""Lines longer than a limit cut out of a byte stream as it passes, so that no reader ever holds more
than the limit of one line: a compressed line of gigabytes (a decompression bomb, a dump with no newlines)
costs a bad record, not the process. Each cut line leaves its newline behind, so the line numbers of the
lines after it, and the record count, stay those of the file.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

_NEWLINE = ord("\n")


class LineLimit:
    """Feed it a stream's bytes in order; it gives back the whole lines so far, each no longer than
    `max_bytes` (newline excluded), and reports the number of every longer one to `on_long_line`."""

    def __init__(self, max_bytes: int, on_long_line: Callable[[int], None], first_line: int = 1):
        self.max_bytes, self._report = max_bytes, on_long_line
        self.line = first_line  # the line the next byte fed belongs to
        self._held = bytearray()  # the start of that line, while it is within the limit
        self._cutting = False  # that line is over the limit (reported): its bytes are dropped

    def feed(self, data: bytes) -> bytes:
        if not self._cutting and len(self._held) + len(data) <= self.max_bytes:
            # No line that ends here can be over the limit: the usual case, without a scan.
            end = data.rfind(b"\n") + 1
            whole = bytes(self._held) + data[:end] if end else b""
            if end:
                self._held.clear()
                self.line += data.count(b"\n", 0, end)
            self._held += data[end:]
            return whole
        ends = np.flatnonzero(np.frombuffer(data, np.uint8) == _NEWLINE) + 1  # where each finished line stops
        starts = np.concatenate([[0], ends[:-1]])
        lengths = ends - starts - 1
        if len(ends):
            lengths[0] += len(self._held)
        too_long = np.flatnonzero(lengths > self.max_bytes)
        if self._cutting and len(ends) and (not len(too_long) or too_long[0] != 0):
            too_long = np.concatenate([[0], too_long])
        pieces, kept_from = [], 0
        for index in too_long.tolist():
            if not (index == 0 and self._cutting):
                self._report(self.line + index)
            pieces += [data[kept_from:starts[index]], b"\n"]
            kept_from = int(ends[index])
            if index == 0:
                self._held.clear()
        if len(ends):
            pieces.append(data[kept_from:ends[-1]])
            whole = bytes(self._held) + b"".join(pieces)
            self._held.clear()
            self._cutting = False
            self.line += len(ends)
        else:
            whole = b""
        tail = data[int(ends[-1]) if len(ends) else 0:]
        if not self._cutting:
            self._held += tail
            if len(self._held) > self.max_bytes:
                self._report(self.line)
                self._held.clear()
                self._cutting = True
        return whole

    def finish(self) -> bytes:
        """The last line, when the stream does not end with a newline (a cut one: its newline)."""
        last = b"\n" if self._cutting else bytes(self._held)
        self._held.clear()
        return last
