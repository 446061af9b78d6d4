"""One rank's state as a safetensors file: nothing in it can run code when it is read.

A rank's state is a tree of dicts, lists and tuples whose leaves are tensors, numpy arrays, numbers,
strings, booleans and None. The tensors go into the safetensors data section (named "0", "1", ... in
tree order); the tree itself goes, as JSON with each tensor replaced by {"__tensor__": name}, into the
header's metadata under "muloco_state". What JSON cannot say directly is tagged: tuples
{"__tuple__": [...]}, numpy arrays {"__ndarray__": name, "dtype": ...} and dicts whose keys are not
plain strings {"__items__": [[key, value], ...]}. Anything else is refused when saving.

The file is written in one streaming pass (header, then each tensor's bytes), hashed on the way, so
saving needs no second copy of the state in memory; it is read with the safetensors library itself,
lazily: `read_rank_file` returns a read-only mapping whose tensors are looked up on access, as views
of the memory-mapped file. So a rank file is never rewritten in place (saves write a new file and
rename it over the old one, which leaves existing mappings intact).
"""
from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from muloco.core.errors import CheckpointError

STATE_KEY = "muloco_state"
TENSOR, TUPLE, NDARRAY, ITEMS = "__tensor__", "__tuple__", "__ndarray__", "__items__"
TAGS = {TENSOR, TUPLE, NDARRAY, ITEMS}
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


class RankFileError(CheckpointError):
    """A rank file (or a state received from a peer) that is not a valid safetensors file of this
    format; the message names it and, inside its tree, the field."""


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = obj
        return {TENSOR: name}
    if isinstance(obj, np.ndarray):
        name = str(len(tensors))
        tensors[name] = torch.from_numpy(obj.astype(np.int64) if obj.dtype.kind in "iub" else obj.astype(np.float64))
        return {NDARRAY: name, "dtype": obj.dtype.str}
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not TAGS & set(obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {ITEMS: [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a checkpoint holds only tensors, numpy arrays, numbers, strings and containers; "
                    f"got {type(obj).__name__}")


class _HashingWriter:
    def __init__(self, f: BinaryIO):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> None:
        self.sha256.update(data)
        self.f.write(data)


def write_rank_file(f: BinaryIO, state: dict) -> str:
    """Write `state` to the open binary file `f`; returns the SHA-256 (hex) of the bytes written."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", STATE_KEY: json.dumps(structure)}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"a checkpoint cannot hold {t.dtype} tensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    out = _HashingWriter(f)
    out.write(struct.pack("<Q", len(blob)))
    out.write(blob)
    for t in tensors.values():
        out.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return out.sha256.hexdigest()


class StateView(Mapping):
    """A dict of a rank file's tree: values are decoded, and tensors read, on lookup. `source` names
    the file and `where` this dict's place in the tree, for the errors of what is malformed."""

    def __init__(self, encoded: dict, handle, source: str, where: str = ""):
        self._encoded, self._handle, self._source, self._where = encoded, handle, source, where

    def __getitem__(self, key: str) -> Any:
        return _decode(self._encoded[key], self._handle, self._source, _join(self._where, key))

    def __iter__(self) -> Iterator[str]:
        return iter(self._encoded)

    def __len__(self) -> int:
        return len(self._encoded)


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


# numpy arrays hold the generators' states: integers and floats only (an object array could hold anything).
_NDARRAY_KINDS = "iubf"
_JSON_LEAVES = (type(None), bool, int, float, str)


def _decode(obj: Any, handle, source: str, where: str) -> Any:
    """The value `obj` of the tree's JSON at `where`, decoded; RankFileError naming `source` and
    `where` for a tag that does not decode (a tensor the file lacks, a bad dtype, a key that cannot
    be one)."""
    def bad(problem: str) -> RankFileError:
        return RankFileError(f"{source}: {where or 'the state tree'} {problem}")

    if isinstance(obj, list):
        return [_decode(v, handle, source, f"{where}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    tags = TAGS & set(obj)
    if not tags:
        return StateView(obj, handle, source, where)
    tag = tags.pop()
    if tag in (TENSOR, NDARRAY):
        name = obj[tag]
        if not isinstance(name, str) or name not in handle.keys():
            raise bad(f"names tensor {name!r}, which the file does not hold")
        if tag == TENSOR:
            if set(obj) != {TENSOR}:
                raise bad(f"is a tensor reference with other keys: {sorted(obj)}")
            return handle.get_tensor(name)
        try:
            dtype = np.dtype(obj.get("dtype"))
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in _NDARRAY_KINDS or set(obj) != {NDARRAY, "dtype"}:
            raise bad(f"is not a numeric numpy array (dtype {obj.get('dtype')!r})")
        return handle.get_tensor(name).numpy().astype(dtype)
    if set(obj) != {tag} or not isinstance(obj[tag], list):
        raise bad(f"is a malformed {tag} entry")
    if tag == TUPLE:
        return tuple(_decode(v, handle, source, f"{where}[{i}]") for i, v in enumerate(obj[TUPLE]))
    items = {}
    for i, pair in enumerate(obj[ITEMS]):
        if not isinstance(pair, list) or len(pair) != 2:
            raise bad(f"item {i} is not a [key, value] pair")
        key = _decode(pair[0], handle, source, f"{where}[{i}]")
        if not _hashable(key):
            raise bad(f"item {i} has a key that cannot be a dict key: {key!r}")
        items[key] = _decode(pair[1], handle, source, _join(where, key))
    return items


def _hashable(key: Any) -> bool:
    return isinstance(key, _JSON_LEAVES) or isinstance(key, tuple) and all(_hashable(k) for k in key)


def read_rank_file(path: Path) -> StateView:
    try:
        handle = safe_open(str(path), framework="pt")
        structure = json.loads((handle.metadata() or {})[STATE_KEY])
    except Exception as err:  # noqa: BLE001 - safetensors reports a malformed file as several exception types
        raise RankFileError(f"rank file {path} is not a checkpoint rank file in safetensors format ({err})") from None
    if not isinstance(structure, dict):
        raise RankFileError(f"rank file {path} holds no state tree")
    return StateView(structure, handle, f"rank file {path}")


def to_plain(obj: Any) -> Any:
    """A fully read copy of a (part of a) rank file's tree: plain dicts, every tensor loaded."""
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    return obj


def state_to_bytes(state: dict) -> bytes:
    """`state` as the bytes of a rank file (what a rejoining elastic worker receives from a peer)."""
    buffer = io.BytesIO()
    write_rank_file(buffer, state)
    return buffer.getvalue()


class _Tensors:
    """What `_decode` needs of a safetensors handle, over tensors already read."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def state_from_bytes(data: bytes, what: str) -> dict:
    """The state in rank-file bytes, fully read (plain dicts); RankFileError naming `what` for anything
    that is not such bytes. Parsing is the safetensors library's and JSON: nothing can run code."""
    try:
        (header_size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + header_size])
        structure = json.loads(header["__metadata__"][STATE_KEY])
        tensors = _Tensors(load_safetensors(data))
    except Exception as err:  # noqa: BLE001 - malformed input surfaces as many exception types
        raise RankFileError(f"{what} is not a state in safetensors format ({type(err).__name__}: {err})") from None
    state = to_plain(_decode(structure, tensors, what, ""))
    if not isinstance(state, dict):
        raise RankFileError(f"{what} holds no state tree")
    return state
