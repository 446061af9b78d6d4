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

from trainer.diloco.collectives import (CollectiveError, all_finite, all_gather_average_many,
                                        reduce_scatter_average_many, row_split)
from trainer.diloco.compression import CompressionConfig, as_rows, make_codec

# (3, 17) and the single rows have fewer rows than K = 4 workers: some reduce-scatter chunks are empty.
SHAPES = [(9, 40), (3, 17), (50,), (1, 6)]
CONFIGS = [
    CompressionConfig(method="none"),
    CompressionConfig(method="statistical", bits=2, error_feedback=True),
    CompressionConfig(method="statistical", bits=4),
    CompressionConfig(method="statistical", bits=8, zstd=True),
    CompressionConfig(method="linear", bits=4, error_feedback=True, ef_beta=0.9),
    CompressionConfig(method="linear", bits=2, zstd=True),
    CompressionConfig(method="topk", topk_fraction=0.1, error_feedback=True),
    CompressionConfig(method="topk", topk_fraction=0.25, zstd=True),
]
OUTER_STEPS = 2  # the second step exercises the error-feedback state


def worker_deltas(worker: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return [torch.randn(shape, generator=generator) * (1 + worker) for shape in SHAPES]


def assert_identical_on_all_ranks(tensors: list[torch.Tensor], what: str) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for rank, other in enumerate(gathered):
        assert torch.equal(other.view(torch.int32), flat.view(torch.int32)), f"{what}: rank {rank} differs"


def decoded_chunks(codec, tensor: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    columns = as_rows(tensor).shape[1]
    plain = getattr(codec, "compressor", codec)
    return [plain.decode(p, (rows, columns)) for p, rows in zip(codec.compress_split(tensor, counts), counts)]


def reference_all_gather(codecs_by_worker, deltas_by_worker) -> list[torch.Tensor]:
    workers = len(deltas_by_worker)
    averages = []
    for i, shape in enumerate(SHAPES):
        total = None
        for worker in range(workers):
            codec = codecs_by_worker[worker][i]
            decoded = getattr(codec, "compressor", codec).decode(codec.compress(deltas_by_worker[worker][i]), shape)
            total = decoded if total is None else total + decoded
        averages.append(total / workers)
    return averages


def reference_reduce_scatter(codecs_by_worker, deltas_by_worker) -> list[torch.Tensor]:
    workers = len(deltas_by_worker)
    averages = []
    for i, shape in enumerate(SHAPES):
        counts = row_split(as_rows(torch.empty(shape)).shape[0], workers)
        total = None
        for worker in range(workers):
            decoded = torch.cat(decoded_chunks(codecs_by_worker[worker][i], deltas_by_worker[worker][i], counts))
            total = decoded if total is None else total + decoded
        plain = getattr(codecs_by_worker[0][i], "compressor", codecs_by_worker[0][i])
        averages.append(torch.cat(decoded_chunks(plain, total / workers, counts)).reshape(shape))
    return averages


def expected_bytes(config: CompressionConfig, collective: str, rank: int, workers: int) -> tuple[int, int]:
    """(sent, received) by the formulas in trainer/diloco/collectives.py, for fixed-size payloads."""
    plain = make_codec(CompressionConfig(method=config.method, bits=config.bits, topk_fraction=config.topk_fraction))
    if collective == "all_gather":
        total = sum(plain.payload_nbytes(shape) for shape in SHAPES)
        return (workers - 1) * total, (workers - 1) * total
    chunk_bytes = [[plain.payload_nbytes((rows, as_rows(torch.empty(shape)).shape[1]))
                    for rows in row_split(as_rows(torch.empty(shape)).shape[0], workers)] for shape in SHAPES]
    per_chunk = [sum(sizes[j] for sizes in chunk_bytes) for j in range(workers)]
    gather = (workers - 1) * max(per_chunk)
    sent = sum(per_chunk) - per_chunk[rank] + gather
    received = (workers - 1) * per_chunk[rank] + gather
    return sent, received


def check_collectives(rank: int, workers: int) -> None:
    for config in CONFIGS:
        for collective, run, reference in (("all_gather", all_gather_average_many, reference_all_gather),
                                           ("reduce_scatter", reduce_scatter_average_many, reference_reduce_scatter)):
            codecs = [make_codec(config) for _ in SHAPES]
            reference_codecs = [[make_codec(config) for _ in SHAPES] for _ in range(workers)]
            for step in range(OUTER_STEPS):
                what = f"{collective} {config} step {step}"
                deltas_by_worker = [worker_deltas(worker, step) for worker in range(workers)]
                averages, stats = run(deltas_by_worker[rank], codecs, None, context=f"test {what}")
                assert [a.shape for a in averages] == [torch.Size(s) for s in SHAPES], what
                assert all(a.dtype == torch.float32 for a in averages), what
                assert_identical_on_all_ranks(averages, what)
                expected = reference(reference_codecs, deltas_by_worker)
                for got, want in zip(averages, expected):
                    assert torch.equal(got, want), what
                if config.method == "none":
                    for i, got in enumerate(averages):
                        plain_average = sum(d[i] for d in deltas_by_worker) / workers
                        torch.testing.assert_close(got, plain_average, msg=what)
                if config.zstd and collective == "all_gather":
                    # sizes exchange plus the padded payloads, the same in both directions
                    assert stats.bytes_sent == stats.bytes_received > (workers - 1) * 8 * len(SHAPES), what
                elif config.zstd:
                    assert stats.bytes_sent > 0 and stats.bytes_received > 0, what
                else:
                    sent, received = expected_bytes(config, collective, rank, workers)
                    assert (stats.bytes_sent, stats.bytes_received) == (sent, received), (what, stats, sent, received)
                assert stats.seconds > 0, what


def bytes_for_one_large_tensor(rank: int) -> dict[str, int]:
    config = CompressionConfig(method="statistical", bits=4)
    delta = worker_deltas(rank, 0)[0].repeat(8, 8)  # (72, 320)
    _, gather = all_gather_average_many([delta], [make_codec(config)], None, context="bytes")
    _, scatter = reduce_scatter_average_many([delta], [make_codec(config)], None, context="bytes")
    return {"all_gather_sent": gather.bytes_sent, "reduce_scatter_sent": scatter.bytes_sent,
            "payload": make_codec(config).payload_nbytes(delta.shape)}


def check_all_finite(rank: int, workers: int) -> None:
    assert all_finite(True, None)
    delta = worker_deltas(rank, 0)[0]
    if rank == workers - 1:
        delta[0, 0] = float("nan")
    assert not all_finite(bool(torch.isfinite(delta).all()), None)


def check_failure_names_context(rank: int, workers: int) -> None:
    """A collective only rank 0 enters times out; the error names the caller's context."""
    lonely = dist.new_group(list(range(workers)), timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        try:
            all_gather_average_many([torch.ones(3)], [make_codec(CompressionConfig())], lonely,
                                    context="outer group 7, outer step 42")
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
    check_all_finite(rank, workers)
    summary = bytes_for_one_large_tensor(rank)
    if workers > 1:
        check_failure_names_context(rank, workers)
    if rank == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(summary, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
