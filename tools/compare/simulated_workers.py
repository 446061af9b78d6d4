"""The alignment measure (tools/compare/alignment.py) with the K workers simulated one after another
in ONE process, for a device that cannot hold K ranks of one communicator (one GPU: NCCL refuses two
ranks on one device) and a time budget that cannot pay K launches.

Inside one run of the real trainer (trainer/pretrain.py's assembly: model, inner optimizer, DeepSpeed
engine, data), `SimulatedWorkersTrainer.train` does, in place of the usual loop:
1. the warm start: data-parallel steps on the global batch B, as many as `BranchPlan.max_warm_steps`
   and the deadline allow: it stops while the branches' predicted time, with a margin, still fits,
   predicted from a few steps of each kind timed first (a whole-batch step, a worker's step) and
   undone (the state is restored to step 0), then at the pace of the warm start's own steps. All is
   measured on the machine it runs on: the margin is the spread of the whole-batch steps timed (the
   slowest over their median: a shared machine's steps vary, a device of its own barely), and the first
   warm step needs none, so a stage whose branches fit its time is never stopped for want of it;
2. the start state: weights, inner optimizer state, lr schedule position, step and RNG states, kept
   in memory;
3. the K=1 reference: H steps on the whole batch B, Delta_1 = theta_start - theta_end;
4. the K workers, one after another, each from the start state: H steps on its B/K slice of the same
   global batches (trainer.data.StreamPosition's worker slices, so their union is the reference's
   data), Delta_K = the mean of theta_start - theta_k over the workers: the first outer sync's
   averaged pseudogradient, uncompressed;
5. `alignment.compare(Delta_K, Delta_1)`: the cosine over the whole model and per hidden matrix.
The summary the run writes (run_dir/summary.json) holds the comparison, the warm start's losses and
the measured and predicted seconds of the branches.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from tools.compare.alignment import compare
from muloco.core import comm
from trainer.checkpoint.state import capture_rng, restore_rng
from trainer.data import StreamPosition, micro_batches
from trainer.model.builder import canonical_names
from trainer.training import Trainer

CALIBRATION_STEPS = 2  # timed steps of each kind, after one that allocates and compiles
MIN_MARGIN = 1.1  # on the branches' predicted seconds, however steady the timed steps


@dataclass(frozen=True)
class BranchPlan:
    workers: int  # K
    sync_interval: int  # H
    max_warm_steps: int
    deadline: float  # time.time() by which the branches must be done


@dataclass(frozen=True)
class StepCost:
    """Seconds of one optimizer step (forward, backward, optimizer), timed."""
    whole_batch_s: float  # on B: a warm-start or reference step
    worker_s: float  # on B/K: a worker's step (fewer micro-batches; the optimizer's cost stays whole)

    def at_pace(self, whole_batch_s: float) -> StepCost:
        """The same costs on a machine running at the pace of `whole_batch_s` per whole-batch step
        (a shared or throttled device drifts from the pace it was timed at)."""
        return StepCost(whole_batch_s, self.worker_s * whole_batch_s / self.whole_batch_s)

    def branches_s(self, plan: BranchPlan) -> float:
        """The K=1 reference (H steps on B) plus K workers' H steps on B/K each."""
        return plan.sync_interval * (self.whole_batch_s + plan.workers * self.worker_s)


def measured_margin(whole_batch_s: list[float]) -> float:
    """The margin on the branches' predicted time (a kill at the deadline loses the measurement): as if
    every step were as slow as the slowest whole-batch step timed, relative to their median; at least
    MIN_MARGIN."""
    return max(MIN_MARGIN, max(whole_batch_s) / statistics.median(whole_batch_s))


def warm_start_continues(step: int, cost: StepCost, plan: BranchPlan, margin: float, now: float) -> bool:
    """Whether one more warm-start step leaves time for the branches: the first whenever it and the
    branches' predicted time fit (a stage that would finish in its time is not stopped), each further
    one with `margin` on the branches."""
    branches_s = cost.branches_s(plan) * (margin if step else 1.0)
    return step < plan.max_warm_steps and now + cost.whole_batch_s + branches_s <= plan.deadline


@dataclass
class _State:
    params: dict[str, torch.Tensor]
    optimizer: dict
    groups: list[dict]
    scheduler: dict
    step: int
    rng: dict


class SimulatedWorkersTrainer(Trainer):
    """Construct with `functools.partial(SimulatedWorkersTrainer, plan=...)` as trainer.run's trainer_class."""

    def __init__(self, *args, plan: BranchPlan, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan = plan
        batch = self.config.batch
        if batch.workers != 1 or batch.data_parallel != 1 or batch.gradient_accumulation_steps % plan.workers:
            raise ValueError(f"the simulation needs one worker of one rank whose micro-batches split into K = "
                             f"{plan.workers} workers' shares; got {batch}")
        self._named = [(name, p) for name, p in self.model.named_parameters()]
        self._canonical = canonical_names(self.model)
        self._worker_batch = dataclasses.replace(
            batch, gradient_accumulation_steps=batch.gradient_accumulation_steps // plan.workers, workers=plan.workers)

    def train(self) -> dict:
        plan = self.plan
        started = time.time()
        calibrated, whole_batch_s = self._calibrate()
        cost, margin = calibrated, measured_margin(whole_batch_s)
        calibration_s, warm_losses, warm_step_s = time.time() - started, [], []
        while warm_start_continues(self.step, cost, plan, margin, time.time()):
            loss, seconds = self._timed_step(self.position)
            warm_losses.append(loss)
            warm_step_s.append(seconds)
            cost, margin = calibrated.at_pace(statistics.median(warm_step_s)), measured_margin(whole_batch_s + warm_step_s)
        if not warm_losses:
            raise RuntimeError(f"no time for a warm start: one step ({cost.whole_batch_s:.1f} s) and the branches' "
                               f"predicted {cost.branches_s(plan):.0f} s (no margin) exceed the "
                               f"{plan.deadline - time.time():.0f} s left: the stage would not finish in its timeout")
        warm_s, branch_start = time.time() - started - calibration_s, time.time()
        start = self._capture()
        branch_lr = self.engine.optimizer.param_groups[-1]["lr"]

        reference_loss = self._branch(self.position)
        reference = {name: start.params[name] - p.detach() for name, p in self._canonical_params()}
        averaged = {name: torch.zeros_like(p) for name, p in reference.items()}
        worker_losses = []
        for worker in range(plan.workers):
            self._restore(start)
            worker_losses.append(self._branch(StreamPosition(worker, 0, self._worker_batch)))
            for name, p in self._canonical_params():
                averaged[name] += (start.params[name] - p.detach()) / plan.workers
        comparison = compare(averaged, reference, self.config.model)
        return {"steps": self.step, "val_loss": None,
                "warm_start": {"steps": len(warm_losses), "loss_first": warm_losses[0], "loss_last": warm_losses[-1],
                               "seconds": round(warm_s, 2), "lr_at_branch_start": branch_lr,
                               "calibration_seconds": round(calibration_s, 2)},
                "branches": {"workers": plan.workers, "sync_interval": plan.sync_interval,
                             "global_batch": self.config.batch.global_batch,
                             "worker_batch": self._worker_batch.per_worker,
                             "reference_last_loss": reference_loss, "workers_last_loss_mean": statistics.fmean(worker_losses),
                             "seconds": round(time.time() - branch_start, 2),
                             "predicted_seconds": round(cost.branches_s(plan), 2), "margin": round(margin, 3),
                             "step_seconds": dataclasses.asdict(cost)},
                "alignment": dataclasses.asdict(comparison)}

    def _canonical_params(self):
        return ((self._canonical[name], p) for name, p in self._named)

    def _calibrate(self) -> tuple[StepCost, list[float]]:
        """Median seconds of whole-batch and worker steps from step 0, then the state of step 0 again; and
        the whole-batch steps' seconds."""
        start = self._capture()

        def step_s(position: StreamPosition) -> list[float]:
            return [self._timed_step(position)[1] for _ in range(CALIBRATION_STEPS + 1)][1:]

        whole_batch_s, worker_s = step_s(self.position), step_s(StreamPosition(0, 0, self._worker_batch))
        self._restore(start)
        return StepCost(statistics.median(whole_batch_s), statistics.median(worker_s)), whole_batch_s

    def _timed_step(self, position: StreamPosition) -> tuple[float, float]:
        """One optimizer step on `position`'s samples: (loss, seconds)."""
        self.model.train()
        started = time.perf_counter()
        loss = self._run_schedule(micro_batches(self.train_dataset, position, self.step),
                                  position.batch.gradient_accumulation_steps, forward_only=False)
        self.engine.step()
        if comm.compute_device().type == "cuda":  # the step's kernels, not their launches
            torch.cuda.synchronize()
        self.step += 1
        self._run_step_hooks()
        return loss, time.perf_counter() - started

    def _branch(self, position: StreamPosition) -> float:
        """H steps on `position`'s samples; the last step's loss."""
        for _ in range(self.plan.sync_interval):
            loss, _ = self._timed_step(position)
        return loss

    def _capture(self) -> _State:
        optimizer = self.engine.optimizer
        return _State(params={self._canonical[name]: p.detach().clone() for name, p in self._named},
                      optimizer={p: _cloned(s) for p, s in optimizer.state.items()},
                      groups=[{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                      scheduler=self.engine.lr_scheduler.state_dict(), step=self.step, rng=capture_rng())

    @torch.no_grad()
    def _restore(self, state: _State) -> None:
        for name, p in self._named:
            p.copy_(state.params[self._canonical[name]])
        optimizer = self.engine.optimizer
        optimizer.state.clear()
        optimizer.state.update({p: _cloned(s) for p, s in state.optimizer.items()})
        for group, saved in zip(optimizer.param_groups, state.groups):
            group.update(saved)
        self.engine.lr_scheduler.load_state_dict(state.scheduler)
        self.step = state.step
        self.engine.set_step(state.step)
        restore_rng(state.rng)


def _cloned(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
