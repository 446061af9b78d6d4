"""The outer optimizer's state on one rank: fp32 global weights and outer momentum of the tensors it
owns (on the host, pinned, or on the device with `outer_state_on_device`), the count of outer steps
applied and skipped, and the Nesterov outer step that moves them.

The main thread applies syncs while the background thread may read the state for a peer that is
behind: `lock` guards it.
"""
from __future__ import annotations

import hashlib
import threading

import torch

from muloco.diloco.plan import SyncedTensor


def outer_sgd_direction(average: torch.Tensor, momentum: torch.Tensor, mu: float, nesterov: bool) -> torch.Tensor:
    """The outer SGD step's direction for the averaged pseudogradient (torch.optim.SGD's momentum,
    dampening 0), updating `momentum` in place; the weights move by -outer_lr times it."""
    m = momentum.mul_(mu).add_(average)
    return average.add(m, alpha=mu) if nesterov else m


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
        """An exact digest of these tensors' global weights (the sum of their fp32 bit patterns as
        integers, mod 2**52): equal wherever they are bit-identical, on any device."""
        with self.lock:
            total = sum(int(self.global_weights[i].view(torch.int32).sum(dtype=torch.int64)) for i in indices)
        return float(total % (1 << 52))

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

    def form_problems(self, state: dict) -> list[str]:
        """How `state`'s global weights and momentum differ in form from this rank's (names, dtypes,
        shapes): they are loaded with copy_, which would broadcast a smaller tensor."""
        problems = []
        for key, mine in (("global_weights", self.global_weights), ("momentum", self.momentum)):
            theirs = state.get(key)
            if not isinstance(theirs, dict) or set(theirs) != {self.tensors[i].name for i in mine}:
                problems.append(f"{key} holds other parameters than this rank owns")
                continue
            for i, tensor in mine.items():
                t = theirs[self.tensors[i].name]
                if not isinstance(t, torch.Tensor) or t.dtype != tensor.dtype or t.shape != tensor.shape:
                    problems.append(f"{key}[{self.tensors[i].name}] is not a {tensor.dtype} tensor of shape "
                                    f"{tuple(tensor.shape)}")
        return problems

    @torch.no_grad()
    def load_tensors(self, state: dict) -> None:
        """Global weights, momentum and counters from a checked state (the caller holds the lock
        where another thread may read)."""
        for name, i in self.names().items():
            self.global_weights[i].copy_(state["global_weights"][name])
            self.momentum[i].copy_(state["momentum"][name])
        self.outer_step, self.skipped = state["outer_step"], state["skipped"]
