"""Preemption: stop cleanly at a step boundary, with a checkpoint, and exit 0.

Clusters send SIGTERM some time before they take nodes back. With --exit-signal-handler, SIGTERM
only raises a flag; the current inner step finishes, and after it (a step hook, after the periodic
checkpoint hook) every rank learns whether any rank was signalled, through one all-reduce of the flag
over the world. So all ranks, in every worker, stop after the same step: they save a checkpoint
(unless that step was just saved), the training loop ends, and each process exits 0 (with
--async-save once that save is written and published). The same path serves Megatron's
--exit-interval (after a step divisible by N; no collective needed) and --exit-duration-in-mins
(measured from when training started; ranks' clocks differ, so they agree through the same
all-reduce). The cost of watching for SIGTERM or the duration is one all-reduce of
one number per step.
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from muloco.core import comm


class Preemption:
    def __init__(self, config, checkpointer, is_logging_rank: bool):
        self.config, self.checkpointer, self.is_logging_rank = config, checkpointer, is_logging_rank
        self.signalled = False
        self.started = time.monotonic()

    @property
    def enabled(self) -> bool:
        c = self.config
        return c.exit_signal_handler or c.exit_interval is not None or c.exit_duration_in_mins is not None

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True  # only a flag: the step in progress finishes first

    def should_stop(self, step: int) -> str | None:
        """Why every rank stops after `step`, or None. Every rank must call this after every step."""
        c = self.config
        if c.exit_interval is not None and step % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        if not (c.exit_signal_handler or c.exit_duration_in_mins is not None):
            return None
        minutes = c.exit_duration_in_mins
        out_of_time = minutes is not None and time.monotonic() - self.started >= minutes * 60
        # How many ranks got SIGTERM, and how many ran out of time: every rank learns both.
        signalled, timed_out = comm.all_reduce(torch.tensor([float(self.signalled), float(out_of_time)])).tolist()
        reasons = []
        if signalled:
            reasons.append(f"SIGTERM received by {int(signalled)} rank(s)")
        if timed_out:
            reasons.append(f"--exit-duration-in-mins {minutes} reached")
        return "; ".join(reasons) or None

    def after_step(self, trainer, step: int) -> dict | None:
        reason = self.should_stop(step)
        if reason is None:
            return None
        self.checkpointer.save_unless_saved(step)
        trainer.stop_requested = True
        if self.is_logging_rank:
            print(f"preempted: {reason}: stopping after step {step} with a checkpoint in "
                  f"{self.config.save}; --load it to continue", file=sys.stderr, flush=True)
        return {"preempted": True}

    @contextmanager
    def attached_to(self, trainer) -> Iterator[Preemption]:
        """While inside the block: the SIGTERM handler (when asked for) and the step hook."""
        if not self.enabled:
            yield self
            return
        handle = trainer.register_step_hook(lambda step: self.after_step(trainer, step))
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if self.config.exit_signal_handler else None
        try:
            yield self
        finally:
            handle.remove()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
