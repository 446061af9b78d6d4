"""The outer exchange under attack, in process (tests/fake_wire.py: K ranks as threads, the real
exchange code). Two kinds of attacker:
- a stranger on the link, who can put any bytes on it but does not hold the job secret: forged or
  replayed messages fail their tags;
- a member that holds the secret but sends payloads that decode to NaN, lie about their norm, or
  inflate without bound: its payloads are checked by content.
Either way every honest rank rejects the same sender with the same reason, and the others' average is
the plain average of their own payloads (bit-identical on every rank)."""
from __future__ import annotations

import tracemalloc

import pytest
import torch
import zstandard

from fake_wire import Board, FakeWire, run_ranks
from job_keys import KEY
from muloco.diloco.auth import TAG_BYTES, JobKey
from muloco.diloco.averaging import Bucket, average_buckets
from muloco.diloco.packing import BucketPacking
from muloco.diloco.payload_checks import AUTHENTICATION, CLAIM_MISMATCH, MALFORMED, NONFINITE, OUTLIER
from muloco.diloco.compression import Compressor, Encoded, PayloadError
from muloco.diloco.config import CompressionConfig

SHAPES = ((6, 40), (3, 17))
STATISTICAL = CompressionConfig(method="statistical", bits=4)


def delta(worker: int, step: int, packing: BucketPacking) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + worker)
    return packing.flatten([torch.randn(shape, generator=generator) for shape in packing.shapes])


def exchange(workers: int, config: CompressionConfig = STATISTICAL, collective: str = "all_gather", step: int = 1,
             wires=None, compressors=None, leave_out: bool = False, max_norm_ratio: float = 10.0):
    """Every rank's Exchanged for one sync; wires[r] / compressors[r] replace rank r's own."""
    board = Board(workers)
    parts = workers if collective == "reduce_scatter" else 1
    packing = BucketPacking(SHAPES, parts)

    def rank(r: int):
        wire = (wires or {}).get(r) or FakeWire(board, r, KEY)
        if not isinstance(wire, FakeWire):
            wire = wire(board, r)
        wire.begin(outer_step=step, fragment=0)
        compressor = (compressors or {}).get(r, Compressor(config))
        return average_buckets([Bucket(compressor, packing, delta(r, step, packing))], wire, collective, "test",
                               max_norm_ratio=max_norm_ratio, leave_out=leave_out)
    return run_ranks(workers, rank), packing


def plain_average(senders: list[int], config: CompressionConfig, packing: BucketPacking, step: int = 1) -> torch.Tensor:
    compressor = Compressor(config)
    decoded = [compressor.decode_bucket(compressor.encode_bucket(delta(r, step, packing), packing.chunks[0]).data,
                                        packing.chunks[0]) for r in senders]
    total = decoded[0].clone()
    for d in decoded[1:]:
        total += d
    return total / len(decoded)


def assert_all_reject(results, expected: dict[int, str]) -> None:
    for r, result in enumerate(results):
        assert {k: v.split(" (")[0] for k, v in result.rejected.items()} == expected, (r, result.rejected)


def test_with_the_secret_every_rank_averages_exactly_as_without_it():
    signed, packing = exchange(3)
    unsigned, _ = exchange(3, wires={r: lambda board, r: FakeWire(board, r, key=None) for r in range(3)})
    reference = plain_average([0, 1, 2], STATISTICAL, packing)
    for a, b in zip(signed, unsigned):
        assert not a.rejected and torch.equal(a.averaged[0].average, reference)
        assert torch.equal(a.averaged[0].average, b.averaged[0].average)


class Stranger(FakeWire):
    """Puts its own bytes on the link in rank 2's seat, tagged with a key it made up."""

    def __init__(self, board, rank):
        super().__init__(board, rank, key=JobKey(b"s" * 32, "test-job"))


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_stranger_without_the_secret_is_rejected_by_every_rank(collective):
    results, packing = exchange(3, collective=collective, wires={2: Stranger})
    assert_all_reject(results[:2], {2: AUTHENTICATION})
    assert all(not r.averaged for r in results[:2])  # the single-world loop skips such a sync


def test_the_others_average_without_a_rejected_stranger_bit_identically():
    results, packing = exchange(3, wires={2: Stranger}, leave_out=True)
    reference = plain_average([0, 1], STATISTICAL, packing)
    for result in results[:2]:
        assert torch.equal(result.averaged[0].average, reference)


def test_flipping_one_bit_on_the_wire_fails_the_tag():
    def flip(op, sequence, data):
        data[5] ^= 1
        return data
    results, _ = exchange(3, wires={1: lambda board, r: FakeWire(board, r, KEY, tamper=flip)})
    assert_all_reject([results[0], results[2]], {1: AUTHENTICATION})
    # The sender's own part never crossed the link: it sees nothing wrong. The sync's metrics round
    # finds that disagreement (test_workers_that_disagree_on_a_rejection_stop_the_run).
    assert results[1].rejected == {}


def test_a_replayed_message_of_an_earlier_sync_fails_its_tag():
    recorded = {}

    def record(op, sequence, data):
        recorded[sequence] = data.clone()
        return data

    exchange(3, step=1, wires={1: lambda board, r: FakeWire(board, r, KEY, tamper=record)})
    replay = lambda op, sequence, data: recorded[sequence].clone()  # noqa: E731 - step 1's bytes at step 2
    results, _ = exchange(3, step=2, wires={1: lambda board, r: FakeWire(board, r, KEY, tamper=replay)})
    assert_all_reject([results[0], results[2]], {1: AUTHENTICATION})
    # The same bytes at the step they were made for pass: the step is what the tag refused.
    results, _ = exchange(3, step=1, wires={1: lambda board, r: FakeWire(board, r, KEY, tamper=replay)})
    assert all(not r.rejected for r in results)


def test_a_message_for_another_channel_or_job_fails_its_tag():
    other_job = JobKey(b"k" * 32, "another-job")
    results, _ = exchange(3, wires={0: lambda board, r: FakeWire(board, r, other_job)})
    assert_all_reject(results[1:], {0: AUTHENTICATION})
    results, _ = exchange(3, wires={0: lambda board, r: FakeWire(board, r, KEY, channel="metrics")})
    assert_all_reject(results[1:], {0: AUTHENTICATION})


class NaNCodebook(Compressor):
    """An insider's encoder: statistical payloads whose fp16 codebooks are NaN, while the claimed norm
    (computed from the honest decoding it returns) stays small and finite."""

    def encode_bucket(self, flat, blocks):
        honest = super().encode_bucket(flat, blocks)
        data = honest.data.clone()
        rows = sum(r for r, _ in blocks)
        book = data[8 * rows:8 * rows + 2 * rows * 16].view(torch.float16)
        book.fill_(float("nan"))
        return Encoded(data, honest.decoded)


class Inflated(Compressor):
    """An insider that sends its values x5 but claims the norm of the true ones."""

    def encode_bucket(self, flat, blocks):
        honest = super().encode_bucket(flat, blocks)
        data = (honest.data.clone().view(torch.float32) * 5).view(torch.uint8)
        return Encoded(data, honest.decoded)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_an_insider_whose_payload_decodes_to_nan_with_a_finite_claim_is_left_out(collective):
    results, packing = exchange(4, collective=collective, compressors={1: NaNCodebook(STATISTICAL)})
    assert_all_reject(results, {1: NONFINITE})
    if collective == "all_gather":
        left_out, _ = exchange(4, compressors={1: NaNCodebook(STATISTICAL)}, leave_out=True)
        reference = plain_average([0, 2, 3], STATISTICAL, packing)
        assert all(torch.equal(r.averaged[0].average, reference) for r in left_out)


def test_an_insider_lying_about_its_norm_is_left_out():
    config = CompressionConfig(method="none")
    results, _ = exchange(3, config=config, compressors={2: Inflated(config)})
    assert_all_reject(results, {2: CLAIM_MISMATCH})


def test_an_honest_outlier_is_left_out_by_the_norm_ratio():
    class Huge(Compressor):
        def encode_bucket(self, flat, blocks):
            return super().encode_bucket(flat * 1000, blocks)
    results, _ = exchange(4, compressors={3: Huge(STATISTICAL)})
    assert_all_reject(results, {3: OUTLIER})


class ZstdBomb(Compressor):
    """An insider's frame: a few KB that inflate to 256 MiB (its header says so)."""

    def encode_bucket(self, flat, blocks):
        honest = super().encode_bucket(flat, blocks)
        frame = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))
        return Encoded(torch.frombuffer(bytearray(frame), dtype=torch.uint8), honest.decoded)


def test_a_zstd_bomb_is_refused_within_its_blocks_size():
    config = CompressionConfig(method="statistical", bits=4, zstd=True)
    bomb = ZstdBomb(config)
    frame = bomb.encode_bucket(delta(0, 1, BucketPacking(SHAPES, 1)), SHAPES).data
    assert frame.numel() < 64 << 10
    tracemalloc.start()
    with pytest.raises(PayloadError, match="inflates past"):
        Compressor(config).decode_bucket(frame, SHAPES)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 << 20, f"decoding the bomb allocated {peak} bytes"
    results, _ = exchange(3, config=config, compressors={1: bomb})
    assert_all_reject(results, {1: MALFORMED})


def test_an_insider_claiming_a_huge_zstd_size_is_rejected_before_anything_is_allocated():
    config = CompressionConfig(method="statistical", bits=4, zstd=True)

    class BigClaims(FakeWire):
        def all_gather_ints(self, values, context):
            return super().all_gather_ints([values[0]] + [1 << 40 for _ in values[1:]], context)

    # Every rank (the liar too, running this code) counts the lie as zero bytes, so the buffers still
    # agree in size and nobody pads to a terabyte.
    results, _ = exchange(3, config=config, wires={1: lambda board, r: BigClaims(board, r, KEY)})
    assert_all_reject(results, {1: MALFORMED})


@pytest.mark.parametrize("config", [
    CompressionConfig(method="none"), STATISTICAL, CompressionConfig(method="statistical", bits=2),
    CompressionConfig(method="statistical", bits=8), CompressionConfig(method="linear", bits=4),
    CompressionConfig(method="topk", topk_fraction=0.1), CompressionConfig(method="statistical", bits=4, zstd=True)])
def test_random_bytes_decode_or_raise_payload_error_and_nothing_else(config):
    compressor = Compressor(config)
    size = compressor.bucket_nbytes(SHAPES) or 300
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = size if trial % 4 else int(torch.randint(0, 2 * size, (1,), generator=generator))
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        try:
            out = compressor.decode_bucket(data, SHAPES)
        except PayloadError:
            continue
        assert out.numel() == sum(r * c for r, c in SHAPES)


def test_tags_are_counted_in_the_bytes_sent():
    def sent(key) -> list[int]:
        board = Board(3)
        packing = BucketPacking(SHAPES, 1)

        def rank(r):
            wire = FakeWire(board, r, key)
            average_buckets([Bucket(Compressor(STATISTICAL), packing, delta(r, 1, packing))], wire, "all_gather", "t")
            return wire.take_stats().bytes_sent
        return run_ranks(3, rank)
    assert [a - b for a, b in zip(sent(KEY), sent(None))] == [2 * TAG_BYTES] * 3


def test_workers_that_disagree_on_a_rejection_stop_the_run():
    """A message altered on its way to some receivers only: those reject its sender, the sender does
    not, so their weights part. The metrics round compares the verdicts and every rank stops."""
    from dataclasses import astuple

    from muloco.diloco.wire import CollectiveError
    from muloco.diloco.sync_metrics import LocalSums, sync_record, verdict_digest

    def gathered(verdicts: list[float]) -> list[list[float]]:  # every worker's row, as the metrics round gathers it
        board = Board(3)
        return run_ranks(3, lambda r: FakeWire(board, r, KEY, channel="metrics").sum_per_worker(
            list(astuple(LocalSums(verdict=verdicts[r]))), 3, "t"))

    rejected, accepted = verdict_digest({1: AUTHENTICATION}, None), verdict_digest({}, None)
    for rows in gathered([rejected, accepted, rejected]):
        with pytest.raises(CollectiveError, match="disagree on which outer payloads to reject"):
            sync_record(rows, [0, 1, 2], 1, [1.0] * 3, "t")
    for rows in gathered([accepted] * 3):
        assert "averaged_norm" in sync_record(rows, [0, 1, 2], 1, [1.0] * 3, "t")
