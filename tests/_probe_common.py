"""Weight dumps of multi-process probes (scripts that run real trainings under a launcher and dump
what the tests compare; tools/trainer_runs.py launches and assembles the runs). The API only
grows: add, never change.

A probe rank dumps one dict: `rank_identity(topology)` (rank, coords, sizes) plus "snapshots", a
dict label -> `shard_state(...)` (its *shard* of the weights under canonical names: global layer
indices, the same at every pipeline size), plus whatever else the probe records. `worker_weights`
reassembles one worker's full T=1 weights from those dumps: tensor-parallel shards through
trainer.model.sharding.unshard, pipeline stages by canonical name.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch


# -- inside a probe rank ---------------------------------------------------------------------------

@torch.no_grad()
def shard_state(model: torch.nn.Module, canonical: dict[str, str]) -> dict[str, torch.Tensor]:
    """This rank's parameters as fp32 CPU copies, keyed by canonical name."""
    return {canonical[name]: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def rank_identity(topology) -> dict:
    """What `worker_weights` needs to know about a dump's rank."""
    return {"rank": topology.rank, "coords": asdict(topology.coords), "sizes": asdict(topology.sizes)}


# -- in the test -----------------------------------------------------------------------------------

def load_rank_dumps(folder: Path) -> list[dict]:
    """Every rank's dump in a folder (files rank<N>.pt), in rank order."""
    paths = sorted(folder.glob("rank*.pt"), key=lambda p: int(p.stem[len("rank"):]))
    assert paths, f"no rank dumps in {folder}"
    return [torch.load(p, weights_only=False) for p in paths]


def worker_weights(dumps: list[dict], worker: int, snapshot: str, data_rank: int = 0) -> dict[str, torch.Tensor]:
    """Worker `worker`'s full (unsharded) weights at `snapshot`, from inner-DP replica `data_rank`."""
    from trainer.model.sharding import sharding_of, unshard

    shards: dict[str, dict[int, torch.Tensor]] = {}
    for dump in dumps:
        c = dump["coords"]
        if c["worker"] != worker or c["data"] != data_rank:
            continue
        for name, tensor in dump["snapshots"][snapshot].items():
            shards.setdefault(name, {})[c["tensor"]] = tensor
    assert shards, f"no dumps of worker {worker}"
    return {name: unshard([by_tp[t] for t in sorted(by_tp)], sharding_of(name)) for name, by_tp in sorted(shards.items())}
