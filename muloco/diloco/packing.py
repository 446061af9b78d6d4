"""How a bucket's tensors lie in one flat buffer: chunk-major, so the row chunk an outer rank owns in
a reduce-scatter is one contiguous slice (`row_split` cuts the rows, `BucketPacking` packs and
unpacks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from muloco.diloco.compression import Blocks


def row_split(n_rows: int, parts: int) -> list[int]:
    """Rows per chunk for `parts` contiguous chunks: the first n_rows % parts chunks get one more
    row; with fewer rows than parts the trailing chunks are empty."""
    base, extra = divmod(n_rows, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]



@dataclass(frozen=True)
class BucketPacking:
    """Tensors of one bucket (as (rows, columns)) in one flat buffer, CHUNK-major: row chunk j of every
    tensor (row_split over `parts`), then chunk j+1, so the chunk an outer rank owns in a
    reduce-scatter is one contiguous slice. parts = 1 is the tensors one after another."""
    shapes: tuple[tuple[int, int], ...]
    parts: int

    @property
    def counts(self) -> list[list[int]]:
        return [row_split(rows, self.parts) for rows, _ in self.shapes]

    @property
    def chunks(self) -> list[Blocks]:
        counts = self.counts
        return [tuple((count[j], cols) for count, (_, cols) in zip(counts, self.shapes)) for j in range(self.parts)]

    @property
    def chunk_numels(self) -> list[int]:
        return [sum(rows * cols for rows, cols in chunk) for chunk in self.chunks]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """(rows, columns) tensors -> one flat fp32 buffer."""
        splits = [t.float().split(count) for t, count in zip(tensors, self.counts)]
        return torch.cat([split[j].reshape(-1) for j in range(self.parts) for split in splits])

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of flatten: (rows, columns) tensors."""
        blocks = [chunk_flat.split([rows * cols for rows, cols in chunk])
                  for chunk_flat, chunk in zip(flat.split(self.chunk_numels), self.chunks)]
        return [torch.cat([blocks[j][i].view(self.chunks[j][i]) for j in range(self.parts)])
                for i in range(len(self.shapes))]

