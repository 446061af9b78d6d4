"""Which collectives gloo runs on the compute device's tensors (stage f of scripts/gpu_check.py, in 2 processes):

    python scripts/gloo_probe.py OUT.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def gloo_probe(out: Path) -> None:
    """Run in 2 processes: each collective the trainer and Megatron issue, over gloo, on the compute
    device's tensors; rank 0 writes {collective: "ok" | what went wrong} after each one. Each probe
    runs on a gloo group of its own with a short timeout: a collective that gloo cannot run on these
    tensors may leave its pairs broken (on the H200, once, "writev ... Bad address"), which must
    not fail the next probe or the barrier between them (the default group, which no probe uses)."""
    import torch
    import torch.distributed as dist

    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, device = dist.get_rank(), torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peer = 1 - rank

    def all_reduce(group):
        t = torch.full((4,), rank + 1.0, device=device)
        dist.all_reduce(t, group=group)
        return t, torch.full((4,), 3.0)

    def broadcast(group):
        t = torch.full((4,), float(rank), device=device)
        dist.broadcast(t, src=1, group=group)
        return t, torch.ones(4)

    def all_gather_into_tensor(group):
        out = torch.empty(4, device=device)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=device), group=group)
        return out, torch.tensor([0.0, 0.0, 1.0, 1.0])

    def reduce_scatter_tensor(group):
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(4.0, device=device), group=group)
        return out, 2 * torch.arange(4.0)[2 * rank:2 * rank + 2]

    def all_to_all_single(group):
        out = torch.empty(2, device=device)
        dist.all_to_all_single(out, torch.tensor([10.0 * rank, 10.0 * rank + 1], device=device), group=group)
        return out, torch.tensor([float(rank), 10.0 + rank])

    def send_recv(group):  # Megatron's pipeline p2p (batch_isend_irecv over isend/irecv)
        got = torch.empty(3, device=device)
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank), device=device), peer, group=group),
               dist.P2POp(dist.irecv, got, peer, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got, torch.full((3,), float(peer))

    results = {}
    for probe in (all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, send_recv):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
        try:
            got, expected = probe(group)
            results[probe.__name__] = "ok" if torch.equal(got.cpu(), expected) else f"wrong result {got.tolist()}"
        except Exception as err:  # noqa: BLE001 - the point is to record what fails
            results[probe.__name__] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if rank == 0:  # after each probe: a probe that hangs its peer still leaves what ran before it
            out.write_text(json.dumps({"device": str(device), "collectives": results}))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    gloo_probe(Path(sys.argv[1]))
