"""The codec's groups beyond rows: `granularity` "tensor" (one min/max, mean/sigma or top-k per
tensor) and top-k with statistically quantized kept values (SparseLoCo's form), each checked against
a plain computation written here, the wire format's sizes, error feedback and crafted payloads."""
import math

import pytest
import torch

from muloco.diloco.compression import Compressor, ErrorFeedback, PayloadError
from muloco.diloco.config import CompressionConfig

# A bucket as the outer loop builds it: tensors ordered by width, two consecutive ones of equal shape
# (one run to the codec), a 1-D tensor and an empty block (a reduce-scatter chunk with no row of a tensor).
SHAPES = ((3, 16), (3, 16), (1, 40), (0, 40), (5, 64))


def gaussian(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def bucket(seed=0) -> list[torch.Tensor]:
    # Different scales per tensor, so a shared min/max or sigma would show.
    return [gaussian(*shape, seed=seed + i) * 10 ** i for i, shape in enumerate(SHAPES)]


def encode(config: CompressionConfig, tensors: list[torch.Tensor]):
    compressor = Compressor(config)
    encoded = compressor.encode_bucket(torch.cat([t.reshape(-1) for t in tensors]), SHAPES)
    return compressor, encoded


def split(flat: torch.Tensor) -> list[torch.Tensor]:
    return [part.view(shape) for part, shape in zip(flat.split([r * c for r, c in SHAPES]), SHAPES)]


def per_tensor_linear(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The reference: 2**bits levels from the tensor's minimum to its maximum, nearest level."""
    if x.numel() == 0:
        return x
    low, high = x.min(), x.max()
    step = (high - low) / (2 ** bits - 1)
    return low + torch.round((x - low) / step).clamp(0, 2 ** bits - 1) * step


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_tensor_linear_is_one_min_max_per_tensor(bits):
    tensors = bucket()
    compressor, encoded = encode(CompressionConfig(method="linear", bits=bits, granularity="tensor"), tensors)
    decoded = compressor.decode_bucket(encoded.data, SHAPES)
    assert torch.equal(decoded, encoded.decoded)
    for x, got in zip(tensors, split(decoded)):
        torch.testing.assert_close(got, per_tensor_linear(x, bits), rtol=0, atol=1e-6 * 10 ** len(SHAPES))
    # The payload opens with each non-empty tensor's minimum, then each one's maximum.
    extremes = encoded.data[:8 * 4].view(torch.float32)
    nonempty = [x for x in tensors if x.numel()]
    assert extremes.tolist() == [x.min().item() for x in nonempty] + [x.max().item() for x in nonempty]


def test_per_tensor_linear_differs_from_per_row():
    x = gaussian(8, 32) * torch.logspace(0, 3, 8).unsqueeze(1)  # rows of very different ranges
    rows = Compressor(CompressionConfig(method="linear", bits=2)).encode(x).decoded
    whole = Compressor(CompressionConfig(method="linear", bits=2, granularity="tensor")).encode(x).decoded
    assert torch.equal(whole, per_tensor_linear(x, 2)) and not torch.equal(rows, whole)
    assert (rows - x).norm() < (whole - x).norm()


@pytest.mark.parametrize("rounding", ["centred", "paper"])
def test_per_tensor_statistical_is_the_row_codec_on_the_flattened_tensor(rounding):
    tensors = bucket(seed=5)
    config = CompressionConfig(method="statistical", bits=2, statistical_rounding=rounding)
    compressor, encoded = encode(CompressionConfig(method="statistical", bits=2, statistical_rounding=rounding,
                                                   granularity="tensor"), tensors)
    for x, got in zip(tensors, split(compressor.decode_bucket(encoded.data, SHAPES))):
        flat = x.reshape(1, -1)
        expected = Compressor(config).encode(flat).decoded.view(x.shape) if x.numel() else x
        assert torch.equal(got, expected)
    means = encoded.data[:4 * 4].view(torch.float32)
    torch.testing.assert_close(means, torch.stack([x.double().mean().float() for x in tensors if x.numel()]))


def sizes(config: CompressionConfig) -> int:
    """The wire format's size of SHAPES with each tensor one group (module docstring)."""
    groups = [r * c for r, c in SHAPES if r * c]
    n, b = sum(groups), config.bits
    if config.method == "linear":
        return 8 * len(groups) + math.ceil(n * b / 8)
    if config.method == "statistical":
        return 8 * len(groups) + 2 * len(groups) * 2 ** b + math.ceil(n * b / 8)
    kept = [math.ceil(config.topk_fraction * g) for g in groups]
    v = config.topk_value_bits
    values = 4 * sum(kept) if v == 32 else 8 * len(kept) + 2 * len(kept) * 2 ** v + math.ceil(sum(kept) * v / 8)
    # Indices are packed per run: the two (3, 16) tensors are one run of two groups of 48.
    runs = [(2, 48), (1, 40), (1, 320)]
    index = sum(math.ceil(r * math.ceil(config.topk_fraction * c) * max(1, (c - 1).bit_length()) / 8) for r, c in runs)
    return values + index


@pytest.mark.parametrize("config", [
    CompressionConfig(method="linear", bits=2, granularity="tensor"),
    CompressionConfig(method="statistical", bits=2, granularity="tensor"),
    CompressionConfig(method="statistical", bits=4, granularity="tensor"),
    CompressionConfig(method="topk", topk_fraction=0.1, granularity="tensor"),
    CompressionConfig(method="topk", topk_fraction=0.1, topk_value_bits=2, granularity="tensor")])
def test_payload_bytes_follow_the_wire_format(config):
    compressor, encoded = encode(config, bucket())
    assert encoded.nbytes == compressor.bucket_nbytes(SHAPES) == sizes(config)


def test_sparseloco_keeps_the_top_k_and_quantizes_their_values():
    tensors = bucket(seed=9)
    config = CompressionConfig(method="topk", topk_fraction=0.1, topk_value_bits=2, granularity="tensor")
    compressor, encoded = encode(config, tensors)
    decoded = compressor.decode_bucket(encoded.data, SHAPES)
    assert torch.equal(decoded, encoded.decoded)
    values = Compressor(CompressionConfig(method="statistical", bits=2))
    for x, got in zip(tensors, split(decoded)):
        flat, k = x.reshape(-1), math.ceil(0.1 * x.numel())
        top = flat.abs().topk(k).indices.sort().values
        assert set(got.reshape(-1).nonzero().reshape(-1).tolist()) <= set(top.tolist())  # a value may round to 0
        if k:  # the kept values, as a row of the statistical codec
            torch.testing.assert_close(got.reshape(-1)[top], values.encode(flat[top].unsqueeze(0)).decoded.reshape(-1))


@pytest.mark.parametrize("config", [
    CompressionConfig(method="linear", bits=2, granularity="tensor"),
    CompressionConfig(method="statistical", bits=2, granularity="tensor"),
    CompressionConfig(method="topk", topk_fraction=0.03, topk_value_bits=2, granularity="tensor"),
    CompressionConfig(method="topk", topk_fraction=0.03, topk_value_bits=2)])
def test_error_feedback_sends_plus_keeps_what_it_was_given(config):
    """Each sync: what is sent + the new error == the input + the old error; over many syncs nothing is lost."""
    compressor, feedback = Compressor(config), ErrorFeedback(beta=1.0)
    blocks, sent_total, total = SHAPES, 0, 0
    for step in range(10):
        delta = torch.cat([t.reshape(-1) for t in bucket(seed=100 + step)])
        old = feedback.error if feedback.error is not None else torch.zeros_like(delta)
        accumulated = feedback.accumulate(delta)
        encoded = compressor.encode_bucket(accumulated, blocks)
        feedback.keep(accumulated - encoded.decoded)
        received = compressor.decode_bucket(encoded.data, blocks)
        scale = delta.abs().max().item()
        torch.testing.assert_close(received + feedback.error, delta + old, rtol=0, atol=1e-6 * scale)
        sent_total, total = sent_total + received, total + delta
    torch.testing.assert_close(sent_total + feedback.error, total, rtol=0, atol=1e-5 * total.abs().max().item())


def test_a_crafted_index_beyond_its_tensor_is_refused():
    # A group of 40: 6-bit indices can name 40..63, which are outside it.
    shapes = ((1, 40),)
    compressor = Compressor(CompressionConfig(method="topk", topk_fraction=0.1, topk_value_bits=2, granularity="tensor"))
    data = compressor.encode_bucket(gaussian(40), shapes).data.clone()
    data[-3:] = 0xFF  # the packed indices are the payload's last bytes
    with pytest.raises(PayloadError, match="index beyond"):
        compressor.decode_bucket(data, shapes)


@pytest.mark.parametrize("config", [
    CompressionConfig(method="linear", bits=2, granularity="tensor"),
    CompressionConfig(method="topk", topk_fraction=0.1, topk_value_bits=2, granularity="tensor")])
def test_a_payload_of_another_size_is_refused(config):
    compressor, encoded = encode(config, bucket())
    for data in (encoded.data[:-1], torch.cat([encoded.data, encoded.data[:1]])):
        with pytest.raises(PayloadError, match="bytes"):
            compressor.decode_bucket(data, SHAPES)


@pytest.mark.parametrize("field,value", [("granularity", "column"), ("topk_value_bits", 3)])
def test_a_bad_group_setting_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        CompressionConfig(method="topk", **{field: value})
