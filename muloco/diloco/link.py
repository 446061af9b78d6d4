"""Emulation of a slow cross-datacenter link on one machine, for experiments and demos."""
from __future__ import annotations

import time
from dataclasses import dataclass

from muloco.core.typed_json import ConfigBlock, setting


@dataclass(frozen=True)
class SlowLink(ConfigBlock):
    """A link of this egress bandwidth and one-way latency: moving n bytes takes
    latency + n*8/bandwidth seconds."""
    bandwidth_gbit_s: float = setting(gt=0, doc="egress bandwidth, Gbit/s")
    latency_ms: float = setting(0.0, ge=0, doc="one-way latency, ms")

    def delay(self, nbytes: int) -> float:
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_gbit_s * 1e9)

    def wait(self, nbytes: int) -> None:
        time.sleep(self.delay(nbytes))
