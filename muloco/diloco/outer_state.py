"""The outer optimizer's state on one rank: fp32 global weights and outer momentum of the tensors it
owns (on the host, pinned, or on the device with `outer_state_on_device`), the count of outer steps
applied and skipped, and the Nesterov outer step that moves them.

The main thread applies syncs while the background thread may read the state for a peer that is
behind: `lock` guards it.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import torch

from muloco.diloco.plan import SyncedTensor


def outer_sgd_direction(average: torch.Tensor, momentum: torch.Tensor, mu: float, nesterov: bool) -> torch.Tensor:
    """The outer SGD step's direction for the averaged pseudogradient (torch.optim.SGD's momentum,
    dampening 0), updating `momentum` in place; the weights move by -outer_lr times it."""
    m = momentum.mul_(mu).add_(average)
    return average.add(m, alpha=mu) if nesterov else m


def digest_of(tensors: Iterable[torch.Tensor]) -> float:
    """An exact digest of fp32 tensors (the sum of their bit patterns as integers, mod 2**52, in any
    order): equal wherever they are bit-identical, on any device."""
    total = sum(int(t.view(torch.int32).sum(dtype=torch.int64)) for t in tensors)
    return float(total % (1 << 52))


def _state_copy(t: torch.Tensor, on_device: bool) -> torch.Tensor:
    """An fp32 copy for the outer state: on the tensor's device, or on the host (pinned when the
    tensor lives on an accelerator, so the per-sync copies are fast)."""
    if on_device or t.device.type == "cpu":
        return t.detach().to(torch.float32, copy=True)
    return t.detach().to("cpu", torch.float32).pin_memory()


class OuterState:
    def __init__(self, tensors: list[SyncedTensor], owned: list[int], on_device: bool):
        self.tensors = tensors
        self.global_weights = {i: _state_copy(tensors[i].tensor, on_device) for i in owned}
        self.momentum = {i: torch.zeros_like(self.global_weights[i]) for i in owned}
        self.outer_step = 0
        self.skipped = 0
        self.lock = threading.Lock()

    def names(self) -> dict[str, int]:
        return {self.tensors[i].name: i for i in self.global_weights}

    @torch.no_grad()
    def take_step(self, i: int, average: torch.Tensor, outer_lr: float, mu: float, nesterov: bool) -> None:
        """Nesterov SGD on tensor i's global weights for its averaged pseudogradient (wire shape)."""
        g = self.global_weights[i]
        average = self.tensors[i].from_wire(average).to(g.device)
        g.add_(outer_sgd_direction(average, self.momentum[i], mu, nesterov), alpha=-outer_lr)

    def delta(self, i: int) -> torch.Tensor:
        """theta_global - theta_local in fp32 on the tensor's device, as the wire sees it."""
        t = self.tensors[i].tensor.detach()
        return self.tensors[i].to_wire(self.global_weights[i].to(t.device, non_blocking=True) - t.float())

    def digest(self, indices: list[int]) -> float:
        """digest_of these tensors' global weights."""
        with self.lock:
            return digest_of(self.global_weights[i] for i in indices)

    def checksum(self) -> str:
        """sha256 of this rank's global weights (fp32 bytes, in tensor order): equal on two workers iff
        their shards are bit-identical."""
        digest = hashlib.sha256()
        for i in sorted(self.global_weights):
            digest.update(self.global_weights[i].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def tensors_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"global_weights": {self.tensors[i].name: w for i, w in self.global_weights.items()},
                "momentum": {self.tensors[i].name: m for i, m in self.momentum.items()}}

    @torch.no_grad()
    def load_tensors(self, snapshot) -> None:
        """Global weights, momentum and counters from a checked snapshot (snapshot.py; the caller holds
        the lock where another thread may read)."""
        for name, i in self.names().items():
            self.global_weights[i].copy_(snapshot.global_weights[name])
            self.momentum[i].copy_(snapshot.momentum[name])
        self.outer_step, self.skipped = snapshot.outer_step, snapshot.skipped
