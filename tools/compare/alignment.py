"""The paper's alignment measure (its Fig. 4): at chosen outer steps n, the cosine between

- Delta_K, the K-worker averaged pseudogradient of sync n (as the outer optimizer received it, so
  after compression when there is some), and
- Delta_1 = theta_global(n-1) - theta after H inner steps of ONE worker with the full global batch B
  (the same samples: the union of the K workers' micro-batches), started from the same global
  weights at the same lr-schedule position, with worker 0's inner optimizer state at step (n-1)H.

Both come from the real trainer. The K-worker run saves a checkpoint after every sync. Delta_K is
recovered exactly from the outer momentum of consecutive checkpoints: the outer step does
m_n = mu m_(n-1) + Delta_K, so Delta_K = m_n - mu m_(n-1). The reference is a launch of the same inner
optimizer without the outer loop, K = 1 and global batch B, started with `--load-worker 0` from the
checkpoint at step (n-1)H (after a sync every worker holds the global weights; the inner optimizer
state is worker 0's, the choice the measure needs because one worker's state must be picked) and
stopped after H steps (`--exit-interval H`, which saves). Checkpoints are read with safetensors and
JSON only, and removed once measured. The cosine is over all parameters at once.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.compare.launch import Data, launch, run_config, trainer_flags
from tools.compare.protocol import Method, RunSpec, Settings
from tools.compare.records import Alignment
from trainer.checkpoint.format import LATEST, CheckpointReader, iteration_dir
from trainer.topology import RankCoordinates

# Fractions of the run at which to measure (outer steps 2, 5 and 9 of 10 at the full protocol).
SYNC_FRACTIONS = (0.2, 0.5, 0.9)


def alignment_syncs(num_syncs: int) -> tuple[int, ...]:
    """The outer steps measured: from 2 on, since sync 1 would start from the initialization, which no
    checkpoint holds."""
    return tuple(sorted({min(num_syncs, max(2, round(f * num_syncs))) for f in SYNC_FRACTIONS})) if num_syncs > 1 else ()


def checkpoint_flags(settings: Settings, root: Path) -> list[str]:
    """What the K-worker run adds to save after every sync."""
    return ["--save", str(root), "--save-interval", str(settings.sync_interval)]


def _worker0_state(root: Path, step: int):
    reader = CheckpointReader(root, step)
    return reader.rank_state(reader.meta.rank_of(RankCoordinates(0, 0, 0, 0)))


def averaged_pseudogradient(root: Path, outer_step: int, sync_interval: int, momentum: float) -> dict[str, torch.Tensor]:
    """Delta_K of sync `outer_step` from the outer momentum saved after it and after the one before."""
    new = _worker0_state(root, outer_step * sync_interval)["extra"]["muloco"]["momentum"]
    old = _worker0_state(root, (outer_step - 1) * sync_interval)["extra"]["muloco"]["momentum"]
    return {name: new[name] - momentum * old[name] for name in new}


def pseudogradient(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: start[name] - end[name] for name in start}


@dataclass(frozen=True)
class Comparison:
    cosine: float
    norm_ratio: float  # |a| / |b|


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Comparison:
    """Cosine of two pseudogradients over all parameters together (fp64 sums)."""
    if set(a) != set(b):
        raise ValueError(f"pseudogradients over different parameters: {sorted(set(a) ^ set(b))[:5]}")
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in a)
    aa = sum(float(a[n].double().square().sum()) for n in a)
    bb = sum(float(b[n].double().square().sum()) for n in a)
    return Comparison(dot / math.sqrt(aa * bb), math.sqrt(aa / bb))


def _start_view(run_root: Path, step: int, view: Path) -> Path:
    """A checkpoint root whose `latest` is step `step` of `run_root` (--load starts from `latest`)."""
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    (view / iteration_dir(view, step).name).symlink_to(iteration_dir(run_root, step).resolve())
    (view / LATEST).write_text(f"{step}\n")
    return view


def reference_pseudogradient(method: Method, spec: RunSpec, settings: Settings, data: Data, run_root: Path,
                             outer_step: int, work: Path) -> dict[str, torch.Tensor]:
    """Delta_1 of sync `outer_step`: one worker, full batch, H steps from the K-run's state at (n-1)H."""
    H = settings.sync_interval
    start = (outer_step - 1) * H
    view = _start_view(run_root, start, work / "start")
    flags = [*trainer_flags(spec, settings, data, 1, work, eval_interval=0), "--load", str(view),
             "--load-worker", "0", "--save", str(work / "ckpt"), "--exit-interval", str(H)]
    launch(run_config(method, settings, spec.outer_lr, outer_loop=False), flags, 1, work, settings.run_timeout_s)
    begin = _worker0_state(run_root, start)["extra"]["muloco"]["global_weights"]
    end = _worker0_state(work / "ckpt", start + H)["model"]
    return pseudogradient(begin, end)


def measure(method: Method, spec: RunSpec, settings: Settings, data: Data, run_root: Path, work: Path,
            syncs: tuple[int, ...]) -> Alignment:
    """The alignment at `syncs` of a finished K-worker run whose checkpoints are under `run_root`."""
    momentum = method.outer[1]
    cosines, ratios = [], []
    for n in syncs:
        result = compare(averaged_pseudogradient(run_root, n, settings.sync_interval, momentum),
                         reference_pseudogradient(method, spec, settings, data, run_root, n, work / f"sync{n}"))
        cosines.append(result.cosine)
        ratios.append(result.norm_ratio)
    return Alignment(list(syncs), cosines, ratios)
