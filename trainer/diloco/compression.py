"""Pseudogradient compression for the DiLoCo outer sync.

Every quantizer works on ROWS: the caller hands a 2-D tensor whose rows are the quantization groups
(rows of a column-parallel weight, the transpose of a row-parallel one), so each row is a vector one
tensor-parallel rank holds whole and the result does not depend on the TP degree. A 1-D tensor is a
single row; a tensor of more dimensions is viewed as (shape[0], rest).

Wire format (no header: both sides know the shape and the config). Sections are concatenated in the
order listed; fp32 sections come first so they start 4-byte aligned; numbers are little-endian.

  none         fp32 values                                        4*R*C bytes
  statistical  fp32 row means [R], fp32 codebooks [R, 2**b],      4*R + 4*R*2**b + ceil(R*C*b/8)
               codes packed b bits each
  linear       fp32 row minima [R], fp32 row maxima [R],          8*R + ceil(R*C*b/8)
               codes packed b bits each
  topk         fp32 kept values [R, k], column indices [R, k]     4*R*k + ceil(R*k*w/8)
               packed w = max(1, bit_length(C-1)) bits each,       k = min(C, ceil(fraction*C))
               ascending within a row

With `zstd` the payload is the zstd frame of those bytes, so its size depends on the data.

Top-k values are sent in fp32 so the kept entries arrive exactly: top-k then only drops, never
perturbs, and error feedback carries exactly what was dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import zstandard

METHODS = ("none", "statistical", "linear", "topk")
QUANTIZER_BITS = (2, 4, 8)
# The statistical quantizer's bins cover mean +- this many standard deviations.
STATISTICAL_HALF_RANGE_SIGMAS = 3.0


@dataclass(frozen=True)
class CompressionConfig:
    method: str = "none"
    bits: int = 4
    topk_fraction: float = 0.02
    error_feedback: bool = False
    ef_beta: float = 1.0
    zstd: bool = False
    zstd_level: int = 3
    # The caller sends embeddings, norms and other 1-D tensors uncompressed when this is set.
    uncompressed_small: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"CompressionConfig.method must be one of {METHODS}, got {self.method!r}")
        if self.method in ("statistical", "linear") and self.bits not in QUANTIZER_BITS:
            raise ValueError(
                f"CompressionConfig.bits must be one of {QUANTIZER_BITS} for method {self.method!r}, "
                f"got {self.bits!r}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"CompressionConfig.topk_fraction must be in (0, 1], got {self.topk_fraction!r}")
        if not 0.0 <= self.ef_beta <= 1.0:
            raise ValueError(f"CompressionConfig.ef_beta must be in [0, 1], got {self.ef_beta!r}")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"CompressionConfig.zstd_level must be in [1, 22], got {self.zstd_level!r}")


@dataclass(frozen=True)
class Payload:
    """One encoded tensor: a flat uint8 tensor on the wire."""
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel()


# ---------------------------------------------------------------------------------------------
# Bit packing. Bit order: value i occupies bits [i*width, (i+1)*width) of the stream and byte n
# holds stream bits [8n, 8n+8), lowest bit first.

def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers < 2**width into ceil(len*width/8) bytes."""
    values = values.reshape(-1)
    if 8 % width:
        # Widths that do not divide a byte go through the 1-bit stream.
        return pack_bits(_to_bit_stream(values, width), 1)
    per_byte = 8 // width
    codes = values.to(torch.uint8)
    padding = (-codes.numel()) % per_byte
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding)])
    codes = codes.view(-1, per_byte)
    packed = codes[:, 0].clone()
    for slot in range(1, per_byte):
        packed |= codes[:, slot] << (slot * width)
    return packed


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of pack_bits: the first `count` values, as int64."""
    if 8 % width:
        bits = unpack_bits(packed, 1, count * width).view(count, width)
        weights = torch.arange(width, device=packed.device)
        return (bits << weights).sum(dim=1)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << width) - 1)
    return codes.reshape(-1)[:count].long()


def _to_bit_stream(values: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(width, device=values.device)
    return ((values.long().unsqueeze(1) >> shifts) & 1).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Row views and byte sections.

def as_rows(x: torch.Tensor) -> torch.Tensor:
    """The (rows, columns) fp32 view the quantizers work on."""
    return x.float().reshape(rows_shape(x.shape))


def rows_shape(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def _f32_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().reshape(-1).view(torch.uint8)


class _ByteReader:
    def __init__(self, data: torch.Tensor):
        self.data = data
        self.offset = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.offset + nbytes > self.data.numel():
            raise ValueError(
                f"payload too short: need {self.offset + nbytes} bytes, have {self.data.numel()}")
        chunk = self.data[self.offset:self.offset + nbytes]
        self.offset += nbytes
        return chunk

    def f32(self, count: int) -> torch.Tensor:
        chunk = self.take(4 * count)
        if chunk.storage_offset() % 4:  # a float view needs 4-byte alignment
            chunk = chunk.clone()
        return chunk.view(torch.float32).clone()

    def packed(self, width: int, count: int) -> torch.Tensor:
        return unpack_bits(self.take(math.ceil(count * width / 8)), width, count)


# ---------------------------------------------------------------------------------------------
# Row codecs: (R, C) fp32 rows <-> list of byte sections. One class per method.

class _RawRows:
    def encode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return [_f32_bytes(rows)]

    def decode(self, reader: _ByteReader, n_rows: int, n_cols: int) -> torch.Tensor:
        return reader.f32(n_rows * n_cols).view(n_rows, n_cols)

    def nbytes(self, n_rows: int, n_cols: int) -> int:
        return 4 * n_rows * n_cols


class _StatisticalRows:
    """Per row: subtract the mean; 2**bits bins of width 6 sigma / 2**bits tile
    [-3 sigma, 3 sigma) around 0, bin i = [-3 sigma + i*width, -3 sigma + (i+1)*width); values
    outside clamp into the edge bins. The codebook holds the mean of the centered values in each
    bin (the bin center for an empty bin); decode = row mean + codebook[code]. A constant row
    (sigma = 0) decodes exactly."""

    def __init__(self, bits: int):
        self.bits = bits
        self.bins = 2 ** bits

    def encode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        n_rows, n_cols = rows.shape
        # fp64 accumulation keeps the statistics accurate and independent of the reduction order.
        mean = rows.sum(dim=1, dtype=torch.float64).div(max(n_cols, 1)).float()
        centered = rows - mean.unsqueeze(1)
        sigma = centered.square().sum(dim=1, dtype=torch.float64).div(max(n_cols, 1)).sqrt().float()
        width, low = self._bin_geometry(sigma)
        codes = torch.floor((centered - low.unsqueeze(1)) / width.unsqueeze(1)).long().clamp_(0, self.bins - 1)

        slots = (codes + torch.arange(n_rows, device=rows.device).unsqueeze(1) * self.bins).reshape(-1)
        sums = torch.zeros(n_rows * self.bins, dtype=torch.float64, device=rows.device)
        sums.scatter_add_(0, slots, centered.reshape(-1).double())
        counts = torch.bincount(slots, minlength=n_rows * self.bins)
        centers = low.unsqueeze(1) + (torch.arange(self.bins, device=rows.device) + 0.5) * width.unsqueeze(1)
        codebook = torch.where(counts > 0, sums / counts.clamp(min=1), centers.reshape(-1).double())
        return [_f32_bytes(mean), _f32_bytes(codebook), pack_bits(codes, self.bits)]

    def _bin_geometry(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bin width and lower edge per row; a zero-sigma row gets width 1 so its codes are 0."""
        width = torch.where(sigma > 0, 2 * STATISTICAL_HALF_RANGE_SIGMAS * sigma / self.bins,
                            torch.ones_like(sigma))
        return width, -STATISTICAL_HALF_RANGE_SIGMAS * sigma

    def decode(self, reader: _ByteReader, n_rows: int, n_cols: int) -> torch.Tensor:
        mean = reader.f32(n_rows)
        codebook = reader.f32(n_rows * self.bins).view(n_rows, self.bins)
        codes = reader.packed(self.bits, n_rows * n_cols).view(n_rows, n_cols)
        return mean.unsqueeze(1) + torch.gather(codebook, 1, codes)

    def nbytes(self, n_rows: int, n_cols: int) -> int:
        return 4 * n_rows + 4 * n_rows * self.bins + math.ceil(n_rows * n_cols * self.bits / 8)


class _LinearRows:
    """Per row: 2**bits uniform levels from the row minimum to the row maximum, nearest level."""

    def __init__(self, bits: int):
        self.bits = bits
        self.top_code = 2 ** bits - 1

    def encode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        low, high = rows.amin(dim=1), rows.amax(dim=1)
        step = self._step(low, high)
        codes = torch.round((rows - low.unsqueeze(1)) / step.unsqueeze(1)).long().clamp_(0, self.top_code)
        return [_f32_bytes(low), _f32_bytes(high), pack_bits(codes, self.bits)]

    def _step(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        # Encoder and decoder derive the step from the same fp32 bytes, so they agree exactly.
        step = (high - low) / self.top_code
        return torch.where(step > 0, step, torch.ones_like(step))

    def decode(self, reader: _ByteReader, n_rows: int, n_cols: int) -> torch.Tensor:
        low, high = reader.f32(n_rows), reader.f32(n_rows)
        codes = reader.packed(self.bits, n_rows * n_cols).view(n_rows, n_cols)
        return low.unsqueeze(1) + codes.float() * self._step(low, high).unsqueeze(1)

    def nbytes(self, n_rows: int, n_cols: int) -> int:
        return 8 * n_rows + math.ceil(n_rows * n_cols * self.bits / 8)


class _TopKRows:
    """Per row: the k largest-magnitude entries (fp32) and their column indices."""

    def __init__(self, fraction: float):
        self.fraction = fraction

    def kept(self, n_cols: int) -> int:
        return min(n_cols, math.ceil(self.fraction * n_cols))

    @staticmethod
    def index_bits(n_cols: int) -> int:
        return max(1, (n_cols - 1).bit_length())

    def encode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        n_cols = rows.shape[1]
        indices = rows.abs().topk(self.kept(n_cols), dim=1, sorted=False).indices.sort(dim=1).values
        values = torch.gather(rows, 1, indices)
        return [_f32_bytes(values), pack_bits(indices, self.index_bits(n_cols))]

    def decode(self, reader: _ByteReader, n_rows: int, n_cols: int) -> torch.Tensor:
        k = self.kept(n_cols)
        values = reader.f32(n_rows * k).view(n_rows, k)
        indices = reader.packed(self.index_bits(n_cols), n_rows * k).view(n_rows, k)
        return torch.zeros(n_rows, n_cols, device=values.device).scatter_(1, indices, values)

    def nbytes(self, n_rows: int, n_cols: int) -> int:
        k = self.kept(n_cols)
        return 4 * n_rows * k + math.ceil(n_rows * k * self.index_bits(n_cols) / 8)


def _row_codec(config: CompressionConfig):
    if config.method == "statistical":
        return _StatisticalRows(config.bits)
    if config.method == "linear":
        return _LinearRows(config.bits)
    if config.method == "topk":
        return _TopKRows(config.topk_fraction)
    return _RawRows()


# ---------------------------------------------------------------------------------------------
# Public codecs.

class Compressor:
    """Stateless encode/decode of one tensor under a CompressionConfig."""

    def __init__(self, config: CompressionConfig):
        self.config = config
        self._rows = _row_codec(config)

    def encode(self, x: torch.Tensor) -> Payload:
        data = torch.cat(self._rows.encode(as_rows(x)))
        return Payload(_zstd_compress(data, self.config.zstd_level) if self.config.zstd else data)

    def decode(self, payload: Payload, shape: Sequence[int]) -> torch.Tensor:
        data = _zstd_decompress(payload.data) if self.config.zstd else payload.data
        n_rows, n_cols = rows_shape(shape)
        reader = _ByteReader(data)
        rows = self._rows.decode(reader, n_rows, n_cols)
        if reader.offset != data.numel():
            raise ValueError(f"payload has {data.numel()} bytes, shape {tuple(shape)} needs {reader.offset}")
        return rows.reshape(shape)

    def payload_nbytes(self, shape: Sequence[int]) -> int | None:
        """Bytes of the payload for a tensor of this shape; None when zstd makes it data-dependent."""
        return None if self.config.zstd else self._rows.nbytes(*rows_shape(shape))

    def compress_split(self, x: torch.Tensor, row_counts: Sequence[int]) -> list[Payload]:
        """Encode consecutive row blocks of x separately (rows are independent groups, so the decoded
        blocks equal the blocks of the whole tensor's decoding)."""
        return [self.encode(block) for block in as_rows(x).split(list(row_counts))]

    def compress(self, x: torch.Tensor) -> Payload:
        return self.encode(x)


class ErrorFeedback:
    """Error feedback for one tensor: e = beta*e + delta; send Q(e); e -= deQ(Q(e))."""

    def __init__(self, compressor: Compressor, beta: float | None = None):
        self.compressor = compressor
        self.beta = compressor.config.ef_beta if beta is None else beta
        self.error: torch.Tensor | None = None

    def compress_split(self, delta: torch.Tensor, row_counts: Sequence[int]) -> list[Payload]:
        delta = delta.float()
        if self.error is None:
            self.error = delta.clone()
        elif self.error.shape != delta.shape:
            raise ValueError(f"ErrorFeedback holds shape {tuple(self.error.shape)}, got {tuple(delta.shape)}")
        else:
            self.error.mul_(self.beta).add_(delta)
        payloads = self.compressor.compress_split(self.error, row_counts)
        n_cols = as_rows(self.error).shape[1]
        decoded = [self.compressor.decode(p, (rows, n_cols)) for p, rows in zip(payloads, row_counts)]
        self.error -= torch.cat(decoded).reshape(self.error.shape)
        return payloads

    def compress(self, delta: torch.Tensor) -> Payload:
        return self.compress_split(delta, [rows_shape(delta.shape)[0]])[0]

    def decode(self, payload: Payload, shape: Sequence[int]) -> torch.Tensor:
        return self.compressor.decode(payload, shape)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "error": None if self.error is None else self.error.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]
        self.error = None if state["error"] is None else state["error"].clone()


def make_codec(config: CompressionConfig) -> Compressor | ErrorFeedback:
    """The codec a config asks for: with error feedback, a fresh ErrorFeedback (one per tensor)."""
    compressor = Compressor(config)
    return ErrorFeedback(compressor) if config.error_feedback else compressor


def relative_error(compressor: Compressor, x: torch.Tensor) -> float:
    """||decode(encode(x)) - x|| / ||x||, the compression error to log (the absolute error if x == 0)."""
    x = x.float()
    error = (compressor.decode(compressor.encode(x), x.shape) - x).norm().item()
    norm = x.norm().item()
    return error / norm if norm > 0 else error


def _zstd_compress(data: torch.Tensor, level: int) -> torch.Tensor:
    frame = zstandard.ZstdCompressor(level=level).compress(data.cpu().numpy().tobytes())
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(data.device)


def _zstd_decompress(frame: torch.Tensor) -> torch.Tensor:
    raw = zstandard.ZstdDecompressor().decompress(frame.cpu().numpy().tobytes())
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=frame.device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(frame.device)
