"""What a plan is made from: the run's sizes and settings as the trainer reads them, and the codec's measured
throughput."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from muloco.core.errors import ConfigError
from muloco.core.topology import ParallelSizes
from muloco.diloco.config import CompressionConfig, MuLoCoConfig
from trainer.optim.config import MuonParams, OptimizerConfig


@dataclass
class PlanInputs:
    model: str
    sizes: ParallelSizes  # K x D x P x T
    muloco: MuLoCoConfig  # the ds_config's outer loop (its defaults when it has none)
    optimizer: OptimizerConfig  # the inner optimizer: muon (MuLoCo) or adamw (DiLoCo)
    seq_length: int
    global_batch: int
    micro_batch: int
    bf16: bool
    bandwidth_gbit: float
    bandwidth_scope: str
    tokens: float
    gpu_tflops: float
    mfu: float
    dp_grad_bytes: int
    vocab_size: int
    gpu_memory_gib: float
    codec: CodecThroughput | None = None  # None: the codec's time is not modelled
    hook_zero: int | None = None  # a DeepSpeed hook run (muloco/hook/) under this ZeRO stage; None: this trainer's run

    @property
    def compression(self) -> CompressionConfig:
        return self.muloco.compression

    @property
    def authenticated(self) -> bool:
        """Every outer message tagged (muloco.auth; off only with "none")."""
        return self.muloco.auth != "none"

    @property
    def muon(self) -> MuonParams | None:
        """Muon's hyperparameters when it is the inner optimizer."""
        return self.optimizer.params if isinstance(self.optimizer.params, MuonParams) else None

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per step (gradient accumulation), from B split over K workers x D."""
        per_step = self.micro_batch * self.sizes.data * self.sizes.workers
        if self.global_batch % per_step:
            raise ConfigError(f"global batch {self.global_batch} is not divisible by micro-batch x D x K = "
                              f"{self.micro_batch} x {self.sizes.data} x {self.sizes.workers}")
        return self.global_batch // per_step


@dataclass(frozen=True)
class CodecThroughput:
    """Elements per second of one compression setting's encoder and decoder on the target device."""
    encode: float
    decode: float
    source: str

    @classmethod
    def from_benchmark(cls, path: Path, compression: CompressionConfig) -> "CodecThroughput | None":
        """The row of `compression` in benchmarks/codec_throughput.py's JSON (its last line); None for
        method none, which has no codec."""
        if compression.method == "none":
            return None
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        try:
            rows = json.loads(lines[-1])["rows"]
        except (IndexError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"--codec-json {path}: not the JSON last line of benchmarks/codec_throughput.py") from err
        for row in rows:
            same = row.get("method") == compression.method and (
                row.get("topk_fraction") == compression.topk_fraction if compression.method == "topk"
                else row.get("bits") == compression.bits)
            if same:
                return cls(float(row["encode_elements_per_s"]), float(row["decode_elements_per_s"]), str(path))
        raise ConfigError(f"--codec-json {path} has no row for {compression.method} "
                          f"{compression.topk_fraction if compression.method == 'topk' else compression.bits}")

    def sync_seconds(self, owned_elements: float, workers: int, collective: str) -> float:
        E, K = owned_elements, workers
        if collective == "all_gather":
            return E / self.encode + K * E / self.decode
        return (E + E / K) / self.encode + 2 * E / self.decode


def parse_compression(spec: str) -> dict:
    """The compression block of 'none', 'statistical:4', 'linear:2', 'topk:0.02' (no argument: the
    block's default bits or fraction)."""
    method, _, arg = spec.partition(":")
    if method == "none" or not arg:
        return {"method": method}
    return {"method": method, **({"topk_fraction": float(arg)} if method == "topk" else {"bits": int(arg)})}
