"""What the outer loop asks of the training loop it is attached to (outer_loop.py): this project's
trainer (trainer/outer_host.py) or a DeepSpeed engine (muloco/hook/engine_host.py)."""
from __future__ import annotations

from typing import Protocol


class Host(Protocol):
    """What the outer loop asks of the training loop it is attached to."""
    last_step: int | None  # the run's last inner step, when known: no sync is prepared past it

    def inner_step(self) -> int:
        """Optimizer steps taken (the run's position; the data stream follows it)."""

    def schedule_state(self) -> dict | None:
        """The lr schedule's state_dict (None: the host has no schedule)."""

    def go_on_from(self, step: int, schedule: dict | None) -> None:
        """Move the run to a peer's position: its inner step and lr schedule (a member that caught up)."""

    def weights_written(self) -> None:
        """The outer loop wrote the local weights outside an optimizer step's own update: refresh
        whatever the host derives from them (DeepSpeed's bf16 copies of its fp32 master partitions)."""

    # Wall-clock pacing only (pace.py):
    tokens_per_step: float  # what one inner step of this worker consumes (only ratios between workers matter)

    def inner_lr(self) -> float:
        """The lr the coming inner step uses (the first parameter group's: only ratios matter)."""

    def skip_to(self, step: int) -> list[float]:
        """Move the run forward to `step` as if the steps in between were taken (the lr schedule steps,
        the data position follows the step); the lrs those steps would have used."""
