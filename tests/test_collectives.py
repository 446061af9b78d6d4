"""Tests of the outer exchange (the outer group's collectives) and the skip vote. K = 2 and 4: one torchrun launch per K (gloo backend), the
checks themselves run inside tests/_collectives_worker.py on every rank. K = 1 runs in this process."""
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from muloco.diloco.averaging import Bucket, average_buckets

from muloco.diloco.packing import BucketPacking

from muloco.diloco.wire import GroupWire
from muloco.diloco.compression import Compressor
from muloco.diloco.config import CompressionConfig
from muloco.diloco.link import SlowLink

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "tests" / "_collectives_worker.py"
LAUNCH_TIMEOUT_S = 120


@cache
def launch(workers: int, out_dir: Path) -> dict:
    """Run the worker on `workers` ranks; returns rank 0's byte summary."""
    summary = out_dir / f"summary_k{workers}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
         str(WORKER), str(summary)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, f"K={workers} worker failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("collectives")


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.launch
def test_collectives_agree_bitwise_match_reference_and_count_bytes(workers, out_dir):
    launch(workers, out_dir)


@pytest.mark.launch
def test_reduce_scatter_bytes_stay_flat_while_all_gather_grows(out_dir):
    k2, k4 = launch(2, out_dir), launch(4, out_dir)
    payload = k2["payload"]
    # all-gather: (K-1) payloads; reduce-scatter: about 2 (K-1)/K payloads.
    assert k2["all_gather_sent"] == payload and k4["all_gather_sent"] == 3 * payload
    assert k4["reduce_scatter_sent"] <= 1.55 * payload
    assert k4["reduce_scatter_sent"] / k2["reduce_scatter_sent"] < 1.6


@pytest.fixture
def single_worker_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("config", [CompressionConfig(), CompressionConfig(method="statistical", bits=2, zstd=True),
                                    CompressionConfig(method="topk")])
def test_a_single_worker_averages_to_its_own_decoding_and_sends_nothing(config, single_worker_group):
    compressor, packing = Compressor(config), BucketPacking(((5, 7), (1, 11)), 1)
    flat = torch.randn(46)
    once = compressor.decode_bucket(compressor.encode_bucket(flat, packing.chunks[0]).data, packing.chunks[0])
    twice = compressor.decode_bucket(compressor.encode_bucket(once, packing.chunks[0]).data, packing.chunks[0])
    wire = GroupWire(None, link=None)
    for collective, expected in (("all_gather", once), ("reduce_scatter", twice)):  # reduce-scatter re-quantizes
        (result,) = average_buckets([Bucket(compressor, packing, flat)], wire, collective, "K=1").averaged
        assert torch.equal(result.average, expected), collective
        assert torch.equal(result.residual, flat - once), collective
    stats = wire.take_stats()
    assert (stats.bytes_sent, stats.bytes_received, stats.round_trips) == (0, 0, 0)


def test_bucket_packing_is_chunk_major_and_round_trips():
    tensors = [torch.arange(12.0).view(4, 3), torch.arange(100.0, 102.0).view(1, 2)]
    packing = BucketPacking(((4, 3), (1, 2)), parts=2)
    flat = packing.flatten(tensors)
    # chunk 0: rows 0-1 of the first tensor and the second's only row; chunk 1: rows 2-3 of the first
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 6, 7, 8, 9, 10, 11]
    assert packing.chunk_numels == [8, 6]
    assert all(torch.equal(a, b) for a, b in zip(packing.unflatten(flat), tensors))


def test_slow_link_delay_is_latency_plus_serialization():
    link = SlowLink(bandwidth_gbit_s=1.0, latency_ms=10.0)
    assert link.delay(0) == pytest.approx(0.01)
    assert link.delay(125_000_000) == pytest.approx(1.01)  # 1 Gbit at 1 Gbit/s
    with pytest.raises(ValueError, match=r"^bandwidth_gbit_s must be > 0, got 0\.0$"):
        SlowLink(bandwidth_gbit_s=0.0, latency_ms=1.0)
    with pytest.raises(ValueError, match=r"^latency_ms must be >= 0, got -1\.0$"):
        SlowLink(bandwidth_gbit_s=1.0, latency_ms=-1.0)
