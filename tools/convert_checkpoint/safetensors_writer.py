"""Sharded safetensors output written as tensors arrive: a shard is flushed once it reaches the size
limit, so memory holds at most one shard. Names follow transformers' convention
(model.safetensors alone, or model-0000i-of-0000n.safetensors with model.safetensors.index.json)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def readable_by_all(path: Path) -> None:
    """The mode a plain open() gives (0644 under the usual umask): safetensors writes its files 0600,
    and an exported model is for others to read."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


class ShardedSafetensorsWriter:
    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per flushed shard
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous().clone()  # own the memory: sources are memory-mapped views
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self._pending, str(self.out_dir / f"part-{len(self._shards):05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            (self.out_dir / f"part-{i:05d}.tmp").replace(self.out_dir / final)
            readable_by_all(self.out_dir / final)
        if n > 1:
            weight_map = {t: final for final, tensors in zip(names, self._shards) for t in tensors}
            (self.out_dir / INDEX).write_text(json.dumps(
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2))
        return [self.out_dir / f for f in names]
