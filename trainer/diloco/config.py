"""The ds_config's "muloco" block: the outer loop of DiLoCo/MuLoCo.

    "muloco": {
      "workers": 2,                 K datacenters; the world is K x D x P x T
      "sync_interval": 30,          H inner steps between outer syncs
      "outer_lr": 0.7, "outer_momentum": 0.6, "nesterov": true,
      "compression": {"method": "statistical", "bits": 4, "embedding_bits": 4, "vector_bits": 4,
                      "error_feedback": true, "ef_form": "plain", "ef_beta": 1.0,
                      "statistical_rounding": "centred", ...},
                                    ef_form "plain" (default): e = beta e + delta; "paper": the official
                                    e = beta e + outer_lr delta, its average stepped with outer_lr
                                    again (= plain at outer lr outer_lr**2 on the compressed tensors).
                                    statistical_rounding "centred" (default; measured lower error) or
                                    "paper": the official round(c/s + n/2). `--recipe paper` selects
                                    both official forms and beta 0.9.
      "collective": "all_gather" | "reduce_scatter",
      "outer_backend": "gloo" | "nccl",   the outer groups' backend: gloo moves the packed payload through
                                    host memory (a WAN between datacenters), nccl keeps it on the device
      "outer_state_on_device": false,  previous global weights and outer momentum on the device
                                    instead of the host (pinned)
      "streaming": {"fragments": 1, "overlap_steps": 0, "mix_alpha": 0.0},
      "max_norm_ratio": 10.0,       skip a sync when a worker's pseudogradient norm is this far above its peers'
      "link": {"bandwidth_gbit_s": 10, "latency_ms": 50},   optional slow-link emulation for benchmarks
      "identical_worker_data": false,  every worker reads worker 0's data (a test identity)
      "sync_timeout_s": 60,         elastic workers: a peer silent this long is dropped from the sync
      "auth": {"key_file": "job.key", "job_id": "run-42"} | "none",
                                    the job secret that tags every message between workers
                                    (trainer/diloco/auth.py); required whenever workers talk (K > 1 or
                                    elastic): absent, the key file is $MULOCO_AUTH_KEY_FILE; "none"
                                    sends everything unauthenticated (a warning at start)
      "elastic": {...}              each worker its own job, a fault-tolerant outer group (trainer/elastic/config.py)
    }
The inner optimizer (muon or adamw) is the ds_config's "optimizer" block, so DP AdamW, DP Muon,
DiLoCo and MuLoCo are one program with different configs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from trainer.errors import ConfigError
from trainer.diloco.auth import AuthConfig
from trainer.diloco.compression import CompressionConfig
from trainer.diloco.link import SlowLink
from trainer.elastic.config import ElasticConfig

COLLECTIVES = ("all_gather", "reduce_scatter")
OUTER_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class StreamingConfig:
    fragments: int = 1  # F fragments of contiguous layers, synced at staggered offsets
    overlap_steps: int = 0  # tau: the sync's result is applied this many inner steps after it starts
    mix_alpha: float = 0.0  # local weight kept when an overlapped result is applied: a*local + (1-a)*global

    def __post_init__(self):
        if self.fragments < 1:
            raise ConfigError(f"muloco.streaming.fragments must be >= 1, got {self.fragments}")
        if self.overlap_steps < 0:
            raise ConfigError(f"muloco.streaming.overlap_steps must be >= 0, got {self.overlap_steps}")
        if not 0.0 <= self.mix_alpha < 1.0:
            raise ConfigError(f"muloco.streaming.mix_alpha must be in [0, 1), got {self.mix_alpha}")


@dataclass(frozen=True)
class MuLoCoConfig:
    workers: int = 1
    sync_interval: int = 30
    outer_lr: float = 0.7
    outer_momentum: float = 0.6
    nesterov: bool = True
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    collective: str = "all_gather"
    outer_backend: str = "gloo"
    outer_state_on_device: bool = False
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    max_norm_ratio: float = 10.0
    link: SlowLink | None = None
    identical_worker_data: bool = False
    sync_timeout_s: float = 60.0
    auth: AuthConfig | Literal["none"] = field(default_factory=AuthConfig)
    elastic: ElasticConfig | None = None

    def __post_init__(self):
        if self.workers < 1:
            raise ConfigError(f"muloco.workers must be >= 1, got {self.workers}")
        if self.sync_interval < 1:
            raise ConfigError(f"muloco.sync_interval must be >= 1, got {self.sync_interval}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"muloco.outer_lr must be > 0 and outer_momentum in [0, 1), got "
                              f"{self.outer_lr}, {self.outer_momentum}")
        if self.collective not in COLLECTIVES:
            raise ConfigError(f"muloco.collective must be one of {COLLECTIVES}, got {self.collective!r}")
        if self.outer_backend not in OUTER_BACKENDS:
            raise ConfigError(f"muloco.outer_backend must be one of {OUTER_BACKENDS}, got {self.outer_backend!r}")
        if self.streaming.fragments > self.sync_interval:
            raise ConfigError(f"muloco.streaming.fragments ({self.streaming.fragments}) cannot exceed "
                              f"sync_interval ({self.sync_interval})")
        if self.streaming.overlap_steps >= self.sync_interval:
            raise ConfigError(f"muloco.streaming.overlap_steps ({self.streaming.overlap_steps}) must be below "
                              f"sync_interval ({self.sync_interval})")
        if self.sync_timeout_s <= 0:
            raise ConfigError(f"muloco.sync_timeout_s must be > 0, got {self.sync_timeout_s}")
        if self.elastic is not None:
            self.elastic.check_compatible(self)

    @property
    def talks(self) -> bool:
        """Whether workers exchange messages (and so need the job secret)."""
        return self.workers > 1 or self.elastic is not None

    @classmethod
    def from_dict(cls, block: dict[str, Any]) -> "MuLoCoConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ConfigError(f"unknown keys in the muloco block: {unknown}; known: {sorted(known)}")
        values = dict(block)
        try:
            values["compression"] = CompressionConfig(**block.get("compression", {}))
            values["streaming"] = StreamingConfig(**block.get("streaming", {}))
            values["link"] = SlowLink(**block["link"]) if block.get("link") else None
            values["elastic"] = ElasticConfig(**block["elastic"]) if "elastic" in block else None
            if isinstance(block.get("auth"), dict):
                values["auth"] = AuthConfig(**block["auth"])
        except (TypeError, ValueError) as err:
            raise ConfigError(f"muloco block: {err}") from err
        return cls(**values)
