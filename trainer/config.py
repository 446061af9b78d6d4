"""The run's configuration: command-line flags (Megatron's names) on top of the DeepSpeed JSON config.

Resolution order: preset < explicit model flags; ds_config < explicit batch/optimizer flags. The
resolved `RunConfig` is what the run uses and what it writes to `config.json`.

Batch semantics (the paper's): the global batch B, in sequences per inner step, is split over the
K workers. The ds_config's `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` are
per rank, as DeepSpeed sees them, and DeepSpeed only sees one worker: its `train_batch_size` is the
per-worker batch B/K = micro x accumulation x D. `--global-batch-size` (Megatron's flag) is B.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.model.presets import PRESETS, ModelShape


@dataclass
class OptimizerConfig:
    """The inner optimizer; the ds_config's "optimizer" block in DeepSpeed's {"type", "params"} form."""

    name: str = "adamw"  # "adamw" or "muon" (Muon on hidden matrices, AdamW on the rest)
    lr: float = 3e-3
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.99)
    adam_eps: float = 1e-8
    adamw_lr_factor: float = 1.0  # AdamW lr = factor x lr when the inner optimizer is muon
    adamw_weight_decay_factor: float = 1.0
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    ns_schedule: str = "paper"  # "paper" or "keller"
    ns_steps: int = 5
    ns_dtype: str = "float32"
    lr_scaling: str = "spectral_norm"  # "spectral_norm", "match_rms_adamw", "torch_original", "none"

    def __post_init__(self):
        if self.name not in ("adamw", "muon"):
            raise ConfigError(f'optimizer type must be "adamw" or "muon", got {self.name!r}')
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        self.adam_betas = tuple(self.adam_betas)


@dataclass
class ScheduleConfig:
    train_iters: int = 100
    warmup_iters: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to 10% of peak (the paper)
    clip_grad: float = 1.0


@dataclass
class BatchConfig:
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    data_parallel: int = 1  # D, derived from the world size
    workers: int = 1  # K

    @property
    def per_worker(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel

    @property
    def global_batch(self) -> int:
        return self.per_worker * self.workers


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)  # Megatron blend: [prefix] or [w1, p1, w2, p2, ...]
    valid_data_path: list[str] = field(default_factory=list)
    split: str = "98,2,0"
    tokenizer_model: str | None = None
    vocab_size: int | None = None


@dataclass
class RunConfig:
    model_preset: str
    model: ModelShape
    tensor_parallel: int
    pipeline_parallel: int
    batch: BatchConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    data: DataConfig
    seed: int = 1234
    run_dir: str = "runs/default"
    tensorboard_dir: str | None = None
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 4
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    bf16: bool = False
    ds_config: dict[str, Any] = field(default_factory=dict)
    muloco: Any = None  # trainer.diloco.config.MuLoCoConfig, or None for the data-parallel baseline
    worker_id: int | None = None  # elastic workers (muloco.elastic): this job's worker k; the world is one worker

    @property
    def elastic(self) -> bool:
        return self.muloco is not None and self.muloco.elastic is not None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="MuLoCo pretraining on Megatron-core shards under DeepSpeed")
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    g = p.add_argument_group("model (override the preset)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups",
                 "--ffn-hidden-size", "--kv-channels", "--seq-length"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--no-qk-layernorm", action="store_true", help="Llama-style attention without QK-norm")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--worker-id", type=int, default=None,
                   help="elastic MuLoCo (muloco.elastic): this launch is worker k, a world of D x P x T ranks")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[], help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--valid-data-path", nargs="+", default=[])
    g.add_argument("--split", default="98,2,0")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="when no tokenizer model is given")
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None, help="B, sequences per inner step over all workers")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--min-lr-ratio", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--clip-grad", type=float, default=None)
    g.add_argument("--optimizer", choices=["adamw", "muon"], default=None, help="override the ds_config's optimizer type")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--run-dir", default=None)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    return p


_OPTIMIZER_PARAM_KEYS = {"lr": "lr", "weight_decay": "weight_decay", "betas": "adam_betas", "eps": "adam_eps",
                         "momentum": "muon_momentum", "nesterov": "muon_nesterov", "ns_schedule": "ns_schedule",
                         "ns_steps": "ns_steps", "ns_dtype": "ns_dtype", "lr_scaling": "lr_scaling",
                         "adamw_lr_factor": "adamw_lr_factor",
                         "adamw_weight_decay_factor": "adamw_weight_decay_factor"}


def _optimizer_from_ds(block: dict[str, Any] | None) -> OptimizerConfig:
    if not block:
        return OptimizerConfig()
    params = block.get("params", {})
    unknown = sorted(set(params) - set(_OPTIMIZER_PARAM_KEYS))
    if unknown:
        raise ConfigError(f"unknown ds_config optimizer params {unknown}; known: {sorted(_OPTIMIZER_PARAM_KEYS)}")
    return OptimizerConfig(name=str(block.get("type", "adamw")).lower(),
                           **{_OPTIMIZER_PARAM_KEYS[k]: v for k, v in params.items()})


def _scheduler_from_ds(block: dict[str, Any] | None) -> ScheduleConfig:
    params = (block or {}).get("params", {})
    return ScheduleConfig(**{k: v for k, v in params.items() if k in ("train_iters", "warmup_iters", "min_lr_ratio")})


def resolve(args: argparse.Namespace, world_size: int) -> RunConfig:
    ds = json.loads(Path(args.ds_config).read_text())
    muloco = ds.pop("muloco", None)
    if muloco is not None:
        from trainer.diloco.config import MuLoCoConfig  # the outer loop's own config module

        muloco = MuLoCoConfig.from_dict(muloco)
    workers = muloco.workers if muloco is not None else 1
    elastic = muloco is not None and muloco.elastic is not None
    from trainer.elastic.config import check_worker_id

    check_worker_id(args.worker_id, workers, elastic)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    from trainer.topology import ParallelSizes  # sizes are validated there, with one message

    sizes = ParallelSizes.from_world(world_size, 1 if elastic else workers, pp, tp)  # an elastic world is one worker

    shape = PRESETS[args.model].with_overrides(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, seq_length=args.seq_length,
        qk_layernorm=False if args.no_qk_layernorm else None)
    _check_model(shape, tp, pp)

    optimizer = _optimizer_from_ds(ds.pop("optimizer", None))
    for flag, attr in (("lr", "lr"), ("weight_decay", "weight_decay"), ("optimizer", "name")):
        if getattr(args, flag) is not None:
            setattr(optimizer, attr, getattr(args, flag))
    optimizer.__post_init__()

    schedule = _scheduler_from_ds(ds.pop("scheduler", None))
    schedule.clip_grad = float(ds.pop("gradient_clipping", schedule.clip_grad))
    for flag, attr in (("train_iters", "train_iters"), ("lr_warmup_iters", "warmup_iters"),
                       ("min_lr_ratio", "min_lr_ratio"), ("clip_grad", "clip_grad")):
        if getattr(args, flag) is not None:
            setattr(schedule, attr, getattr(args, flag))

    batch = _resolve_batch(ds, args, sizes.data, workers)
    run_dir = args.run_dir or str(Path("runs") / Path(args.ds_config).stem)
    return RunConfig(
        model_preset=args.model, model=shape, tensor_parallel=tp, pipeline_parallel=pp, batch=batch,
        optimizer=optimizer, schedule=schedule,
        data=DataConfig(list(args.data_path), list(args.valid_data_path), args.split, args.tokenizer_model,
                        args.vocab_size),
        seed=args.seed, run_dir=run_dir, tensorboard_dir=args.tensorboard_dir or str(Path(run_dir) / "tensorboard"),
        log_interval=args.log_interval, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        save=args.save, load=args.load, save_interval=args.save_interval,
        # Mixed precision is Megatron's autocast over fp32 parameters (the optimizers need whole fp32
        # tensors, not DeepSpeed's flattened bf16 partitions), so DeepSpeed never sees the bf16 block.
        bf16=bool(ds.pop("bf16", {}).get("enabled", False)), ds_config=ds, muloco=muloco, worker_id=args.worker_id)


def _check_model(shape: ModelShape, tp: int, pp: int) -> None:
    problems = []
    if shape.num_attention_heads % tp:
        problems.append(f"num-attention-heads {shape.num_attention_heads} is not divisible by tensor-model-parallel-size {tp}")
    if shape.query_groups % tp:
        problems.append(f"num-query-groups {shape.query_groups} is not divisible by tensor-model-parallel-size {tp}")
    if shape.num_attention_heads % shape.query_groups:
        problems.append(f"num-attention-heads {shape.num_attention_heads} is not divisible by num-query-groups {shape.query_groups}")
    if shape.ffn_hidden_size % tp:
        problems.append(f"ffn-hidden-size {shape.ffn_hidden_size} is not divisible by tensor-model-parallel-size {tp}")
    if shape.num_layers % pp:
        problems.append(f"num-layers {shape.num_layers} is not divisible by pipeline-model-parallel-size {pp}")
    if problems:
        raise ConfigError("; ".join(problems))


def _resolve_batch(ds: dict[str, Any], args: argparse.Namespace, data_parallel: int, workers: int) -> BatchConfig:
    micro = args.micro_batch_size or int(ds.get("train_micro_batch_size_per_gpu", 4))
    if args.global_batch_size is not None:
        per_step = micro * data_parallel * workers
        if args.global_batch_size % per_step:
            raise ConfigError(f"global-batch-size {args.global_batch_size} is not divisible by micro-batch-size x D x K "
                              f"= {micro} x {data_parallel} x {workers}")
        accumulation = args.global_batch_size // per_step
    else:
        accumulation = int(ds.get("gradient_accumulation_steps", 1))
    batch = BatchConfig(micro, accumulation, data_parallel, workers)
    # DeepSpeed checks train_batch_size == micro x accumulation x its DP size (one worker's D).
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = accumulation
    ds["train_batch_size"] = batch.per_worker
    return batch
