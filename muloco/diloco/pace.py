"""Workers of unequal speed: wall-clock pacing of the outer syncs, each worker's contribution, and the
merge that weights contributions by tokens with a correction for unequal step counts.

Pacing (`muloco.pace`, `mode: "wall_clock"`). Each worker trains until the interval's deadline or H
(`sync_interval`) inner steps, whichever comes first, then syncs: a slow worker contributes fewer
inner steps instead of holding the others at the barrier. The deadline is measured on the worker's
own clock from the end of the previous sync (every worker leaves a sync when its collective
completes, so no clock agreement is needed); it is `interval_s`, or with `"auto"` H times the wall time
per inner step over the last interval of the slowest worker within 25% of the fastest, read from the
previous sync's headers (so every worker sets the same one; the first interval has none: H steps
everywhere). A worker stops once its next step would end
more than half a step past the deadline.

The run's position stays the nominal one: a worker that stops after n < H steps moves its step to the
sync's step (`Host.skip_to`: the lr schedule steps past the steps it did not take, and a data stream
drawn by step skips their batches), so every worker syncs at the same step, the run ends at the same
last step (its last sync is the same for all), saves happen together at the same steps, and a resume
is a resume of the fixed-H run (the deadline of the interval after it is the saved one).

Contribution. With pacing the header of the exchange's first collective carries, after the skip
vote's ballot, each worker's interval: inner steps n_k, tokens t_k, the summed inner lr S_k of the
steps it took, the summed lr S_H of the interval's H nominal steps (the same on every worker), and its
interval's wall time per inner step.

The merge and its correction (in the spirit of AutoLoCo, arXiv 2609.36662, and of Decoupled DiLoCo's
token weighting, arXiv 2604.21428; the formula is ours). A pseudogradient grows with the inner lr the
worker accumulated, so each is first brought to the token-weighted mean of those sums:
    w_k = t_k / T,  T = sum t_k,   S_bar = sum w_k S_k,
    Delta = sum_k w_k (S_bar / S_k) Delta_k = (S_bar / T) sum_k (t_k / S_k) Delta_k
and the outer momentum decays per interval's worth of accumulated lr: the step that merges Delta uses
    mu_eff = mu ** (S_bar / S_H)
in the same Nesterov step (m <- mu_eff m + Delta; theta <- theta - lr (Delta + mu_eff m)). When every
worker ran its H steps (equal t_k and S_k) the merge is the plain average, computed by today's code
path, and mu_eff is mu: the fixed-H step, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from muloco.core.typed_json import ConfigBlock, setting

CONTRIBUTION_VALUES = 5  # steps, tokens, lr_sum, interval_lr_sum, seconds_per_step (float64)
CONTRIBUTION_BYTES = 8 * CONTRIBUTION_VALUES
AUTO_PEERS = 1.25  # `interval_s: "auto"`: workers this close to the fastest count as at full speed


@dataclass(frozen=True)
class PaceConfig(ConfigBlock):
    mode: Literal["fixed", "wall_clock"] = setting(
        "fixed", doc="`fixed`: every worker runs H inner steps per sync; `wall_clock`: each runs until the interval's "
                     "deadline or H steps, and the merge weights by tokens with the unequal-step correction")
    interval_s: float | Literal["auto"] = setting(
        "auto", gt=0, doc="the deadline, seconds after the previous sync ended on the worker's own clock; `auto`: H "
                          "times the wall time per inner step over the previous interval of the slowest worker within "
                          "25% of the fastest (none before the first sync)")
    min_steps: int = setting(1, ge=1, doc="inner steps a worker takes in an interval whatever the deadline")

    @property
    def paced(self) -> bool:
        return self.mode == "wall_clock"


@dataclass(frozen=True)
class Contribution:
    """One worker's interval, as its header carries it."""
    steps: int  # inner steps taken
    tokens: float  # tokens (samples for a DeepSpeed engine) they consumed
    lr_sum: float  # S_k: the summed inner lr of those steps
    interval_lr_sum: float  # S_H: the summed inner lr of the interval's H nominal steps
    seconds_per_step: float  # its interval's wall time (previous sync's end to this one's start) per inner step

    def encode(self) -> torch.Tensor:
        values = [float(self.steps), self.tokens, self.lr_sum, self.interval_lr_sum, self.seconds_per_step]
        return torch.tensor(values, dtype=torch.float64).view(torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor) -> Contribution:
        steps, tokens, lr_sum, interval_lr_sum, seconds_per_step = data.cpu().clone().view(torch.float64).tolist()
        return cls(int(steps), tokens, lr_sum, interval_lr_sum, seconds_per_step)

    def problem(self) -> str | None:
        """Why a received contribution cannot be merged (a weight from it would be meaningless)."""
        values = (self.tokens, self.lr_sum, self.interval_lr_sum, self.seconds_per_step)
        if self.steps < 1 or not all(v == v and abs(v) != float("inf") for v in values):
            return f"its contribution {self} is not a count of steps with finite sums"
        if self.tokens <= 0 or self.lr_sum <= 0 or self.interval_lr_sum <= 0 or self.seconds_per_step < 0:
            return f"its contribution {self} has a non-positive tokens or lr sum"
        return None


NO_CONTRIBUTION = Contribution(0, 0.0, 0.0, 0.0, 0.0)  # a member with nothing to contribute (elastic: joining)


class TokenWeights:
    """The corrected merge of the contributions of one sync: sender k's decoding enters the running
    sum with factor t_k / S_k, and the sum over the kept senders is multiplied by S_bar / T."""

    def __init__(self, contributions: dict[int, Contribution]):
        self.contributions = contributions

    def factor(self, sender: int) -> float:
        c = self.contributions[sender]
        return c.tokens / c.lr_sum

    def scale(self, kept: list[int]) -> float:
        contributions = [self.contributions[k] for k in kept]
        return token_weighted_lr_sum(contributions) / sum(c.tokens for c in contributions)


def token_weighted_lr_sum(contributions: list[Contribution]) -> float:
    """S_bar = sum_k (t_k / T) S_k."""
    return sum(c.tokens * c.lr_sum for c in contributions) / sum(c.tokens for c in contributions)


def _alike(contributions) -> bool:
    """Every contribution holds the same tokens and lr sum (their merge is the plain average)."""
    return len({(c.tokens, c.lr_sum) for c in contributions}) <= 1


def merge_weights(contributions: dict[int, Contribution]) -> TokenWeights | None:
    """The weights of a sync's merge; None when the contributions are alike: the plain average
    (today's arithmetic, bit for bit)."""
    return None if _alike(contributions.values()) else TokenWeights(contributions)


def momentum_exponent(contributions: list[Contribution]) -> float:
    """S_bar / S_H of the contributors: the outer momentum decays as mu ** this (exactly 1.0 when
    every contributor ran the interval's H steps with the same lrs)."""
    if _alike(contributions) and all(c.lr_sum == c.interval_lr_sum for c in contributions):
        return 1.0
    return token_weighted_lr_sum(contributions) / max(c.interval_lr_sum for c in contributions)


def auto_deadline(contributions: list[Contribution], sync_interval: int) -> float | None:
    """`interval_s: "auto"`: H times the wall time per inner step over the last interval (what the training
    loop does between steps included) of the slowest worker at full speed, those within AUTO_PEERS of
    the fastest: the noise between workers at full speed does not stop them short of H steps, and a
    straggler beyond it does not hold them (None: nothing was measured)."""
    measured = [c.seconds_per_step for c in contributions if c.seconds_per_step > 0]
    if not measured:
        return None
    return sync_interval * max(r for r in measured if r <= AUTO_PEERS * min(measured))


class Pacer:
    """One worker's interval: its steps, tokens and lr sums since the last sync, and whether its
    deadline has come."""

    def __init__(self, config: PaceConfig, sync_interval: int):
        self.config, self.sync_interval = config, sync_interval
        self.deadline: float | None = None if config.interval_s == "auto" else config.interval_s
        self.started = 0.0
        self.steps, self.lr_sum, self.interval_lr_sum = 0, 0.0, 0.0
        self.next_lr: float | None = None  # the lr the coming inner step uses

    def start(self, now: float, next_lr: float) -> None:
        """A new interval (after a sync, or at the run's start) on the worker's clock."""
        self.started, self.next_lr = now, next_lr
        self.steps, self.lr_sum, self.interval_lr_sum = 0, 0.0, 0.0

    def stepped(self, next_lr: float) -> None:
        """An inner step was taken with the lr read before it; `next_lr` is the following one's."""
        self.steps += 1
        self.lr_sum += self.next_lr
        self.interval_lr_sum += self.next_lr
        self.next_lr = next_lr

    def skipped(self, lrs: list[float]) -> None:
        """The nominal steps this worker did not take (their lrs), to the sync's step."""
        for lr in lrs:
            self.interval_lr_sum += lr

    def due(self, now: float, step_seconds: float) -> bool:
        """Whether the interval ends now: the next step (`step_seconds`, the worker's recent median) would
        end over half a step past the deadline."""
        if self.deadline is None or self.steps < self.config.min_steps:
            return False
        return now - self.started + step_seconds / 2 > self.deadline

    def contribution(self, now: float, tokens_per_step: float) -> Contribution:
        """The interval ending `now` (its sync starts)."""
        return Contribution(self.steps, self.steps * tokens_per_step, self.lr_sum, self.interval_lr_sum,
                            (now - self.started) / self.steps)

    def synced(self, contributions: list[Contribution]) -> None:
        """The next deadline, from the headers of the sync just done (the same on every member of its
        quorum, and only theirs)."""
        if self.config.interval_s == "auto":
            self.deadline = auto_deadline(contributions, self.sync_interval) or self.deadline


def next_sync_step(step: int, interval: int, last_step: int | None, final_sync: bool) -> int | None:
    """The step of the next sync at or after `step` (F = 1): the next multiple of H, or the run's final
    sync; None when the run ends before another sync."""
    next_sync = -(-step // interval) * interval
    if last_step is not None and last_step < next_sync:
        return last_step if final_sync else None
    return next_sync
