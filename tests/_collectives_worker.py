"""One rank of the multi-process collectives test (tests/test_collectives.py launches it with torchrun,
gloo backend). Every check runs here, on every rank; a failed check exits non-zero. Rank 0 writes the
byte counts the test compares across K to the JSON file named by argv[1].

The reference for each collective is the same algorithm evaluated in one process on all K workers'
data (every rank can regenerate every worker's tensors from its seed)."""
import datetime
import json
import sys

import torch
import torch.distributed as dist

from muloco.diloco.averaging import Bucket, average_buckets

from muloco.diloco.packing import BucketPacking

from muloco.diloco.payload_checks import CLAIM_BYTES

from muloco.diloco.wire import CollectiveError, GroupWire
from muloco.diloco.compression import Compressor, ErrorFeedback, rows_shape
from muloco.diloco.config import CompressionConfig
from muloco.diloco import vote

# Two buckets. (3, 17) and the single rows have fewer rows than K = 4 workers: some reduce-scatter
# chunks are empty.
BUCKETS = [[(9, 40), (3, 17)], [(50,), (1, 6)]]
CONFIGS = [
    CompressionConfig(method="none"),
    CompressionConfig(method="statistical", bits=2, error_feedback=True),
    CompressionConfig(method="statistical", bits=4),
    CompressionConfig(method="statistical", bits=8, zstd=True),
    CompressionConfig(method="linear", bits=4, error_feedback=True, ef_beta=0.9),
    CompressionConfig(method="linear", bits=2, zstd=True),
    CompressionConfig(method="topk", topk_fraction=0.1, error_feedback=True),
    CompressionConfig(method="topk", topk_fraction=0.25, zstd=True),
    CompressionConfig(method="linear", bits=2, error_feedback=True, granularity="tensor"),
    CompressionConfig(method="topk", topk_fraction=0.1, topk_value_bits=2, granularity="tensor", error_feedback=True),
]
OUTER_STEPS = 2  # the second step exercises the error-feedback state
HEADER_BYTES = 16  # a skip-vote ballot's size


def packings(parts: int) -> list[BucketPacking]:
    return [BucketPacking(tuple(rows_shape(s) for s in shapes), parts) for shapes in BUCKETS]


def worker_deltas(worker: int, step: int, parts: int) -> list[torch.Tensor]:
    """One flat buffer per bucket."""
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return [packing.flatten([torch.randn(shape, generator=generator) * (1 + worker) for shape in packing.shapes])
            for packing in packings(parts)]


def assert_identical_on_all_ranks(tensors: list[torch.Tensor], what: str) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for rank, other in enumerate(gathered):
        assert torch.equal(other.view(torch.int32), flat.view(torch.int32)), f"{what}: rank {rank} differs"


def round_trip(compressor: Compressor, flat: torch.Tensor, blocks) -> torch.Tensor:
    return compressor.decode_bucket(compressor.encode_bucket(flat, blocks).data, blocks)


def mean_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total / len(tensors)


def reference(compressor: Compressor, packing: BucketPacking, sent_by_worker: list[torch.Tensor], collective: str):
    """The average every rank must hold, from all workers' buffers, in one process."""
    if collective == "all_gather":
        return mean_in_order([round_trip(compressor, sent, packing.chunks[0]) for sent in sent_by_worker])
    chunks = []
    for j, chunk_blocks in enumerate(packing.chunks):
        parts = [sent.split(packing.chunk_numels)[j] for sent in sent_by_worker]
        average = mean_in_order([round_trip(compressor, part, chunk_blocks) for part in parts])
        chunks.append(round_trip(compressor, average, chunk_blocks))
    return torch.cat(chunks)


def expected_bytes(compressor: Compressor, collective: str, rank: int, workers: int) -> tuple[int, int]:
    """(sent, received) by the formulas in muloco/diloco/collectives.py, for fixed-size payloads,
    with a header of HEADER_BYTES (behind the payload claim) in the first collective, and the owners'
    verdicts (one byte per worker) and claims in front of the re-quantized chunks."""
    headers = (workers - 1) * (CLAIM_BYTES + HEADER_BYTES)
    if collective == "all_gather":
        total = sum(compressor.bucket_nbytes(packing.chunks[0]) for packing in packings(1))
        return (workers - 1) * total + headers, (workers - 1) * total + headers
    per_chunk = [sum(compressor.bucket_nbytes(packing.chunks[j]) for packing in packings(workers)) for j in range(workers)]
    gather = (workers - 1) * (max(per_chunk) + workers + CLAIM_BYTES)
    return sum(per_chunk) - per_chunk[rank] + gather + headers, (workers - 1) * per_chunk[rank] + gather + headers


def header_of(rank: int, step: int) -> torch.Tensor:
    return torch.tensor([rank, step], dtype=torch.float64).view(torch.uint8)


def check_collectives(rank: int, workers: int) -> None:
    wire = GroupWire(None, link=None)
    for config in CONFIGS:
        compressor = Compressor(config)
        for collective in ("all_gather", "reduce_scatter"):
            parts = workers if collective == "reduce_scatter" else 1
            feedback = [[ErrorFeedback(config.ef_beta) for _ in BUCKETS] for _ in range(workers)]
            for step in range(OUTER_STEPS):
                what = f"{collective} {config} step {step}"
                deltas = [worker_deltas(worker, step, parts) for worker in range(workers)]
                sent = [[feedback[k][b].accumulate(d) if config.error_feedback else d for b, d in enumerate(deltas[k])]
                        for k in range(workers)]
                exchanged = average_buckets(
                    [Bucket(compressor, packing, flat) for packing, flat in zip(packings(parts), sent[rank])],
                    wire, collective, f"test {what}", header=header_of(rank, step))
                stats, results = wire.take_stats(), exchanged.averaged
                assert [h.tolist() for h in exchanged.headers] == [header_of(k, step).tolist() for k in range(workers)]
                assert all(r.average.dtype == torch.float32 for r in results), what
                assert_identical_on_all_ranks([r.average for r in results], what)
                for b, (packing, result) in enumerate(zip(packings(parts), results)):
                    assert torch.equal(result.average, reference(compressor, packing, [s[b] for s in sent], collective)), what
                    if config.method == "none":
                        torch.testing.assert_close(result.average, mean_in_order([d[b] for d in deltas]), msg=what)
                    # the residual is what this rank's own payload did not carry
                    own = torch.cat([round_trip(compressor, part, chunk) for part, chunk in
                                     zip(sent[rank][b].split(packing.chunk_numels), packing.chunks)])
                    assert torch.equal(result.residual, sent[rank][b] - own), what
                for k in range(workers):  # every worker keeps its own residual (the reference's too)
                    for b, packing in enumerate(packings(parts)):
                        own = torch.cat([round_trip(compressor, part, chunk) for part, chunk in
                                         zip(sent[k][b].split(packing.chunk_numels), packing.chunks)])
                        feedback[k][b].keep(sent[k][b] - own)
                phases = 1 if collective == "all_gather" else 2
                assert stats.round_trips == phases * (2 if config.zstd else 1), (what, stats)
                if config.zstd:
                    assert stats.bytes_sent > 0 and stats.bytes_received > 0, what
                else:
                    expected = expected_bytes(compressor, collective, rank, workers)
                    assert (stats.bytes_sent, stats.bytes_received) == expected, (what, stats, expected)


def bytes_for_one_large_tensor(rank: int, workers: int) -> dict[str, int]:
    compressor = Compressor(CompressionConfig(method="statistical", bits=4))
    wire = GroupWire(None, link=None)
    delta = torch.randn(72, 320, generator=torch.Generator().manual_seed(rank))
    sent = {}
    for collective, parts in (("all_gather", 1), ("reduce_scatter", workers)):
        packing = BucketPacking(((72, 320),), parts)
        average_buckets([Bucket(compressor, packing, packing.flatten([delta]))], wire, collective, "bytes")
        sent[collective] = wire.take_stats().bytes_sent
    return {"all_gather_sent": sent["all_gather"], "reduce_scatter_sent": sent["reduce_scatter"],
            "payload": CLAIM_BYTES + compressor.payload_nbytes((72, 320))}  # a rank's part: its claim, its payload


def check_skip_vote(rank: int, workers: int) -> None:
    """The ballots reach every rank in the exchange's header (here with no buckets: the header alone
    still travels, in one round trip); every rank counts them alike."""
    wire = GroupWire(None, link=None)

    def decide(nonfinite: bool, sq_norm: float) -> tuple[list[float], str | None]:
        ballot = vote.ballot(nonfinite, sq_norm).view(torch.uint8)
        return vote.count(average_buckets([], wire, "all_gather", "vote", header=ballot).headers, max_norm_ratio=10.0)

    norms, reason = decide(False, float(rank + 1))
    assert reason is None and norms == [(k + 1) ** 0.5 for k in range(workers)], (norms, reason)
    assert wire.take_stats().round_trips == (1 if workers > 1 else 0)
    _, reason = decide(rank == workers - 1, 1.0)
    assert reason == "non-finite pseudogradient", reason
    _, reason = decide(False, 1e6 if rank == 1 else 1.0)
    assert reason is not None and "worker 1" in reason, reason


def check_failure_names_context(rank: int, workers: int) -> None:
    """A collective only rank 0 enters times out; the error names the caller's context."""
    lonely = dist.new_group(list(range(workers)), timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        packing = BucketPacking(((1, 3),), 1)
        try:
            average_buckets([Bucket(Compressor(CompressionConfig()), packing, torch.ones(3))], GroupWire(lonely, None),
                            "all_gather", "outer group 7, outer step 42")
        except CollectiveError as error:
            assert "outer group 7, outer step 42" in str(error), str(error)
        else:
            raise AssertionError("a collective no peer joined did not fail")
    dist.barrier()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, workers = dist.get_rank(), dist.get_world_size()
    check_collectives(rank, workers)
    check_skip_vote(rank, workers)
    summary = bytes_for_one_large_tensor(rank, workers)
    if workers > 1:
        check_failure_names_context(rank, workers)
    if rank == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(summary, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
