"""Helpers shared by the multi-process probes (scripts that run real trainings under torchrun and
dump what the tests compare) and by the tests that launch them. The API only grows: add, never change.

A probe rank dumps one dict: `rank_identity(topology)` (rank, coords, sizes) plus "snapshots", a
dict label -> `shard_state(...)` (its *shard* of the weights under canonical names: global layer
indices, the same at every pipeline size), plus whatever else the probe records. `worker_weights`
reassembles one worker's full T=1 weights from those dumps: tensor-parallel shards through
trainer.model.layout.unshard, pipeline stages by canonical name.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 300


def launch(script: Path, nprocs: int, args: Sequence[str], timeout: int = LAUNCH_TIMEOUT_S) -> str:
    """Run `script` on `nprocs` ranks (torchrun, gloo on CPU); fails with the output tail on error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
         str(script), *map(str, args)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, \
        f"{script.name} on {nprocs} ranks failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return result.stdout


def free_port() -> int:
    """A port nobody listens on now (other test sessions may hold the launchers' default 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Worker `worker`'s full (T=1 layout) weights at `snapshot`, from inner-DP replica `data_rank`."""
    from trainer.model.layout import layout_of, unshard

    shards: dict[str, dict[int, torch.Tensor]] = {}
    for dump in dumps:
        c = dump["coords"]
        if c["worker"] != worker or c["data"] != data_rank:
            continue
        for name, tensor in dump["snapshots"][snapshot].items():
            shards.setdefault(name, {})[c["tensor"]] = tensor
    assert shards, f"no dumps of worker {worker}"
    return {name: unshard([by_tp[t] for t in sorted(by_tp)], layout_of(name)) for name, by_tp in sorted(shards.items())}
