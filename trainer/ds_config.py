"""The DeepSpeed JSON config as one typed value: every key the trainer reads, DeepSpeed's own keys
it passes through, and nothing else.

The trainer owns the optimizer, the schedule, clipping, bf16 and the batch (trainer/engine.py writes
DeepSpeed's view of the batch); DeepSpeed is handed only the pass-through keys (`deepspeed_keys`),
which it checks itself. Any other top-level key is an error naming the closest known one, so a
misspelt block (`"muloko"`) cannot silently train another method. `load_ds_config` is the one
reader: the trainer, tools/plan.py, the benchmarks and tools/compare all see the same values.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from muloco.diloco.config import MuLoCoConfig
from muloco.core.errors import ConfigError
from trainer.optim.config import OptimizerConfig
from trainer.schedule import SchedulerConfig
from muloco.core.typed_json import ConfigBlock, load, read_json_object, setting


@dataclass(frozen=True)
class Bf16Config(ConfigBlock):
    enabled: bool = setting(False, doc="Megatron's bf16 autocast over fp32 master weights (GPU only); the "
                                       "optimizers keep whole fp32 tensors, so DeepSpeed never sees this block")


@dataclass(frozen=True)
class LayoutConfig(ConfigBlock):
    """The layout a config's batch and memory were planned for (tools/plan.py); a run with other
    sizes is refused."""
    tensor: int | None = setting(None, ge=1, doc="T")
    pipeline: int | None = setting(None, ge=1, doc="P")
    data: int | None = setting(None, ge=1, doc="D, inner data-parallel replicas per worker")

    def mismatches(self, tensor: int, pipeline: int, data: int) -> list[str]:
        actual = {"tensor": tensor, "pipeline": pipeline, "data": data}
        return [f"{k} {getattr(self, k)} planned, {actual[k]} in this run" for k in actual
                if getattr(self, k) is not None and getattr(self, k) != actual[k]]


@dataclass(frozen=True)
class RecipeNotes(ConfigBlock):
    """Provenance of a generated config (tools/write_gpu_configs.py): notes, not settings."""
    name: str | None = setting(None, doc="the recipe applied (`paper`)")
    model: str | None = setting(None, doc="the `--model` the config was made for; another is refused")
    inner_optimizer: str | None = setting(None, doc="the inner optimizer it was made for")
    global_batch: int | None = setting(None, ge=1, doc="the global batch B it was made for")
    generated_by: str | None = setting(None, doc="the command that wrote it")
    not_from_the_paper: dict[str, str] = setting(factory=dict, doc="settings that are not the paper's, and why")


@dataclass(frozen=True)
class DsConfig(ConfigBlock):
    train_micro_batch_size_per_gpu: int = setting(4, ge=1, flag="--micro-batch-size",
                                                  doc="micro-batch per rank, as DeepSpeed sees it")
    gradient_accumulation_steps: int = setting(1, ge=1, doc="micro-batches per rank per optimizer step "
                                                            "(`--global-batch-size` sets it from B)")
    train_batch_size: int | None = setting(None, ge=1, doc="derived by the trainer (micro x accumulation x D = "
                                                           "B/K, what DeepSpeed checks); a value here is not read")
    optimizer: OptimizerConfig = setting(factory=OptimizerConfig, doc="the inner optimizer (below)")
    scheduler: SchedulerConfig = setting(factory=SchedulerConfig, doc="the lr schedule (below)")
    gradient_clipping: float = setting(1.0, ge=0, flag="--clip-grad",
                                       doc="global-norm clip over all TP/PP shards, done by the trainer (0: off)")
    bf16: Bf16Config = setting(factory=Bf16Config, doc="`{\"enabled\": true}`: bf16 autocast (below)")
    muloco: MuLoCoConfig | None = setting(None, doc="the outer loop (part 1: the `muloco` block); absent: the data-parallel baseline")
    layout: LayoutConfig | None = setting(None, doc="the layout the batch and memory were planned for (below)")
    recipe: RecipeNotes | None = setting(None, doc="provenance notes of a generated config (below)")
    # DeepSpeed's own keys, handed to it as they are (logging and diagnostics; it checks them).
    steps_per_print: int | None = setting(None, ge=1, doc="DeepSpeed's progress print interval")
    wall_clock_breakdown: bool | None = setting(None, doc="DeepSpeed's timing breakdown")
    memory_breakdown: bool | None = setting(None, doc="DeepSpeed's memory breakdown")
    dump_state: bool | None = setting(None, doc="DeepSpeed prints its state at start")
    flops_profiler: dict[str, Any] | None = setting(None, doc="DeepSpeed's flops profiler")
    comms_logger: dict[str, Any] | None = setting(None, doc="DeepSpeed's communication logger")
    tensorboard: dict[str, Any] | None = setting(None, doc="DeepSpeed's own TensorBoard monitor (the trainer "
                                                           "writes its own: `--tensorboard-dir`)")
    wandb: dict[str, Any] | None = setting(None, doc="DeepSpeed's Weights & Biases monitor")
    csv_monitor: dict[str, Any] | None = setting(None, doc="DeepSpeed's CSV monitor")

    # DeepSpeed keys that would change what the trainer owns, refused with the reason.
    REFUSED: ClassVar[dict[str, str]] = {
        "fp16": "the trainer keeps fp32 master weights with optional bf16 autocast (the bf16 block); fp16 loss "
                "scaling would skip steps: use {\"bf16\": {\"enabled\": true}} on a GPU, or neither (fp32)",
        "amp": "use the bf16 block (Megatron's bf16 autocast over fp32 weights)",
        "torch_autocast": "use the bf16 block (Megatron's bf16 autocast over fp32 weights)",
        "zero_optimization": "the inner optimizer needs each parameter's whole fp32 tensor (Muon orthogonalizes "
                             "whole matrices), which ZeRO (any stage) would partition: remove the block (to fit a "
                             "larger model use tensor or pipeline parallelism: tools/plan.py --list-layouts)",
    }
    DEEPSPEED_KEYS: ClassVar[tuple[str, ...]] = ("steps_per_print", "wall_clock_breakdown", "memory_breakdown",
                                                 "dump_state", "flops_profiler", "comms_logger", "tensorboard",
                                                 "wandb", "csv_monitor")

    def check_model(self, preset: str | None, run_model: str | None = None) -> None:
        """A generated config's batch, weight decay and steps belong to the model it was made for
        (`preset`: the run's, None when its model is no preset; `run_model` names the run's model)."""
        if self.recipe is not None and self.recipe.model not in (None, preset):
            raise ConfigError(f"the ds_config's batch, weight decay and steps were made for --model "
                              f"{self.recipe.model} (its recipe block), not {run_model or preset}")

    def deepspeed_keys(self) -> dict[str, Any]:
        """The pass-through keys the config sets, for deepspeed.initialize."""
        return {k: getattr(self, k) for k in self.DEEPSPEED_KEYS if getattr(self, k) is not None}


def load_ds_config(source: str | Path | dict[str, Any], origins: dict[str, str] | None = None) -> DsConfig:
    """The typed ds_config from a file or an already-read JSON object."""
    raw = source if isinstance(source, dict) else read_json_object(source)
    return load(DsConfig, raw, "", origins)
