"""Pseudogradient compression for the DiLoCo outer sync.

Every quantizer works on GROUPS, by default ROWS: each tensor is handed as (rows, columns) whose rows
are the quantization groups (rows of a column-parallel weight, the transpose of a row-parallel one),
so each row is a vector one tensor-parallel rank holds whole and the result does not depend on the TP
degree. A 1-D tensor is a single row; a tensor of more dimensions is viewed as (shape[0], rest). With
`granularity` "tensor" each tensor of a payload is one group: its (rows, columns) block is coded as
one row of rows*columns, so the wire format below holds with R = the tensors of the bucket. A
payload may carry part of a tensor (a reduce-scatter chunk: rows/K of each; a TP rank: its shard),
and then that part is the group.

The codec works on a BUCKET: many tensors flattened one after another into one fp32 buffer,
described by its blocks, a tuple of (rows, columns). Consecutive blocks of equal width are one
dense matrix to the quantizer (a "run"), so a bucket costs a few dense tensor ops per distinct width,
never a Python loop over its tensors; callers order a bucket's tensors by width. The same code runs
on the host and on an accelerator: everything stays on the buffer's device.

Which config a tensor is sent with depends on its group (`compression_group`): matrices at `bits`,
embeddings and the output head at `embedding_bits`, 1-D tensors at `vector_bits`; 32 means fp32.

Wire format of a bucket (no header: both sides know the blocks and the config). Sections in this
order, R = groups of the bucket (rows; tensors with granularity "tensor"), N = its elements; numbers
little-endian:

  none         fp32 values                                            4*N bytes
  statistical  fp32 row means [R], fp32 row sigmas [R],               8*R + 2*R*2**b + ceil(N*b/8)
               fp16 codebooks [R, 2**b] in units of sigma (b <= 4),   (no codebook at b = 8)
               codes packed b bits each
  linear       fp32 row minima [R], fp32 row maxima [R],              8*R + ceil(N*b/8)
               codes packed b bits each
  topk         the kept values [R, k] of every run, then per run         V + sum ceil(R*k*w/8)
               column indices [R, k] packed w = max(1, bit_length(C-1)) bits each,
               ascending within a group; k = min(C, ceil(fraction*C)), C = its width.
               The kept values: fp32 (topk_value_bits 32, V = 4*sum(R*k)), or the
               statistical section of the kept values, each group's k values a row
               (V = 8*R + 2*R*2**v + ceil(sum(R*k)*v/8) at v = topk_value_bits;
               SparseLoCo's form at v = 2)

With `zstd` the payload is the zstd frame of those bytes, so its size depends on the data.

Payloads come from other datacenters, so decoding trusts nothing in them: a payload must have exactly
its blocks' size, a zstd frame is inflated only up to that size (a frame that would grow past it is
refused before it is allocated), and every index it carries must fall inside its row. Anything else
raises PayloadError, which the receiver turns into a rejection of that sender.

At 8 bits the statistical quantizer's 256 bins are fine enough that their centres replace the
codebook, which would otherwise cost more than the codes on rows shorter than 1024. Top-k values are
sent in fp32 by default so the kept entries arrive exactly: top-k only drops, and error feedback
carries exactly what was dropped; with quantized values it also carries their rounding. A group's k
values are few (k = 3 of a 128-wide row at 2%), too few to pay for a quantizer's 16-byte row
statistics, so quantized values go with granularity "tensor".

Two choices exist in two forms, this trainer's (the defaults) and the official MuLoCo code's:
- `statistical_rounding`: "centred" tiles [-3 sigma, 3 sigma) with 2**b equal bins symmetric about
  the row mean (sigma over N); "paper" is the official code(c) = round(c/s + 2**b/2), s = 6 sigma/2**b
  (sigma over N-1), whose bins are centred on multiples of s: one on the mean, 2**b/2 below it and
  2**b/2 - 1 above, so they are not mirror images (at 2 bits: centres -3, -1.5, 0, +1.5 sigma).
  Both send the same wire format. Centred is the default: its reconstruction error is 5% lower at
  2 bits and equal at 4 and 8 (benchmarks/statistical_rounding.py).
- `ef_form` (see ErrorFeedback): "plain" e = beta e + delta; "paper" e = beta e + outer_lr delta,
  whose decoded average the outer step takes as it is, as the official code does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import zstandard

from muloco.diloco.config import FP32_BITS, CompressionConfig, Granularity, StatisticalRounding

# The statistical quantizer's bins cover mean +- this many standard deviations.
STATISTICAL_HALF_RANGE_SIGMAS = 3.0
# Widest statistical setting that still sends a per-row codebook.
MAX_CODEBOOK_BITS = 4

Blocks = tuple[tuple[int, int], ...]  # (rows, columns) of each block of a bucket, in buffer order


class PayloadError(ValueError):
    """A payload that is not a valid encoding of its blocks under this config."""


def compression_group(shape: Sequence[int], is_embedding_or_output: bool) -> str:
    """"embedding" (embeddings, output head), "vector" (1-D: norms, biases) or "matrix"."""
    if is_embedding_or_output:
        return "embedding"
    return "vector" if len(shape) <= 1 else "matrix"


@dataclass(frozen=True)
class Encoded:
    """One encoded bucket: the wire bytes, and what the receivers will decode them to (the sender
    gets it for free while encoding; error feedback and the compression-error metric use it)."""
    data: torch.Tensor  # flat uint8
    decoded: torch.Tensor  # flat fp32, the bucket's blocks in order

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
# Row shapes, runs and byte sections.

def rows_shape(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """The (rows, columns) fp32 view the quantizers work on."""
    return x.float().reshape(rows_shape(x.shape))


def groups_of(blocks: Blocks, granularity: Granularity) -> Blocks:
    """The blocks as the quantizer's groups: the rows themselves, or each block as one row (an empty
    block as no row)."""
    if granularity == "row":
        return blocks
    return tuple((1, rows * cols) if rows * cols else (0, 0) for rows, cols in blocks)


def runs_of(blocks: Blocks) -> list[tuple[int, int]]:
    """Consecutive blocks of equal width merged: row-wise quantization cannot tell them apart."""
    runs: list[tuple[int, int]] = []
    for rows, cols in blocks:
        if runs and runs[-1][1] == cols:
            runs[-1] = (runs[-1][0] + rows, cols)
        else:
            runs.append((rows, cols))
    return runs


def _run_matrices(flat: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [part.view(rows, cols) for part, (rows, cols) in zip(flat.split([r * c for r, c in runs]), runs)]


# Row blocks a row-wise codec encodes at a time. Its temporaries (several per element, some fp64)
# then stay a few MB and are reused from the heap; whole runs of a bucket (tens of MB) are fresh
# allocations whose page faults made encoding a bucket 2-4x slower than encoding its tensors one by one.
BLOCK_ELEMENTS = 1 << 18


def _row_blocks(mats: list[torch.Tensor]) -> list[torch.Tensor]:
    return [block for m in mats for block in m.split(max(1, BLOCK_ELEMENTS // max(m.shape[1], 1)))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class _ByteReader:
    def __init__(self, data: torch.Tensor):
        self.data = data
        self.offset = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.offset + nbytes > self.data.numel():
            raise PayloadError(
                f"payload too short: need {self.offset + nbytes} bytes, have {self.data.numel()}")
        chunk = self.data[self.offset:self.offset + nbytes]
        self.offset += nbytes
        return chunk

    def values(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        chunk = self.take(size * count)
        if chunk.storage_offset() % size:  # a typed view needs aligned storage
            chunk = chunk.clone()
        return chunk.view(dtype)

    def packed(self, width: int, count: int) -> torch.Tensor:
        return unpack_bits(self.take(math.ceil(count * width / 8)), width, count)


# ---------------------------------------------------------------------------------------------
# Run codecs: a list of dense (R, C) fp32 matrices <-> byte sections. One class per method.

class _Raw:
    row_separable = True  # encoding row blocks one after another gives the same bytes

    def encode(self, mats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [_bytes(m) for m in mats], mats

    def decode(self, reader: _ByteReader, runs: list[tuple[int, int]]) -> torch.Tensor:
        return reader.values(torch.float32, sum(r * c for r, c in runs)).clone()

    def nbytes(self, runs: list[tuple[int, int]]) -> int:
        return 4 * sum(r * c for r, c in runs)


class _Statistical:
    """Per row: subtract the mean; 2**bits bins of width 6 sigma / 2**bits around 0, values outside
    clamp into the edge bins. "centred" rounding: sigma over N, bin i = [-3 sigma + i*width,
    -3 sigma + (i+1)*width). "paper" rounding: sigma over N-1, code = round(c/width + 2**bits/2), bin
    i centred on (i - 2**bits/2)*width. Up to 4 bits, an fp16 codebook holds the mean of the centered
    values in each bin in units of sigma (the bin center for an empty bin); at 8 bits a code decodes to
    its bin center. Decode = row mean + sigma * codebook[code]. A constant row (sigma = 0) decodes exactly."""

    row_separable = True

    def __init__(self, bits: int, rounding: StatisticalRounding):
        self.bits = bits
        self.bins = 2 ** bits
        self.codebook = bits <= MAX_CODEBOOK_BITS
        self.paper = rounding == "paper"

    def encode(self, mats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        means, sigmas, books, codes, decoded = [], [], [], [], []
        for rows in mats:
            n_cols = max(rows.shape[1], 1)
            # fp64 accumulation keeps the statistics accurate and independent of the reduction order.
            mean = rows.sum(dim=1, dtype=torch.float64).div(n_cols).float()
            centered = rows - mean.unsqueeze(1)
            dof = max(n_cols - 1, 1) if self.paper else n_cols
            sigma = centered.square().sum(dim=1, dtype=torch.float64).div(dof).sqrt().float()
            code = self._codes(centered, sigma)
            if self.codebook:
                book = self._codebook(centered, code, sigma)
                books.append(book)
                values = torch.gather(book.float(), 1, code) * sigma.unsqueeze(1)
            else:
                values = self._centers(code, sigma)
            means.append(mean), sigmas.append(sigma), codes.append(code.reshape(-1).to(torch.uint8))
            decoded.append(mean.unsqueeze(1) + values)
        sections = [_bytes(torch.cat(means)), _bytes(torch.cat(sigmas))]
        if self.codebook:
            sections.append(_bytes(torch.cat(books)))
        return [*sections, pack_bits(torch.cat(codes), self.bits)], decoded

    def _codes(self, centered: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        width = self._bin_width(sigma).unsqueeze(1)
        if self.paper:
            code = torch.round(centered / width + self.bins // 2)  # half to even, as the official code
        else:
            code = torch.floor((centered + STATISTICAL_HALF_RANGE_SIGMAS * sigma.unsqueeze(1)) / width)
        return code.long().clamp_(0, self.bins - 1)

    def _codebook(self, centered: torch.Tensor, code: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """fp16 [R, bins]: each bin's member mean over sigma (its center when empty)."""
        n_rows = centered.shape[0]
        slots = (code + torch.arange(n_rows, device=code.device).unsqueeze(1) * self.bins).reshape(-1)
        sums = torch.zeros(n_rows * self.bins, dtype=torch.float64, device=code.device)
        sums.scatter_add_(0, slots, centered.reshape(-1).double())
        counts = torch.bincount(slots, minlength=n_rows * self.bins).view(n_rows, self.bins)
        scale = torch.where(sigma > 0, sigma, torch.ones_like(sigma)).double().unsqueeze(1)
        bins = torch.arange(self.bins, device=code.device, dtype=torch.float64)
        centers = (bins - self.bins // 2 + (0.0 if self.paper else 0.5)) * (2 * STATISTICAL_HALF_RANGE_SIGMAS / self.bins)
        means = sums.view(n_rows, self.bins) / counts.clamp(min=1) / scale
        return torch.where(counts > 0, means, centers.expand(n_rows, -1)).half()

    def _bin_width(self, sigma: torch.Tensor) -> torch.Tensor:
        """A zero-sigma row gets width 1, so its (zero) centered values all fall in one bin."""
        return torch.where(sigma > 0, 2 * STATISTICAL_HALF_RANGE_SIGMAS * sigma / self.bins, torch.ones_like(sigma))

    def _centers(self, code: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Bin centers of the codes, relative to the row mean (0 on a constant row)."""
        width = self._bin_width(sigma).unsqueeze(1)
        if self.paper:
            centers = (code.float() - self.bins // 2) * width
        else:
            centers = -STATISTICAL_HALF_RANGE_SIGMAS * sigma.unsqueeze(1) + (code.float() + 0.5) * width
        return torch.where(sigma.unsqueeze(1) > 0, centers, torch.zeros_like(centers))

    def decode(self, reader: _ByteReader, runs: list[tuple[int, int]]) -> torch.Tensor:
        n_rows, numel = sum(r for r, _ in runs), sum(r * c for r, c in runs)
        mean, sigma = reader.values(torch.float32, n_rows), reader.values(torch.float32, n_rows)
        book = reader.values(torch.float16, n_rows * self.bins).view(n_rows, self.bins) if self.codebook else None
        codes = reader.packed(self.bits, numel)
        out, row, element = [], 0, 0
        for rows, cols in runs:
            run = slice(row, row + rows)
            code = codes[element:element + rows * cols].view(rows, cols)
            if book is not None:
                values = torch.gather(book[run].float(), 1, code) * sigma[run].unsqueeze(1)
            else:
                values = self._centers(code, sigma[run])
            out.append((mean[run].unsqueeze(1) + values).reshape(-1))
            row, element = row + rows, element + rows * cols
        return torch.cat(out) if out else mean.new_zeros(0)

    def nbytes(self, runs: list[tuple[int, int]]) -> int:
        n_rows, numel = sum(r for r, _ in runs), sum(r * c for r, c in runs)
        return 8 * n_rows + (2 * n_rows * self.bins if self.codebook else 0) + math.ceil(numel * self.bits / 8)


class _Linear:
    """Per row: 2**bits uniform levels from the row minimum to the row maximum, nearest level."""
    row_separable = True

    def __init__(self, bits: int):
        self.bits = bits
        self.top_code = 2 ** bits - 1

    def encode(self, mats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        lows, highs, codes, decoded = [], [], [], []
        for rows in mats:
            if rows.shape[1] == 0:
                low = high = rows.new_zeros(rows.shape[0])
            else:
                low, high = rows.amin(dim=1), rows.amax(dim=1)
            step = self._step(low, high).unsqueeze(1)
            code = torch.round((rows - low.unsqueeze(1)) / step).long().clamp_(0, self.top_code)
            lows.append(low), highs.append(high), codes.append(code.reshape(-1).to(torch.uint8))
            decoded.append(low.unsqueeze(1) + code.float() * step)
        return [_bytes(torch.cat(lows)), _bytes(torch.cat(highs)), pack_bits(torch.cat(codes), self.bits)], decoded

    def _step(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        # Encoder and decoder derive the step from the same fp32 bytes, so they agree exactly.
        step = (high - low) / self.top_code
        return torch.where(step > 0, step, torch.ones_like(step))

    def decode(self, reader: _ByteReader, runs: list[tuple[int, int]]) -> torch.Tensor:
        n_rows, numel = sum(r for r, _ in runs), sum(r * c for r, c in runs)
        low, high = reader.values(torch.float32, n_rows), reader.values(torch.float32, n_rows)
        codes, step = reader.packed(self.bits, numel), self._step(low, high)
        out, row, element = [], 0, 0
        for rows, cols in runs:
            run = slice(row, row + rows)
            code = codes[element:element + rows * cols].view(rows, cols)
            out.append((low[run].unsqueeze(1) + code.float() * step[run].unsqueeze(1)).reshape(-1))
            row, element = row + rows, element + rows * cols
        return torch.cat(out) if out else low.new_zeros(0)

    def nbytes(self, runs: list[tuple[int, int]]) -> int:
        n_rows, numel = sum(r for r, _ in runs), sum(r * c for r, c in runs)
        return 8 * n_rows + math.ceil(numel * self.bits / 8)


class _TopK:
    """Per row: the k largest-magnitude entries and their column indices; the kept values go through
    `values` (a row codec over the [R, k] kept matrices: fp32, or a quantizer)."""
    row_separable = False  # each matrix's indices are packed on their own (byte-padded)

    def __init__(self, fraction: float, values: _Raw | _Statistical):
        self.fraction = fraction
        self.values = values

    def kept(self, n_cols: int) -> int:
        return min(n_cols, math.ceil(self.fraction * n_cols))

    @staticmethod
    def index_bits(n_cols: int) -> int:
        return max(1, (n_cols - 1).bit_length())

    def _kept_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(rows, self.kept(cols)) for rows, cols in runs]

    def encode(self, mats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        index = [m.abs().topk(self.kept(m.shape[1]), dim=1, sorted=False).indices.sort(dim=1).values for m in mats]
        values, kept = self.values.encode([torch.gather(m, 1, i) for m, i in zip(mats, index)])
        indices = [pack_bits(i, self.index_bits(m.shape[1])) for m, i in zip(mats, index)]
        decoded = [torch.zeros_like(m).scatter_(1, i, k.view(i.shape)) for m, i, k in zip(mats, index, kept)]
        return values + indices, decoded

    def decode(self, reader: _ByteReader, runs: list[tuple[int, int]]) -> torch.Tensor:
        kept_runs = self._kept_runs(runs)
        kept = self.values.decode(reader, kept_runs).split([r * k for r, k in kept_runs])
        out = []
        for (rows, cols), (_, k), values in zip(runs, kept_runs, kept):
            index = reader.packed(self.index_bits(cols), rows * k).view(rows, k)
            if index.numel() and int(index.max()) >= cols:  # checked here: out of range it would fault a GPU
                raise PayloadError(f"top-k payload holds a column index beyond its row of {cols}")
            out.append(torch.zeros(rows, cols, device=values.device).scatter_(1, index, values.view(rows, k)).reshape(-1))
        return torch.cat(out) if out else torch.zeros(0, device=reader.data.device)

    def nbytes(self, runs: list[tuple[int, int]]) -> int:
        return self.values.nbytes(self._kept_runs(runs)) + sum(
            math.ceil(r * self.kept(c) * self.index_bits(c) / 8) for r, c in runs)


def _run_codec(config: CompressionConfig):
    if config.method == "statistical":
        return _Statistical(config.bits, config.statistical_rounding)
    if config.method == "linear":
        return _Linear(config.bits)
    if config.method == "topk":
        values = _Raw() if config.topk_value_bits == FP32_BITS else _Statistical(config.topk_value_bits,
                                                                                config.statistical_rounding)
        return _TopK(config.topk_fraction, values)
    return _Raw()


# ---------------------------------------------------------------------------------------------
# Public codec.

class Compressor:
    """Stateless encode/decode under a CompressionConfig, of a bucket or of one tensor."""

    def __init__(self, config: CompressionConfig):
        self.config = config
        self._runs = _run_codec(config)

    def _runs_of(self, blocks: Blocks) -> list[tuple[int, int]]:
        return runs_of(groups_of(blocks, self.config.granularity))

    def encode_bucket(self, flat: torch.Tensor, blocks: Blocks) -> Encoded:
        mats = _run_matrices(flat.float(), self._runs_of(blocks))
        sections, decoded = self._runs.encode(_row_blocks(mats) if self._runs.row_separable else mats)
        data = torch.cat(sections) if sections else torch.empty(0, dtype=torch.uint8, device=flat.device)
        flat_decoded = torch.cat([d.reshape(-1) for d in decoded]) if decoded else flat.float()
        return Encoded(_zstd_compress(data, self.config.zstd_level) if self.config.zstd else data, flat_decoded)

    def decode_bucket(self, data: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """The fp32 buffer a payload encodes; PayloadError for anything that is not a payload of
        these blocks (it may come from anyone)."""
        runs = self._runs_of(blocks)
        expected = self._runs.nbytes(runs)
        if self.config.zstd:
            data = _zstd_decompress(data, expected)
        if data.numel() != expected:
            raise PayloadError(f"payload has {data.numel()} bytes, blocks {blocks} need {expected}")
        return self._runs.decode(_ByteReader(data), runs)

    def bucket_nbytes(self, blocks: Blocks) -> int | None:
        """Bytes of a bucket's payload; None when zstd makes it data-dependent."""
        return None if self.config.zstd else self._runs.nbytes(self._runs_of(blocks))

    def max_bucket_nbytes(self, blocks: Blocks) -> int:
        """The most bytes a valid payload of these blocks can have (a zstd frame: zstd's bound)."""
        raw = self._runs.nbytes(self._runs_of(blocks))
        return _zstd_bound(raw) if self.config.zstd else raw

    # One tensor: a bucket of one block.
    def encode(self, x: torch.Tensor) -> Encoded:
        encoded = self.encode_bucket(as_rows(x).reshape(-1), (rows_shape(x.shape),))
        return Encoded(encoded.data, encoded.decoded.view(x.shape))

    def decode(self, data: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return self.decode_bucket(data, (rows_shape(shape),)).view(tuple(shape))

    def payload_nbytes(self, shape: Sequence[int]) -> int | None:
        return self.bucket_nbytes((rows_shape(shape),))


class ErrorFeedback:
    """Error feedback for one bucket: e = beta*e + scale*delta is what gets sent; the residual
    e - deQ(Q(e)), which the encoder returns anyway, is kept for the next sync.

    scale is 1 ("plain") or the outer lr ("paper", the official code's form). The receivers' average
    goes to the outer step unchanged either way: in the paper form the outer lr so scales the step
    twice, once here and once in the outer SGD step, as the official code does."""

    def __init__(self, beta: float, scale: float = 1.0):
        self.beta = beta
        self.scale = scale
        self.error: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: CompressionConfig, outer_lr: float) -> "ErrorFeedback":
        return cls(config.ef_beta, outer_lr if config.ef_form == "paper" else 1.0)

    def accumulate(self, delta: torch.Tensor) -> torch.Tensor:
        if self.error is None:
            return delta.float().mul(self.scale)
        if self.error.shape != delta.shape:
            raise ValueError(f"ErrorFeedback holds shape {tuple(self.error.shape)}, got {tuple(delta.shape)}")
        return self.error.mul(self.beta).add_(delta, alpha=self.scale)

    def keep(self, residual: torch.Tensor) -> None:
        self.error = residual


def _zstd_compress(data: torch.Tensor, level: int) -> torch.Tensor:
    frame = zstandard.ZstdCompressor(level=level).compress(data.cpu().numpy().tobytes())
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(data.device)


def _zstd_bound(nbytes: int) -> int:
    """zstd's worst-case frame size for `nbytes` of input (ZSTD_COMPRESSBOUND), plus the frame header."""
    small = ((128 << 10) - nbytes) >> 11 if nbytes < (128 << 10) else 0
    return nbytes + (nbytes >> 8) + small + 64


def _zstd_decompress(frame: torch.Tensor, limit: int) -> torch.Tensor:
    """Inflate at most `limit` bytes: a frame that holds more is refused after limit + 1 bytes, whatever
    content size its header declares (a few KB can otherwise ask for gigabytes)."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame.cpu().numpy().tobytes()) as reader:
            raw = bytearray()
            while len(raw) <= limit:
                chunk = reader.read(limit + 1 - len(raw))
                if not chunk:
                    break
                raw += chunk
    except zstandard.ZstdError as err:
        raise PayloadError(f"malformed zstd frame: {err}") from None
    if len(raw) > limit:
        raise PayloadError(f"zstd frame inflates past the {limit} bytes its blocks allow")
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=frame.device)
    return torch.frombuffer(raw, dtype=torch.uint8).to(frame.device)
