"""Which rank orthogonalizes which logical matrix: a deterministic, cost-balanced assignment.

Every rank computes the plan independently from the same inputs, so the plan must not depend on
anything but them: no randomness, no set/dict iteration order, a fixed order of float additions.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def assign_owners(costs: Sequence[float], num_owners: int, tie_loads: Sequence[float] | None = None) -> list[int]:
    """Owner rank of each item, by greedy longest-processing-time.

    Items are taken by cost descending (ties: lower index first), each given to the currently
    least-loaded owner (ties: the lower `tie_loads[rank]`, e.g. what each owner already carries from
    earlier rounds; then the lowest rank). The busiest owner's load is at most the mean load plus
    the largest single cost.
    """
    if isinstance(num_owners, bool) or not isinstance(num_owners, int) or num_owners < 1:
        raise ValueError(f"num_owners must be a positive int, got {num_owners!r}")
    for i, cost in enumerate(costs):
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost of item {i} must be finite and >= 0, got {cost!r}")
    ties = [0.0] * num_owners if tie_loads is None else [float(x) for x in tie_loads]
    if len(ties) != num_owners:
        raise ValueError(f"tie_loads needs one load per owner ({num_owners}), got {len(ties)}")
    owners = [0] * len(costs)
    # (load, tie load, rank): the heap's order is exactly "least loaded, then the tie-breakers".
    heap = [(0.0, ties[rank], rank) for rank in range(num_owners)]
    heapq.heapify(heap)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, tie, rank = heapq.heappop(heap)
        owners[item] = rank
        heapq.heappush(heap, (load + float(costs[item]), tie + float(costs[item]), rank))
    return owners


@dataclass
class OwnershipPlan:
    """An assignment of items to owners with each owner's load; plain ints and floats only."""

    owners: list[int]  # owner rank of item i
    loads: list[float]  # total cost assigned to rank r

    @classmethod
    def build(cls, costs: Sequence[float], num_owners: int) -> OwnershipPlan:
        owners = assign_owners(costs, num_owners)
        loads = [0.0] * num_owners
        for item, rank in enumerate(owners):  # item order fixes the float summation order
            loads[rank] += float(costs[item])
        return cls(owners=owners, loads=loads)

    @property
    def num_owners(self) -> int:
        return len(self.loads)

    def items_of(self, rank: int) -> list[int]:
        """Indices of the items owned by `rank`, ascending."""
        return [item for item, owner in enumerate(self.owners) if owner == rank]

    @property
    def imbalance(self) -> float:
        """Busiest owner's load over the mean load (1.0 is perfect; 1.0 when nothing costs)."""
        total = sum(self.loads)
        return max(self.loads) * self.num_owners / total if total > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"owners": list(self.owners), "loads": list(self.loads)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OwnershipPlan:
        owners = [int(o) for o in data["owners"]]
        loads = [float(x) for x in data["loads"]]
        if not loads:
            raise ValueError("an ownership plan needs at least one owner")
        if any(not 0 <= o < len(loads) for o in owners):
            raise ValueError(f"ownership plan names owners outside [0, {len(loads)}): {owners}")
        return cls(owners=owners, loads=loads)
