"""The paper's alignment measure (its Fig. 4), as its official launchers take it: branches from shared
mid-training states of the data-parallel baselines.

The DP Muon (for MuLoCo) and DP AdamW (for DiLoCo) test runs keep their checkpoints at three start
steps (START_FRACTIONS of the run, multiples of H): weights, inner optimizer state and the position
in the lr schedule. From each, with the real trainer (`--load-worker 0`, which takes the run's own
hyperparameters at that position):
- the branch: the method's K workers run H steps, each on its B/K slice of the global batch, and
  sync once; the outer loop starts at the loaded weights with zero momentum, so the outer momentum
  saved after that sync IS the averaged pseudogradient Delta_K (as the outer optimizer received it);
- the reference: one worker runs the same H steps on the whole batch B (the union of the workers'
  samples) with the same inner optimizer and hyperparameters: Delta_1 = theta_start - theta_end.
The measure is the cosine of Delta_K with Delta_1 over the whole model and per logical hidden matrix
(the matrices Muon orthogonalizes in MuLoCo: Q, K, V, output, gate, up, down), and |Delta_K|/|Delta_1|.
Each method runs at its selected inner lr and, as the control that shows the lr's own share, at 0.5x
and 2x of it. Checkpoints are read with safetensors and JSON only, and removed once measured.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.compare.launch import Data, launch, read_curves, run_config, trainer_flags
from tools.compare.protocol import Method, RunSpec, Settings
from trainer.checkpoint.format import LATEST, CheckpointReader, complete_iterations, iteration_dir
from trainer.model.sharding import logical_matrices
from trainer.model.presets import ModelShape
from muloco.core.topology import RankCoordinates

START_FRACTIONS = (0.2, 0.5, 0.8)
LR_MULTIPLIERS = (0.5, 1.0, 2.0)
_NOT_HIDDEN = ("word_embeddings.weight", "output_layer.weight")  # AdamW's in MuLoCo too


def start_steps(settings: Settings) -> tuple[int, ...]:
    """Multiples of H at START_FRACTIONS of the run, from H on (step 0 is the initialization) and
    leaving H steps to run."""
    syncs = settings.steps // settings.sync_interval
    if syncs < 2:
        return ()
    return tuple(sorted({min(syncs - 1, max(1, round(f * syncs))) * settings.sync_interval for f in START_FRACTIONS}))


def start_state_flags(settings: Settings, root: Path) -> list[str]:
    """What a DP run adds to save every H steps, keeping them all (all but the start steps are removed
    after it)."""
    return ["--save", str(root), "--save-interval", str(settings.sync_interval),
            "--keep-last", str(settings.steps // settings.sync_interval)]


def keep_only(root: Path, steps: tuple[int, ...]) -> None:
    for step in complete_iterations(root):
        if step not in steps:
            shutil.rmtree(iteration_dir(root, step))


def has_start_states(root: Path, steps: tuple[int, ...]) -> bool:
    return root.is_dir() and set(steps) <= set(complete_iterations(root))


def worker0_state(root: Path, step: int):
    reader = CheckpointReader(root, step)
    return reader.rank_state(reader.meta.rank_of(RankCoordinates(0, 0, 0, 0)))


@dataclass(frozen=True)
class Comparison:
    cosine: float
    norm_ratio: float  # |a| / |b|
    matrix_cosines: dict[str, float]


def _cosine(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """(cosine, |a|/|b|) of the concatenations, in fp64."""
    dot = sum(float((a.double() * b.double()).sum()) for a, b in pairs)
    aa = sum(float(a.double().square().sum()) for a, _ in pairs)
    bb = sum(float(b.double().square().sum()) for _, b in pairs)
    return dot / math.sqrt(aa * bb), math.sqrt(aa / bb)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], shape: ModelShape) -> Comparison:
    """Two pseudogradients over the whole model, and per logical hidden matrix."""
    if set(a) != set(b):
        raise ValueError(f"pseudogradients over different parameters: {sorted(set(a) ^ set(b))[:5]}")
    cosine, ratio = _cosine([(a[n], b[n]) for n in sorted(a)])
    matrices = {}
    for name in sorted(a):
        if a[name].dim() == 2 and not name.endswith(_NOT_HIDDEN):
            parts_b = logical_matrices(name, b[name], shape)
            for part, piece in logical_matrices(name, a[name], shape).items():
                matrices[f"{name}:{part}" if part else name] = _cosine([(piece, parts_b[part])])[0]
    return Comparison(cosine, ratio, matrices)


def _start_view(run_root: Path, step: int, view: Path) -> Path:
    """A checkpoint root whose `latest` is step `step` of `run_root` (--load starts from `latest`)."""
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    (view / iteration_dir(view, step).name).symlink_to(iteration_dir(run_root, step).resolve())
    (view / LATEST).write_text(f"{step}\n")
    return view


@dataclass(frozen=True)
class HeldOutLosses:
    """The functional measure: the val loss on the same held-out sequences of the model after one outer
    step of outer lr 1 and momentum 0 (the start weights minus Delta_K) and after the K=1 reference's
    H steps (the start weights minus Delta_1)."""
    after_average: float
    after_reference: float
    sequences: int


@dataclass(frozen=True)
class Measurement:
    alignment: Comparison
    losses: HeldOutLosses | None  # only where measure() was asked for them


def _run_from(method: Method, spec: RunSpec, settings: Settings, data: Data, view: Path, work: Path,
              outer_loop: bool, held_out: bool) -> Path:
    """H steps of `method` (its K workers, or one worker on the whole batch) from `view`; returns the
    checkpoint root holding the state after them. `held_out`: the branch's one outer step is plain
    (outer lr 1, momentum 0), and the run evaluates once, after its last step."""
    workers = method.workers if outer_loop else 1
    flags = [*trainer_flags(spec, settings, data, workers, work, eval_interval=settings.sync_interval if held_out else 0),
             "--load", str(view), "--load-worker", "0", "--save", str(work / "ckpt"),
             "--exit-interval", str(settings.sync_interval)]
    if CheckpointReader(view).meta.global_batch != settings.global_batch:
        flags.append("--load-worker-new-batch")
    config = (run_config(method, settings, 1.0, outer_loop, outer_momentum=0.0) if held_out
              else run_config(method, settings, spec.outer_lr, outer_loop))
    launch(config, flags, workers, work, settings.run_timeout_s)
    return work / "ckpt"


def held_out_sequences(settings: Settings) -> int:
    """Both runs evaluate E*B sequences (trainer_flags: E*K batches of B/K, or E of B)."""
    return settings.eval_batches * settings.global_batch


def _last_val_loss(run_dir: Path, step: int) -> float:
    (last,) = [r for r in read_curves(run_dir, 1).val if r[0] == step]
    return last[1]


def measure(method: Method, spec: RunSpec, settings: Settings, data: Data, start_root: Path, start_step: int,
            work: Path, held_out: bool = False) -> Measurement:
    """The alignment of `method` (at `spec`'s lrs and seed) from the state at `start_step` of the DP
    run whose checkpoints are under `start_root`, at `settings`' global batch (which may differ from
    the DP run's); `held_out`: also the functional measure (HeldOutLosses), which leaves the cosine as
    it is (the momentum after the first sync from zero is Delta_K whatever the outer hyperparameters)."""
    end = start_step + settings.sync_interval
    view = _start_view(start_root, start_step, work / "start")
    branch = _run_from(method, spec, settings, data, view, work / "branch", outer_loop=True, held_out=held_out)
    averaged = worker0_state(branch, end)["extra"]["muloco"]["momentum"]  # zero before the one sync
    reference = _run_from(method, spec, settings, data, view, work / "reference", outer_loop=False, held_out=held_out)
    start = worker0_state(start_root, start_step)["model"]
    finish = worker0_state(reference, end)["model"]
    result = compare(averaged, {n: start[n] - finish[n] for n in start}, CheckpointReader(start_root, start_step).meta.model)
    losses = None
    if held_out:
        losses = HeldOutLosses(_last_val_loss(work / "branch", end), _last_val_loss(work / "reference", end),
                               held_out_sequences(settings))
    shutil.rmtree(work)  # ~25 MB per rank per checkpoint
    return Measurement(result, losses)
