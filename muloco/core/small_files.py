"""Small files read whole (settings, blends, manifests, metadata): with a size cap, and JSON parsed to a
bounded depth, so that no input ends a process in MemoryError or RecursionError.

A cap is read, not trusted from the file's size: `/dev/zero`, a FIFO or a file still growing stops at it.
Python's JSON parser recurses once per nesting level, so 100,000 nested `[` are a RecursionError, and a
structure just within its limit can still overflow whatever walks it next; no file this project reads
nests deeper than a few levels, so anything past MAX_JSON_DEPTH is refused, as a ValueError.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64


class FileTooLargeError(ValueError):
    """A file longer than the most its kind can legitimately hold."""


def read_capped(path: str | Path, max_bytes: int) -> bytes:
    """The file's bytes; FileTooLargeError past `max_bytes` (OSError as raised for a missing or unreadable one)."""
    with open(path, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(f"more than {max_bytes} bytes, the most such a file may hold")
    return data


def read_capped_text(path: str | Path, max_bytes: int) -> str:
    """The file as UTF-8 text, read with `read_capped` (ValueError when it is not UTF-8)."""
    data = read_capped(path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text ({error})") from None


def loads_json(text: str | bytes, **options: Any) -> Any:
    """json.loads, with nesting beyond MAX_JSON_DEPTH (or Python's recursion limit) a ValueError."""
    try:
        value = json.loads(text, **options)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
