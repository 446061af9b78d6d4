"""Who contributes to one elastic outer sync.

Every member of the quorum publishes one row; every rank sees the same rows in the same (quorum)
order, so every rank draws the same conclusion. A member is left out of the average when its row
fails its tag, when it is joining (it has just loaded the outer state from a peer, or the run is starting, so it has no
pseudogradient of its own), when its pseudogradient is non-finite, or when its norm is more than
`max_norm_ratio` times the median of the other contributors'. Members left out still receive the
average and take the same outer step, so every member leaves the sync with the same global weights.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

ROW = ("worker", "step", "joining", "nonfinite", "sq_norm", "committed")  # one member's published values, in order


@dataclass(frozen=True)
class Member:
    worker: int  # the worker id (--worker-id)
    step: int  # inner steps done (the data stream position)
    joining: bool
    nonfinite: bool
    norm: float
    committed: int = 0  # outer syncs this worker has committed: a member below the highest is behind
    authentic: bool = True  # False: its row failed its tag (it is in the quorum, but not one of us)

    @classmethod
    def from_row(cls, row: list[float]) -> Member:
        worker, step, joining, nonfinite, sq, committed = row
        return cls(int(worker), int(step), joining > 0, nonfinite > 0, math.sqrt(sq) if math.isfinite(sq) else math.inf,
                   int(committed))

    @classmethod
    def unauthenticated(cls) -> Member:
        return cls(worker=-1, step=0, joining=False, nonfinite=False, norm=0.0, committed=-1, authentic=False)


def left_out(members: list[Member], max_norm_ratio: float) -> dict[int, str]:
    """Quorum index -> why that member does not contribute to this sync."""
    reasons = {i: "failed authentication" for i, m in enumerate(members) if not m.authentic}
    reasons.update({i: "joining" for i, m in enumerate(members) if m.joining and i not in reasons})
    reasons.update({i: "non-finite pseudogradient" for i, m in enumerate(members) if m.nonfinite and i not in reasons})
    candidates = [i for i in range(len(members)) if i not in reasons]
    for i in candidates:
        others = [members[j].norm for j in candidates if j != i]
        if others and members[i].norm > max_norm_ratio * max(statistics.median(others), 1e-12):
            reasons[i] = f"pseudogradient norm {members[i].norm:.3g} is over {max_norm_ratio}x its peers'"
    return reasons
