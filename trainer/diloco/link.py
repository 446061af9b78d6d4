"""Emulation of a slow cross-datacenter link on one machine, for experiments and demos."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SlowLink:
    """A link of this egress bandwidth and one-way latency: moving n bytes takes
    latency + n*8/bandwidth seconds."""
    bandwidth_gbit_s: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbit_s > 0:
            raise ValueError(f"SlowLink.bandwidth_gbit_s must be > 0, got {self.bandwidth_gbit_s!r}")
        if not self.latency_ms >= 0:
            raise ValueError(f"SlowLink.latency_ms must be >= 0, got {self.latency_ms!r}")

    def delay(self, nbytes: int) -> float:
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_gbit_s * 1e9)

    def wait(self, nbytes: int) -> None:
        time.sleep(self.delay(nbytes))
