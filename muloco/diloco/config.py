"""The ds_config's "muloco" block: the outer loop of DiLoCo/MuLoCo, and its compression block.

    "muloco": {
      "workers": 2, "sync_interval": 30, "outer_lr": 0.7, "outer_momentum": 0.6, "nesterov": true,
      "compression": {"method": "statistical", "bits": 4, "error_feedback": true},
      "collective": "all_gather", "streaming": {"fragments": 1, "overlap_steps": 0}, ...
      "auth": {"key_file": "job.key", "job_id": "run-42"} | "none",   the job secret (muloco/diloco/auth.py)
      "elastic": {...}              each worker its own job, a fault-tolerant outer group (muloco/diloco/elastic_config.py)
      "pace": {"mode": "wall_clock"}  workers of unequal speed sync on a deadline (muloco/diloco/pace.py)
    }

Each key's meaning, default and range are its field's `setting` below (the README's reference is
generated from them). The inner optimizer (muon or adamw) is the ds_config's "optimizer" block, so
DP AdamW, DP Muon, DiLoCo and MuLoCo are one program with different configs.

Two compression choices exist in two forms, this trainer's (the defaults) and the official MuLoCo
code's: `ef_form` "plain" e = beta e + delta (the outer lr then scales the step once, as without
error feedback) or "paper" e = beta e + outer_lr delta (with beta 0.9, which `--recipe paper`
selects; for the tensors it compresses the same run as "plain" at outer lr outer_lr**2, identical
at outer_lr 1, the paper's K > 1 setting); `statistical_rounding` "centred" (lower reconstruction
error, muloco/diloco/compression.py) or "paper", the official round(c/s + n/2).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from muloco.diloco.auth import AuthConfig
from muloco.diloco.link import SlowLink
from muloco.diloco.pace import PaceConfig
from muloco.diloco.elastic_config import ElasticConfig
from muloco.core.typed_json import ConfigBlock, Problem, setting

Method = Literal["none", "statistical", "linear", "topk"]
METHODS = get_args(Method)
QuantizerBits = Literal[2, 4, 8]
QUANTIZER_BITS = get_args(QuantizerBits)
FP32_BITS = 32  # a group width meaning "sent uncompressed"
GroupBits = Literal[2, 4, 8, 32]
EFForm = Literal["plain", "paper"]
StatisticalRounding = Literal["centred", "paper"]
Granularity = Literal["row", "tensor"]


@dataclass(frozen=True)
class CompressionConfig(ConfigBlock):
    method: Method = setting("none", doc="`statistical` (row-wise, the paper's), `linear` (min-max), `topk`, "
                                         "or `none`")
    bits: QuantizerBits = setting(4, doc="bits per value of the hidden matrices (statistical, linear)")
    # Embeddings/head and 1-D tensors at 4 bits too: the cheapest setting within 0.5% of the
    # uncompressed validation loss in results/compression_groups.md (the paper sends them in fp32).
    embedding_bits: GroupBits = setting(4, doc="bits of the embeddings and the head; 32: sent in fp32 (the paper's)")
    vector_bits: GroupBits = setting(4, doc="bits of the 1-D tensors (norms); 32: sent in fp32 (the paper's)")
    granularity: Granularity = setting(
        "row", doc="the groups the codec works on: each `row` (one min/max, mean/sigma or top-k per row), or each "
                   "`tensor` whole (per tensor: the part of it one payload carries, rows/K of it under "
                   "`reduce_scatter`, a tensor-parallel rank's shard)")
    topk_fraction: float = setting(0.02, gt=0, le=1, doc="fraction of each group topk keeps")
    topk_value_bits: GroupBits = setting(32, doc="topk: the kept values in fp32 (32), or quantized statistically "
                                                 "over each group's kept values (2: SparseLoCo's form)")
    error_feedback: bool = setting(False, doc="carry what a payload did not send into the next sync")
    ef_form: EFForm = setting("plain", doc="`plain` e = beta e + delta, or `paper` e = beta e + outer_lr delta "
                                           "(the official code's)")
    ef_beta: float = setting(1.0, ge=0, le=1, doc="error-feedback decay beta")
    statistical_rounding: StatisticalRounding = setting(
        "centred", doc="`centred` symmetric bins over +-3 sigma, or `paper` the official round(c/s + n/2)")
    zstd: bool = setting(False, doc="zstd-compress each payload (its size then depends on the data)")
    zstd_level: int = setting(3, ge=1, le=22, doc="zstd's level")

    def for_group(self, group: str) -> CompressionConfig:
        """The config the tensors of a compression group are sent with ("none" when at fp32)."""
        bits = {"matrix": self.bits, "embedding": self.embedding_bits, "vector": self.vector_bits}[group]
        if self.method == "none" or bits == FP32_BITS:
            return replace(self, method="none", error_feedback=False)
        return replace(self, bits=bits) if self.method != "topk" else self


@dataclass(frozen=True)
class StreamingConfig(ConfigBlock):
    fragments: int = setting(1, ge=1, doc="F fragments of contiguous layers, synced at staggered offsets")
    overlap_steps: int | Literal["auto"] = setting(
        0, ge=0, doc="tau: a sync runs in the background while this many inner steps go on, and its result is "
                     "applied after them; `auto`: the smallest tau whose inner steps cover the sync's measured wall "
                     "time (the slowest worker's, from the fragment's previous sync, with a 25% margin; 1 for a "
                     "fragment's first sync), the same on every worker, recorded per sync")
    max_overlap_steps: int = setting(4, ge=1, doc="the largest tau `auto` picks")
    mix_alpha: float = setting(0.0, ge=0, lt=1, doc="local weight kept when an overlapped result lands: "
                                                    "a local + (1 - a) global")

    @property
    def largest_overlap(self) -> int:
        """The largest tau a sync can take."""
        return self.max_overlap_steps if self.overlap_steps == "auto" else self.overlap_steps


@dataclass(frozen=True)
class MuLoCoConfig(ConfigBlock):
    workers: int = setting(1, ge=1, doc="K datacenters; the world is K x D x P x T ranks")
    sync_interval: int = setting(30, ge=1, doc="H inner steps between outer syncs")
    outer_lr: float = setting(0.7, gt=0, doc="outer Nesterov SGD's lr (paper: K=1 0.7; K=16 1.0)")
    outer_momentum: float = setting(0.6, ge=0, lt=1, doc="its momentum (paper: K=1 0.6; K=16 0.9)")
    nesterov: bool = setting(True, doc="Nesterov outer momentum")
    compression: CompressionConfig = setting(factory=CompressionConfig, doc="the pseudogradients' codec (below)")
    collective: Literal["all_gather", "reduce_scatter"] = setting(
        "all_gather", doc="`reduce_scatter`: quantized chunks, re-quantize, all-gather (bytes per rank flat in K)")
    outer_backend: Literal["gloo", "nccl"] = setting(
        "gloo", doc="backend of the outer groups: `gloo` moves the packed payload through host memory (a WAN "
                    "between datacenters), `nccl` keeps it on the device (datacenters on one InfiniBand/RoCE fabric)")
    outer_state_on_device: bool = setting(False, doc="previous global weights and outer momentum (fp32) on the "
                                                     "accelerator instead of pinned host memory: faster syncs for 8 "
                                                     "bytes per parameter of device memory")
    streaming: StreamingConfig = setting(factory=StreamingConfig, doc="streaming syncs (below)")
    final_sync: bool = setting(True, flag="--no-final-sync",
                               doc="at the run's last step the syncs in flight are applied and every fragment not "
                                   "synced at that step syncs once more, so the run ends (and its last checkpoint is "
                                   "saved) with one model on every worker; false: it ends with K (export takes the "
                                   "global weights, or --worker k)")
    max_norm_ratio: float = setting(10.0, gt=1, doc="a worker whose pseudogradient norm is this many times its "
                                                    "peers' median, or any NaN/Inf, skips the sync for everyone")
    link: SlowLink | None = setting(None, doc="emulate a slow link on one machine (benchmarks): "
                                              "`{\"bandwidth_gbit_s\": 10, \"latency_ms\": 50}`")
    emulate_slowdown: tuple[float, ...] | None = setting(
        None, flag="--emulate-slowdown",
        doc="emulate workers of unequal speed on one machine (tests, benchmarks): one factor per worker, each worker "
            "sleeping after every inner step so it takes that many times as long (`[1, 1, 2]`)")
    pace: PaceConfig = setting(factory=PaceConfig, doc="when a sync comes: after H steps, or on a wall-clock deadline "
                                                       "for workers of unequal speed (below)")
    identical_worker_data: bool = setting(False, doc="every worker reads worker 0's data (a test identity)")
    sync_timeout_s: float = setting(60.0, gt=0, doc="elastic workers: a peer silent this long is dropped from the sync")
    auth: AuthConfig | Literal["none"] = setting(
        factory=AuthConfig, doc="the job secret that tags every message between workers, required whenever they talk "
                                "(K > 1 or elastic); `\"none\"` sends everything unauthenticated (a warning at start)")
    elastic: ElasticConfig | None = setting(None, doc="each worker its own job, meeting in a fault-tolerant outer "
                                                      "group (below)")

    @property
    def talks(self) -> bool:
        """Whether workers exchange messages (and so need the job secret)."""
        return self.workers > 1 or self.elastic is not None

    def problems(self) -> list[Problem]:
        problems = []
        if self.streaming.fragments > self.sync_interval:
            problems.append(("streaming.fragments", f"({self.streaming.fragments}) cannot exceed sync_interval "
                                                    f"({self.sync_interval})"))
        if self.streaming.largest_overlap >= self.sync_interval:
            key = "max_overlap_steps" if self.streaming.overlap_steps == "auto" else "overlap_steps"
            problems.append((f"streaming.{key}", f"({self.streaming.largest_overlap}) must be below "
                                                 f"sync_interval ({self.sync_interval})"))
        if self.emulate_slowdown is not None and (len(self.emulate_slowdown) != self.workers or not all(
                f >= 1 for f in self.emulate_slowdown)):
            problems.append(("emulate_slowdown", f"must be one factor >= 1 per worker ({self.workers}), got "
                                                 f"{list(self.emulate_slowdown)}"))
        if self.pace.paced:
            unsupported = [  # (key, what, why), each refused in one line rather than half supported
                ("streaming.fragments", self.streaming.fragments > 1, f"({self.streaming.fragments})",
                 "their staggered offsets assume every worker takes every step"),
                ("streaming.overlap_steps", self.streaming.overlap_steps != 0, f"({self.streaming.overlap_steps!r})",
                 "a sync in flight would land after a number of steps that differs between workers"),
            ]
            problems += [(key, f"{what} is not supported with pace.mode 'wall_clock' yet: {why}")
                         for key, given, what, why in unsupported if given]
        if self.elastic is not None and self.elastic.min_workers is not None and self.elastic.min_workers > self.workers:
            problems.append(("elastic.min_workers", f"({self.elastic.min_workers}) cannot exceed workers ({self.workers})"))
        if self.streaming.overlap_steps == "auto" and self.elastic is not None:
            problems.append(("streaming.overlap_steps", "'auto' is not supported with an elastic block yet (a worker "
                                                        "that catches up has not seen its peers' timings): set a number"))
        return problems
