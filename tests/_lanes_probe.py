"""One rank of tests/test_datacenters.py's lanes test, inside its datacenter namespace (RANK, WORLD_SIZE,
MASTER_ADDR, GLOO_SOCKET_IFNAME set by the test):

    python tests/_lanes_probe.py OUT.json RATE_BITS PAYLOAD_BYTES

Through GroupWire's lanes (muloco/diloco/wire.py) and, for comparison, gloo's own collectives: an
all-gather and an all-to-all whose every byte is known (rank r's payload is r's pattern), checked
against it, and each form's link share: payload bytes sent per rank x 8 / rate over the time until every
rank is done. Rank 0 writes OUT.json."""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from muloco.diloco.wire import GroupWire, Lanes


def pattern(rank: int, n: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 31) % 251).to(torch.uint8)


def main() -> None:
    out, rate, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    K, rank = dist.get_world_size(), dist.get_rank()
    wires = {"lanes": GroupWire(None, None, lanes=Lanes(dist.new_group(), dist.new_group())),
             "collective": GroupWire(None, None)}
    mine = pattern(rank, n)
    chunk = n // K
    result = {}
    for form, wire in wires.items():
        gathered = wire.all_gather(mine, "probe")
        blocks = [mine[j * chunk:(j + 1) * chunk] for j in range(K)]
        received = wire.all_to_all(blocks, [chunk] * K, "probe")
        correct = (all(torch.equal(g, pattern(r, n)) for r, g in enumerate(gathered))
                   and all(torch.equal(b, pattern(r, n)[rank * chunk:(rank + 1) * chunk]) for r, b in enumerate(received)))
        shares = []
        for _ in range(2):
            dist.barrier()
            start = time.perf_counter()
            wire.all_gather(mine, "probe")
            dist.barrier()
            shares.append((K - 1) * n * 8 / rate / (time.perf_counter() - start))
        result[form] = {"correct": correct, "share": max(shares)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
