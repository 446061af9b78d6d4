"""Single-process tests of pseudogradient compression: bit packing, the three quantizers, buckets
(many tensors in one vectorised encode), zstd, error feedback, compression groups and the wire
format sizes."""
import math

import pytest
import torch

from muloco.diloco import compression
from muloco.diloco.compression import Compressor, ErrorFeedback, compression_group, pack_bits, unpack_bits
from muloco.diloco.config import METHODS, CompressionConfig, MuLoCoConfig
from muloco.diloco.outer_state import outer_sgd_direction
from muloco.core.errors import ConfigError
from muloco.core.typed_json import load


def gaussian(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def round_trip(config: CompressionConfig, x: torch.Tensor) -> torch.Tensor:
    compressor = Compressor(config)
    return compressor.decode(compressor.encode(x).data, x.shape)


def relative_error(config: CompressionConfig, x: torch.Tensor) -> float:
    return float((round_trip(config, x) - x).norm() / x.norm())


def send_with_feedback(feedback: ErrorFeedback, compressor: Compressor, delta: torch.Tensor) -> torch.Tensor:
    """One sync's sender side: what the receivers decode; the residual stays in `feedback`."""
    sent = feedback.accumulate(delta)
    encoded = compressor.encode(sent)
    feedback.keep(sent - encoded.decoded)
    return compressor.decode(encoded.data, delta.shape)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8, 12, 17])
@pytest.mark.parametrize("count", [0, 1, 7, 13, 1001])
def test_pack_bits_round_trip(width, count):
    values = torch.randint(0, 2 ** width, (count,), generator=torch.Generator().manual_seed(count))
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * width / 8)
    assert torch.equal(unpack_bits(packed, width, count), values)


def test_pack_bits_order_is_lowest_bits_first():
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([0xA, 0x5]), 4).tolist() == [0x5A]


# Measured on N(0, 1) rows of 1024 (relative L2 error): statistical 2/4/8 bits 0.402 / 0.108 / 0.023,
# linear 2/4/8 bits 0.635 / 0.124 / 0.0073. Statistical 8-bit (bin centres) is bounded by the +-3 sigma clamp.
@pytest.mark.parametrize("method,bits,bound", [
    ("statistical", 8, 0.025), ("statistical", 4, 0.12), ("statistical", 2, 0.45),
    ("linear", 8, 0.01), ("linear", 4, 0.14), ("linear", 2, 0.7)])
def test_quantizer_reconstruction_error(method, bits, bound):
    assert relative_error(CompressionConfig(method=method, bits=bits), gaussian(64, 1024)) < bound


@pytest.mark.parametrize("method,bits", [("statistical", 2), ("statistical", 4), ("statistical", 8),
                                         ("linear", 4), ("topk", 4), ("none", 4)])
def test_a_bucket_encodes_like_its_tensors_one_by_one(method, bits):
    """The vectorised bucket codec (runs of equal width merged) decodes every tensor exactly as a
    separate encode of that tensor would, and the encoder's own decoding is the receiver's."""
    compressor = Compressor(CompressionConfig(method=method, bits=bits, topk_fraction=0.1))
    tensors = [gaussian(5, 64, seed=1), gaussian(3, 64, seed=2), gaussian(1, 40, seed=3), gaussian(0, 9),
               gaussian(7, 33, seed=4) * 100]
    blocks = tuple(tuple(t.shape) for t in tensors)
    encoded = compressor.encode_bucket(torch.cat([t.reshape(-1) for t in tensors]), blocks)
    decoded = compressor.decode_bucket(encoded.data, blocks)
    assert torch.equal(decoded, encoded.decoded)
    assert encoded.nbytes == compressor.bucket_nbytes(blocks)
    one_by_one = torch.cat([round_trip(compressor.config, t).reshape(-1) for t in tensors])
    assert torch.equal(decoded, one_by_one)


@pytest.mark.parametrize("method,bits", [("statistical", 2), ("statistical", 4), ("statistical", 8),
                                         ("linear", 4), ("topk", 4), ("none", 4)])
def test_encoding_in_row_blocks_gives_the_same_payload(method, bits, monkeypatch):
    """A long run is encoded a few rows at a time (bounded temporaries); the bytes must not change."""
    compressor = Compressor(CompressionConfig(method=method, bits=bits, topk_fraction=0.1))
    blocks = ((37, 64), (11, 64), (1, 200), (5, 3))
    flat = torch.cat([gaussian(r, c, seed=r).reshape(-1) for r, c in blocks])
    whole = compressor.encode_bucket(flat, blocks)
    monkeypatch.setattr(compression, "BLOCK_ELEMENTS", 3 * 64)  # 3 rows of the 64-wide run per block
    piecewise = compressor.encode_bucket(flat, blocks)
    assert torch.equal(piecewise.data, whole.data) and torch.equal(piecewise.decoded, whole.decoded)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_statistical_rows_decode_to_at_most_one_value_per_bin(bits):
    decoded = round_trip(CompressionConfig(method="statistical", bits=bits), gaussian(16, 1000) * 3 + 1)
    assert all(row.unique().numel() <= 2 ** bits for row in decoded)


def test_statistical_bins_and_codebook_by_hand():
    # mean 0, sigma sqrt(2.5); 2 bits: edges -3s, -1.5s, 0, 1.5s, 3s. Bins 0 and 3 are empty and
    # decode to their centers; bins 1 and 2 decode to the mean of their members; 0 opens bin 2.
    x = torch.tensor([[-2.0, -1.0, 1.0, 2.0]])
    assert torch.allclose(round_trip(CompressionConfig(method="statistical", bits=2), x),
                          torch.tensor([[-1.5, -1.5, 1.5, 1.5]]), rtol=1e-3)  # fp16 codebook
    outlier_row = torch.tensor([[0.0] * 99 + [100.0]])  # far outside 3 sigma: clamped into the top bin
    decoded = round_trip(CompressionConfig(method="statistical", bits=2), outlier_row)
    assert decoded[0, -1] == pytest.approx(100.0, rel=1e-3) and torch.allclose(decoded[0, :-1], torch.zeros(99), atol=1e-3)


@pytest.mark.parametrize("method", ["statistical", "linear"])
def test_constant_rows_decode_exactly(method):
    x = torch.full((3, 10), 0.25)
    assert torch.equal(round_trip(CompressionConfig(method=method, bits=2), x), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_linear_levels_stay_within_row_range(bits):
    x = gaussian(8, 300)
    decoded = round_trip(CompressionConfig(method="linear", bits=bits), x)
    assert torch.equal(decoded.amin(dim=1), x.amin(dim=1))
    assert (decoded <= x.amax(dim=1, keepdim=True) + 1e-6).all()
    assert all(row.unique().numel() <= 2 ** bits for row in decoded)


def test_topk_keeps_exactly_the_largest_magnitudes():
    x = gaussian(6, 333)
    decoded = round_trip(CompressionConfig(method="topk", topk_fraction=0.05), x)
    k = math.ceil(0.05 * 333)
    top = x.abs().topk(k, dim=1).indices
    expected = torch.zeros_like(x).scatter_(1, top, torch.gather(x, 1, top))
    assert torch.equal(decoded, expected)


def test_tensor_parallel_row_chunks_decode_like_the_whole_matrix():
    x = gaussian(10, 64)
    for method in METHODS:
        for bits in (2, 4, 8):
            config = CompressionConfig(method=method, bits=bits, topk_fraction=0.1)
            halves = torch.cat([round_trip(config, x[:5]), round_trip(config, x[5:])])
            assert torch.equal(round_trip(config, x), halves), (method, bits)


def test_one_dimensional_tensors_are_one_row():
    x = gaussian(200)
    config = CompressionConfig(method="statistical", bits=4)
    assert torch.equal(round_trip(config, x), round_trip(config, x.unsqueeze(0)).squeeze(0))


@pytest.mark.parametrize("method", METHODS)
def test_zstd_round_trip_matches_uncompressed(method):
    x = gaussian(12, 257)
    plain = CompressionConfig(method=method, bits=4)
    zstd = CompressionConfig(method=method, bits=4, zstd=True)
    payload = Compressor(zstd).encode(x)
    assert payload.data[:4].tolist() == [0x28, 0xB5, 0x2F, 0xFD]  # zstd frame magic
    assert Compressor(zstd).payload_nbytes(x.shape) is None
    assert torch.equal(Compressor(zstd).decode(payload.data, x.shape), round_trip(plain, x))


@pytest.mark.parametrize("shape", [(7, 33), (1, 1), (5,), (0, 9)])
def test_payload_bytes_follow_the_wire_format(shape):
    n_rows, n_cols = (1, shape[0]) if len(shape) == 1 else shape
    k = min(n_cols, math.ceil(0.02 * n_cols))
    index_bits = max(1, (n_cols - 1).bit_length())
    expected = {
        ("none", 4): 4 * n_rows * n_cols,
        ("topk", 4): 4 * n_rows * k + math.ceil(n_rows * k * index_bits / 8),
        # fp32 means and sigmas, fp16 codebooks up to 4 bits (none at 8)
        **{("statistical", b): 8 * n_rows + 2 * n_rows * 2 ** b + math.ceil(n_rows * n_cols * b / 8) for b in (2, 4)},
        ("statistical", 8): 8 * n_rows + n_rows * n_cols,
        **{("linear", b): 8 * n_rows + math.ceil(n_rows * n_cols * b / 8) for b in (2, 4, 8)},
    }
    x = gaussian(*shape)
    for (method, bits), nbytes in expected.items():
        compressor = Compressor(CompressionConfig(method=method, bits=bits))
        assert compressor.encode(x).nbytes == compressor.payload_nbytes(shape) == nbytes, (method, bits)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_shows_in_the_decoding(method, bad):
    x = gaussian(4, 50)
    x[2, 7] = bad
    assert not torch.isfinite(round_trip(CompressionConfig(method=method, bits=2), x)).all()


@pytest.mark.parametrize("method,bits", [("statistical", 2), ("linear", 2), ("topk", 4)])
def test_error_feedback_carries_exactly_what_was_not_sent(method, bits):
    compressor, feedback = Compressor(CompressionConfig(method=method, bits=bits)), ErrorFeedback(beta=1.0)
    deltas = [gaussian(8, 100, seed=step) for step in range(20)]
    sent = sum(send_with_feedback(feedback, compressor, delta) for delta in deltas)
    total = sum(deltas)
    torch.testing.assert_close(sent + feedback.error, total, rtol=0, atol=1e-5 * total.abs().max().item())


@pytest.mark.parametrize("method,bits", [("statistical", 2), ("linear", 2)])
def test_error_feedback_keeps_the_accumulated_two_bit_error_small(method, bits):
    # A consistent direction plus noise, like pseudogradients over outer steps. Measured over 50 steps:
    # relative error of the summed updates 0.23 without error feedback, 0.03-0.04 with it.
    config = CompressionConfig(method=method, bits=bits)
    direction = gaussian(16, 256, seed=1)
    deltas = [0.3 * direction + gaussian(16, 256, seed=2 + step) for step in range(50)]
    total = sum(deltas)
    compressor, feedback = Compressor(config), ErrorFeedback(beta=1.0)
    error_without = (sum(round_trip(config, d) for d in deltas) - total).norm() / total.norm()
    error_with = (sum(send_with_feedback(feedback, compressor, d) for d in deltas) - total).norm() / total.norm()
    assert error_with < 0.25 * error_without


def test_error_feedback_beta_decays_the_buffer():
    compressor, feedback = Compressor(CompressionConfig(method="topk", topk_fraction=0.5)), ErrorFeedback(beta=0.5)
    send_with_feedback(feedback, compressor, torch.tensor([1.0, 4.0]))  # sends 4, keeps 1
    assert torch.equal(send_with_feedback(feedback, compressor, torch.tensor([0.0, 0.0])), torch.tensor([0.5, 0.0]))


def test_error_feedback_rejects_a_different_shape():
    feedback = ErrorFeedback(beta=1.0)
    feedback.keep(torch.zeros(12))
    with pytest.raises(ValueError, match="shape"):
        feedback.accumulate(torch.zeros(13))


def test_lossless_method_decodes_exactly():
    x = gaussian(3, 5)
    assert torch.equal(round_trip(CompressionConfig(), x), x)


def test_compression_groups_pick_their_bit_widths():
    config = CompressionConfig(method="statistical", bits=4, embedding_bits=8, vector_bits=32, error_feedback=True)
    assert [compression_group(s, e) for s, e in [((8, 4), False), ((8,), False), ((100, 8), True)]] == \
        ["matrix", "vector", "embedding"]
    assert (config.for_group("matrix").bits, config.for_group("embedding").bits) == (4, 8)
    vector = config.for_group("vector")
    assert vector.method == "none" and not vector.error_feedback  # 32: fp32, nothing to feed back
    assert CompressionConfig().for_group("matrix").method == "none"


def test_decode_rejects_a_payload_of_the_wrong_size():
    compressor = Compressor(CompressionConfig(method="linear", bits=4))
    with pytest.raises(ValueError, match="payload"):
        compressor.decode(compressor.encode(gaussian(4, 10)).data, (4, 12))


@pytest.mark.parametrize("field,value", [
    ("method", "quantum"), ("bits", 3), ("topk_fraction", 0.0), ("topk_fraction", 1.5),
    ("ef_beta", -0.1), ("zstd_level", 0), ("embedding_bits", 16), ("vector_bits", 3), ("ef_form", "official"),
    ("statistical_rounding", "floor")])
def test_config_validation_names_the_bad_field(field, value):
    settings = {"method": "statistical", field: value}
    with pytest.raises(ValueError, match=f"^{field} must be"):
        CompressionConfig(**settings)


@pytest.mark.parametrize("key, value, allowed", [("ef_form", "official", "'plain', 'paper'"),
                                                 ("statistical_rounding", "centered", "'centred', 'paper'")])
def test_a_bad_ef_form_or_rounding_in_the_muloco_block_is_one_config_error(key, value, allowed):
    block = {"compression": {"method": "statistical", key: value}}
    with pytest.raises(ConfigError) as raised:
        load(MuLoCoConfig, block, "muloco")
    assert str(raised.value) == f"muloco.compression.{key} must be one of {allowed}, got '{value}'"


# -- the official forms -------------------------------------------------------------------------------

def official_rowwise_statistical(x: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The official row-wise statistical quantizer written out in float64: code = round(c/s + n/2)
    clamped to [0, n-1], s = 6 sigma / n with the unbiased sigma (1 when 0), lookup = each bin's mean."""
    x = x.double()
    n, cols = 2 ** bits, x.shape[1]
    mean = x.mean(dim=1, keepdim=True)
    c = x - mean
    sigma = c.norm(dim=1, keepdim=True) / math.sqrt(max(cols - 1, 1))
    s = torch.where(sigma > 0, 6 * sigma / n, torch.ones_like(sigma))
    raw = c / s + n // 2
    code = raw.round().clamp(0, n - 1).long()
    sums = torch.zeros(x.shape[0], n, dtype=torch.float64).scatter_add_(1, code, c)
    counts = torch.zeros(x.shape[0], n, dtype=torch.float64).scatter_add_(1, code, torch.ones_like(c))
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return {"mean": mean[:, 0], "sigma": sigma[:, 0], "s": s, "raw": raw, "code": code, "counts": counts,
            "lookup": lookup, "decoded": mean + lookup.gather(1, code)}


def statistical_wire(data: torch.Tensor, rows: int, numel: int, bits: int) -> dict[str, torch.Tensor]:
    """The sections of a statistical payload, as the module docstring lays them out."""
    book = 2 * rows * 2 ** bits if bits <= 4 else 0
    sections = {"mean": data[:4 * rows].view(torch.float32), "sigma": data[4 * rows:8 * rows].view(torch.float32),
                "code": unpack_bits(data[8 * rows + book:], bits, numel).view(rows, -1)}
    if book:
        sections["book"] = data[8 * rows:8 * rows + book].view(torch.float16).view(rows, -1).float()
    return sections


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_paper_rounding_is_the_official_round_c_over_s_plus_half_n(bits):
    x = 0.01 * gaussian(16, 301, seed=bits) + 0.003
    x[0] = 0.5  # a constant row
    x[1, :4] = torch.tensor([0.3, -0.2, 0.15, -0.4])  # outliers far beyond 3 sigma: clamped
    compressor = Compressor(CompressionConfig(method="statistical", bits=bits, statistical_rounding="paper"))
    encoded = compressor.encode(x)
    wire, ref = statistical_wire(encoded.data, *x.shape[:1], x.numel(), bits), official_rowwise_statistical(x, bits)
    torch.testing.assert_close(wire["mean"].double(), ref["mean"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(wire["sigma"].double(), ref["sigma"], rtol=1e-5, atol=1e-9)
    # Codes agree wherever c/s + n/2 is not within 1e-3 of a rounding boundary (fp32 vs fp64).
    clear = ((ref["raw"] - ref["raw"].floor()) - 0.5).abs() > 1e-3
    assert clear.float().mean() > 0.99
    assert torch.equal(wire["code"][clear], ref["code"][clear])
    assert wire["code"][1, :4].tolist() == [2 ** bits - 1, 0, 2 ** bits - 1, 0]
    sigma = ref["sigma"].clamp(min=1e-30).unsqueeze(1)
    if bits <= 4:  # fp16 codebook in units of sigma = the official per-bin means (fp16: rtol 2**-11)
        used = ref["counts"] > 0
        torch.testing.assert_close(wire["book"].double()[used], (ref["lookup"] / sigma)[used], rtol=1e-3, atol=1e-4)
        ours, theirs = encoded.decoded.double() - ref["mean"].unsqueeze(1), ref["decoded"] - ref["mean"].unsqueeze(1)
        assert ((ours - theirs).abs() <= 1e-3 * theirs.abs() + 1e-4 * sigma + 1e-7).all()
    else:  # 8 bits: codes decode to their bin centres (n - n/2) s
        centres = ref["mean"].unsqueeze(1) + (ref["code"] - 2 ** bits // 2) * ref["s"] * (sigma > 1e-30)
        torch.testing.assert_close(encoded.decoded.double(), centres, rtol=0, atol=1e-7)
    assert torch.equal(compressor.decode(encoded.data, x.shape), encoded.decoded)
    assert torch.equal(encoded.decoded[0], x[0])  # a constant row decodes exactly


def test_paper_rounding_bins_are_off_centre_and_centred_bins_mirror():
    """At 2 bits the official bins are centred on -2s, -s, 0, +s (s = 1.5 sigma): a row and its negation
    do not decode to negations of each other; the centred bins do (exactly, away from bin edges)."""
    x = gaussian(8, 512, seed=3)
    for rounding, mirrors in (("centred", True), ("paper", False)):
        config = CompressionConfig(method="statistical", bits=2, statistical_rounding=rounding)
        mirrored = torch.allclose(round_trip(config, -x), -round_trip(config, x), rtol=0, atol=1e-2)
        assert mirrored == mirrors, rounding


def official_topk(x: torch.Tensor, fraction: float) -> torch.Tensor:
    k = math.ceil(fraction * x.shape[1])
    index = x.abs().topk(k, dim=1).indices
    return torch.zeros_like(x).scatter_(1, index, x.gather(1, index))


def ef_sync(feedback: list[ErrorFeedback], compressor: Compressor, deltas: list[torch.Tensor]) -> torch.Tensor:
    """One sync of K workers in one process: each sends its error-fed delta; the average of the decodings."""
    decoded = [send_with_feedback(f, compressor, d) for f, d in zip(feedback, deltas)]
    return sum(decoded) / len(decoded)


@pytest.mark.parametrize("beta", [0.9, 1.0])
def test_paper_error_feedback_and_outer_step_are_the_official_update(beta):
    """The official QuantizedOuterSGD in float64: e_k = beta e_k + lr delta_k; q_k = deQ(Q(e_k)); e_k -= q_k;
    grad = mean_k q_k; torch.optim.SGD(lr, momentum, nesterov) steps on it (the sent values, not divided by lr)."""
    lr, mu, workers, shape, fraction = 0.7, 0.9, 2, (8, 64), 0.25
    config = CompressionConfig(method="topk", topk_fraction=fraction, error_feedback=True, ef_form="paper",
                               ef_beta=beta)
    compressor, feedback = Compressor(config), [ErrorFeedback.from_config(config, lr) for _ in range(workers)]
    theta, momentum = gaussian(*shape, seed=100), torch.zeros(shape)
    reference = torch.nn.Parameter(theta.double().clone())
    outer = torch.optim.SGD([reference], lr=lr, momentum=mu, nesterov=True)
    errors = [torch.zeros(shape, dtype=torch.float64) for _ in range(workers)]
    for sync in range(5):
        deltas = [0.01 * gaussian(*shape, seed=10 * sync + k) + 0.002 * sync for k in range(workers)]
        theta.add_(outer_sgd_direction(ef_sync(feedback, compressor, deltas), momentum, mu, nesterov=True), alpha=-lr)
        sent = []
        for k in range(workers):
            if beta != 1.0:
                errors[k].mul_(beta)
            errors[k].add_(deltas[k].double(), alpha=lr)
            sent.append(official_topk(errors[k], fraction))
            errors[k].sub_(sent[-1])
        reference.grad = sum(sent) / workers
        outer.step()
        torch.testing.assert_close(theta.double(), reference.detach(), rtol=1e-6, atol=1e-7)
        for k in range(workers):
            torch.testing.assert_close(feedback[k].error.double(), errors[k], rtol=1e-6, atol=1e-8)


def test_paper_error_feedback_is_plain_error_feedback_at_the_squared_outer_lr():
    """With an outer lr of 0.5 (scaling by it is exact in fp32) the paper form's buffers and sends are
    exactly 0.5 x the plain form's, and its weights after each step equal plain at outer lr 0.25."""
    runs = {}
    for form, lr in (("paper", 0.5), ("plain", 0.25)):
        config = CompressionConfig(method="statistical", bits=2, error_feedback=True, ef_form=form, ef_beta=0.9,
                                   statistical_rounding="paper")
        compressor, feedback = Compressor(config), [ErrorFeedback.from_config(config, 0.5) for _ in range(2)]
        theta, momentum, trace = gaussian(16, 96, seed=7), torch.zeros(16, 96), []
        for sync in range(4):
            deltas = [0.01 * gaussian(16, 96, seed=20 * sync + k) for k in range(2)]
            average = ef_sync(feedback, compressor, deltas)
            theta.add_(outer_sgd_direction(average, momentum, 0.9, nesterov=True), alpha=-lr)
            trace.append((average, feedback[0].error.clone(), theta.clone()))
        runs[form] = trace
    for (paper_avg, paper_error, paper_theta), (plain_avg, plain_error, plain_theta) in zip(runs["paper"], runs["plain"]):
        assert torch.equal(paper_avg, 0.5 * plain_avg) and torch.equal(paper_error, 0.5 * plain_error)
        assert torch.equal(paper_theta, plain_theta)


def test_error_feedback_resumes_exactly_from_its_buffer():
    """The buffer is the whole state (the form and beta are config): a copy continues bit-identically."""
    config = CompressionConfig(method="statistical", bits=2, error_feedback=True, ef_form="paper", ef_beta=0.9,
                               statistical_rounding="paper")
    compressor, running = Compressor(config), ErrorFeedback.from_config(config, 0.7)
    deltas = [gaussian(8, 40, seed=s) for s in range(6)]
    for d in deltas[:3]:
        send_with_feedback(running, compressor, d)
    resumed = ErrorFeedback.from_config(config, 0.7)
    resumed.keep(running.error.clone())
    for d in deltas[3:]:
        assert torch.equal(send_with_feedback(resumed, compressor, d), send_with_feedback(running, compressor, d))
