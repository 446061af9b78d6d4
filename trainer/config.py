"""The run's configuration: command-line flags (Megatron's names) on top of the DeepSpeed JSON config.

Resolution order: preset < explicit model flags; ds_config < explicit batch/optimizer flags. The
resolved `RunConfig` is what the run uses and what it writes to `config.json`. Every value is
checked here, for type and range, before any collective: a bad one raises `ConfigError` (printed
by the entry point as one `configuration error:` line on rank 0).

Each ds_config block maps onto one frozen dataclass and is strict: an unknown key, a value of the
wrong type ("2" for an int) or out of range is an error, never silently dropped or coerced.

Batch semantics (the paper's): the global batch B, in sequences per inner step, is split over the
K workers. The ds_config's `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` are
per rank, as DeepSpeed sees them, and DeepSpeed only sees one worker (trainer/engine.py tells it
the per-worker batch B/K = micro x accumulation x D). `--global-batch-size` (Megatron's flag) is B.
"""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.diloco.auth import read_job_key, resolve_key_file
from trainer.diloco.config import MuLoCoConfig
from trainer.elastic.config import check_worker_id
from trainer.errors import ConfigError, TopologyError
from trainer.model.presets import ARCHITECTURES, PRESETS, ModelShape
from trainer.model.stages import stage_layers
from trainer.optim.muon import MuonConfig
from trainer.recipe import fill_ds_config
from trainer.topology import ParallelSizes

OptimizerName = Literal["adamw", "muon"]


# -- checking values against a dataclass's annotations ------------------------------------------------

def _type_problem(value: Any, annotation: Any) -> str | None:
    """Why `value` does not fit `annotation` (None when it does). JSON has no tuples, so a list
    stands for a tuple; an int stands for a float; bool is never an int."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return None
    if origin is Literal:
        return None if value in args else f"one of {list(args)}"
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, a) for a in args]
        return None if None in problems else " or ".join(p for p in problems if p)
    if annotation is type(None):
        return None if value is None else "null"
    if annotation is bool:
        return None if isinstance(value, bool) else "a boolean"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if annotation is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            return "an object"
        return None  # its keys are checked by check_block
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or (args and args[-1] is not Ellipsis and len(value) != len(args)):
            return f"a list of {len(args)}" if args else "a list"
        items = args if args and args[-1] is not Ellipsis else [args[0] if args else Any] * len(value)
        problems = [_type_problem(v, a) for v, a in zip(value, items)]
        return None if not any(problems) else f"a list whose items are {', '.join(p or 'fine' for p in problems)}"
    if origin in (list, collections.abc.Sequence):
        return None if isinstance(value, (list, tuple)) else "a list"
    if origin is dict:
        return None if isinstance(value, dict) else "an object"
    return None  # an annotation this checker does not model: the dataclass's own checks apply


def check_block(cls: type, block: Any, where: str) -> None:
    """Raise ConfigError naming the first unknown key or mistyped value of `block` for dataclass
    `cls` (recursing into nested dataclass fields)."""
    if not isinstance(block, dict):
        raise ConfigError(f"{where} must be an object, got {block!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(block) - set(known))
    if unknown:
        raise ConfigError(f"unknown keys in {where}: {unknown}; known: {sorted(known)}")
    for key, value in block.items():
        annotation = hints[key]
        problem = _type_problem(value, annotation)
        if problem:
            raise ConfigError(f"{where}.{key} must be {problem}, got {value!r}")
        nested = [a for a in (annotation, *typing.get_args(annotation)) if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, dict):
            check_block(nested[0], value, f"{where}.{key}")


def _positive(where: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{where} must be > 0, got {value}")


def _at_least(where: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(f"{where} must be >= {low}, got {value}")


# -- the configs ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimizerConfig:
    """The inner optimizer; the ds_config's "optimizer" block in DeepSpeed's {"type", "params"} form.
    `muon` holds the Muon hyperparameters (with the peak lr and weight decay) when `name` is muon."""

    name: OptimizerName = "adamw"  # "muon": Muon on hidden matrices, AdamW on the rest
    lr: float = 3e-3
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.99)
    adam_eps: float = 1e-8
    adamw_lr_factor: float = 1.0  # AdamW lr = factor x lr when the inner optimizer is muon
    adamw_weight_decay_factor: float = 1.0
    muon: MuonConfig | None = None

    # ds_config "params" keys that belong to the AdamW side (the rest are MuonConfig's)
    ADAMW_KEYS: typing.ClassVar[dict[str, str]] = {
        "lr": "lr", "weight_decay": "weight_decay", "betas": "adam_betas", "eps": "adam_eps",
        "adamw_lr_factor": "adamw_lr_factor", "adamw_weight_decay_factor": "adamw_weight_decay_factor"}
    MUON_KEYS: typing.ClassVar[tuple[str, ...]] = ("momentum", "nesterov", "ns_schedule", "ns_steps", "ns_dtype",
                                                  "lr_scaling")

    def __post_init__(self):
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))  # JSON gives a list
        if self.name not in typing.get_args(OptimizerName):
            raise ConfigError(f'optimizer type must be "adamw" or "muon", got {self.name!r}')
        _positive("optimizer lr", self.lr)
        _at_least("optimizer weight_decay", self.weight_decay, 0)
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"optimizer betas must be in [0, 1), got {list(self.adam_betas)}")
        _positive("optimizer eps", self.adam_eps)
        _positive("optimizer adamw_lr_factor", self.adamw_lr_factor)
        _at_least("optimizer adamw_weight_decay_factor", self.adamw_weight_decay_factor, 0)
        if (self.muon is None) != (self.name == "adamw"):
            raise ConfigError("optimizer: the Muon hyperparameters must be given exactly when the type is muon")
        if self.muon is not None and (self.muon.lr, self.muon.weight_decay) != (self.lr, self.weight_decay):
            raise ConfigError("optimizer: Muon's lr and weight_decay are the optimizer's")

    @classmethod
    def from_params(cls, name: str, params: dict[str, Any] | None = None) -> "OptimizerConfig":
        """The one parser of the optimizer block's `params` (also what tests build configs with)."""
        params = dict(params or {})
        known = set(cls.ADAMW_KEYS) | set(cls.MUON_KEYS)
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"unknown ds_config optimizer params {unknown}; known: {sorted(known)}")
        if not isinstance(name, str):
            raise ConfigError(f"optimizer type must be a string, got {name!r}")
        hints = typing.get_type_hints(cls)
        for key, field_name in cls.ADAMW_KEYS.items():
            if key in params and (problem := _type_problem(params[key], hints[field_name])):
                raise ConfigError(f"optimizer.params.{key} must be {problem}, got {params[key]!r}")
        adamw_values = {cls.ADAMW_KEYS[k]: v for k, v in params.items() if k in cls.ADAMW_KEYS}
        muon_values = {k: v for k, v in params.items() if k in cls.MUON_KEYS}
        check_block(MuonConfig, muon_values, "optimizer.params")
        name = name.lower()
        if name == "adamw" and muon_values:
            raise ConfigError(f"optimizer params {sorted(muon_values)} are Muon's; the optimizer type is adamw")
        adamw = cls(name="adamw", **adamw_values)  # checks the shared values with their defaults
        if name != "muon":
            return dataclasses.replace(adamw, name=name)
        try:
            muon = MuonConfig(lr=adamw.lr, weight_decay=adamw.weight_decay, **muon_values)
        except ValueError as err:
            raise ConfigError(f"optimizer: {err}") from err
        return dataclasses.replace(adamw, name="muon", muon=muon)

    def with_peak(self, lr: float | None = None, weight_decay: float | None = None,
                  name: str | None = None) -> "OptimizerConfig":
        """Command-line overrides of the ds_config's values (the Muon block follows)."""
        lr = self.lr if lr is None else lr
        weight_decay = self.weight_decay if weight_decay is None else weight_decay
        name = self.name if name is None else name
        muon = None
        if name == "muon":
            try:
                muon = dataclasses.replace(self.muon or MuonConfig(lr=lr), lr=lr, weight_decay=weight_decay)
            except ValueError as err:
                raise ConfigError(f"optimizer: {err}") from err
        return dataclasses.replace(self, name=name, lr=lr, weight_decay=weight_decay, muon=muon)


@dataclass(frozen=True)
class ScheduleConfig:
    train_iters: int = 100
    warmup_iters: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to 10% of peak (the paper)
    clip_grad: float = 1.0

    def __post_init__(self):
        _at_least("train-iters", self.train_iters, 1)
        _at_least("warmup iters (scheduler warmup_iters / --lr-warmup-iters)", self.warmup_iters, 0)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        _at_least("gradient clipping (gradient_clipping / --clip-grad)", self.clip_grad, 0)


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    data_parallel: int = 1  # D, derived from the world size
    workers: int = 1  # K

    def __post_init__(self):
        _at_least("micro batch size (train_micro_batch_size_per_gpu / --micro-batch-size)", self.micro_batch_size, 1)
        _at_least("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)

    @property
    def per_worker(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel

    @property
    def global_batch(self) -> int:
        return self.per_worker * self.workers


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] = ()  # Megatron blend: (prefix,) or (w1, p1, w2, p2, ...)
    valid_data_path: tuple[str, ...] = ()
    split: str = "98,2,0"
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    data_args_path: str | None = None  # a file holding the train blend (trainer/data.py reads it)
    per_split_data_args_path: str | None = None  # a JSON file of train and valid blends

    def __post_init__(self):
        if self.vocab_size is not None:
            _at_least("vocab-size", self.vocab_size, 1)


@dataclass(frozen=True)
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
    eval_interval: int = 50  # 0: no evaluation
    eval_iters: int = 4
    save: str | None = None
    load: str | None = None
    load_worker: int | None = None  # start from this worker's state in --load (any K; no outer state)
    save_interval: int | None = None
    keep_last: int | None = None  # None: keep every checkpoint
    verify_checksums: bool = True
    hang_timeout_s: float = 1800.0  # 0: no hang watchdog
    exit_signal_handler: bool = False  # SIGTERM: finish the step, save, exit 0
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    bf16: bool = False
    distributed_backend: Literal["nccl", "gloo"] | None = None  # None: the accelerator's
    deterministic: bool = False
    ds_config: dict[str, Any] = field(default_factory=dict)  # the keys DeepSpeed itself reads
    muloco: MuLoCoConfig | None = None  # None: the data-parallel baseline
    auth_key_file: str | None = None  # the job secret's file when workers talk and auth is on (read at start)
    recipe_table: str | None = None  # what --recipe filled in, printed at start

    def __post_init__(self):
        _at_least("seed", self.seed, 0)
        _at_least("log-interval", self.log_interval, 1)
        _at_least("eval-interval", self.eval_interval, 0)
        _at_least("eval-iters", self.eval_iters, 1)
        if self.save_interval is not None:
            _at_least("save-interval", self.save_interval, 1)
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
    g.add_argument("--arch", choices=ARCHITECTURES, default=None,
                   help="paper (pre+post norms, QK-norm, document-masked attention, the paper's init; the paper "
                        "presets' default), qwen3 (pre-norm, QK-norm), llama (pre-norm, no QK-norm)")
    g.add_argument("--no-qk-layernorm", action="store_true", help="same as --arch llama")
    g = p.add_argument_group("parallelism")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="the default process group's backend (default: the accelerator's, NCCL on GPUs); gloo lets "
                        "several processes share one GPU when every intra-worker group has one rank")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--worker-id", type=int, default=None,
                   help="elastic MuLoCo (muloco.elastic): this launch is worker k, a world of D x P x T ranks")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[], help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--valid-data-path", nargs="+", default=[])
    g.add_argument("--data-args-path", default=None, help="a file holding what --data-path takes (Megatron's flag)")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='a JSON file {"train": [...], "valid": [...]} of blends (Megatron\'s flag)')
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
    g.add_argument("--recipe", choices=["paper"], default=None,
                   help="fill what the ds_config leaves out with the paper's hyperparameter rules (trainer/recipe.py)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms), for bit-exact resumes on GPUs")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--run-dir", default=None)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--load-worker", type=int, default=None, metavar="W",
                   help="start (not resume) from worker W's weights, inner optimizer and lr schedule in the --load "
                        "checkpoint, which may have any number of workers K; its outer-loop state and RNG are not "
                        "carried, so this run must have no muloco block (e.g. one worker's H steps with the full "
                        "global batch, or continuing one datacenter's state alone)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--keep-last", type=int, default=None, help="keep only the newest N checkpoints (default: all)")
    g.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="skip checking rank files against meta.json's SHA-256 on --load (saves a read at scale)")
    g = p.add_argument_group("faults and preemption")
    g.add_argument("--hang-timeout-s", type=float, default=1800.0,
                   help="exit non-zero with a 'hang detected:' line when a step makes no progress for this long "
                        "(0: off); must exceed the longest step, evaluation or checkpoint save")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM finish the current step, save a checkpoint and exit 0 (needs --save)")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit 0 after a step divisible by N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 after the first step that ends this many minutes after training started")
    return p


# ds_config keys the trainer reads itself (DeepSpeed never sees them), and their expected types.
_BATCH_KEYS = {"train_micro_batch_size_per_gpu": int, "gradient_accumulation_steps": int, "train_batch_size": int}


def _optimizer_from_ds(block: Any) -> OptimizerConfig:
    if block is None:
        return OptimizerConfig()
    if not isinstance(block, dict):
        raise ConfigError(f"ds_config optimizer must be an object, got {block!r}")
    unknown = sorted(set(block) - {"type", "params"})
    if unknown:
        raise ConfigError(f"unknown keys in the ds_config optimizer block: {unknown}; known: ['params', 'type']")
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"ds_config optimizer.params must be an object, got {params!r}")
    return OptimizerConfig.from_params(block.get("type", "adamw"), params)


_SCHEDULER_KEYS = ("train_iters", "warmup_iters", "min_lr_ratio")


def _scheduler_values(block: Any) -> dict[str, Any]:
    if block is None:
        return {}
    if not isinstance(block, dict) or set(block) - {"type", "params"}:
        raise ConfigError(f'ds_config scheduler must be {{"params": {{...}}}}, got {block!r}')
    if block.get("type") not in (None, "WarmupCosine"):
        raise ConfigError(f"ds_config scheduler type {block['type']!r} is not supported: the trainer's schedule is "
                          "linear warmup then cosine decay (omit type)")
    params = block.get("params", {})
    check_block(ScheduleConfig, params, "scheduler.params")
    unknown = sorted(set(params) - set(_SCHEDULER_KEYS))
    if unknown:
        raise ConfigError(f"unknown keys in scheduler.params: {unknown}; known: {list(_SCHEDULER_KEYS)}")
    return dict(params)


def _read_ds_config(path: str) -> dict[str, Any]:
    try:
        ds = json.loads(Path(path).read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"ds_config {path} not found") from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"ds_config {path} is not valid JSON: {err}") from err
    if not isinstance(ds, dict):
        raise ConfigError(f"ds_config {path} must hold a JSON object")
    for key, kind in _BATCH_KEYS.items():
        if key in ds and (not isinstance(ds[key], kind) or isinstance(ds[key], bool)):
            raise ConfigError(f"ds_config {key} must be an integer, got {ds[key]!r}")
    return ds


def _muloco_from_ds(block: Any) -> MuLoCoConfig | None:
    if block is None:
        return None
    check_block(MuLoCoConfig, block, "muloco")
    try:
        return MuLoCoConfig.from_dict(block)
    except ValueError as err:  # ConfigError is one
        raise ConfigError(str(err)) from err


def _bf16_from_ds(block: Any) -> bool:
    if block is None:
        return False
    if not isinstance(block, dict) or set(block) - {"enabled"} or not isinstance(block.get("enabled", False), bool):
        raise ConfigError(f'ds_config bf16 must be {{"enabled": true|false}}, got {block!r}')
    return block.get("enabled", False)


def resolve(args: argparse.Namespace, world_size: int) -> RunConfig:
    ds = _read_ds_config(args.ds_config)
    provenance = ds.pop("recipe", {})  # notes of the generated configs (trainer/recipe.py), not settings
    if provenance.get("model", args.model) != args.model:
        raise ConfigError(f"the ds_config's batch, weight decay and steps were made for --model {provenance['model']} "
                          f"(its recipe block), not {args.model}")
    planned_layout = ds.pop("layout", None)
    muloco_block = ds.pop("muloco", None)
    muloco = _muloco_from_ds(muloco_block)
    workers = muloco.workers if muloco is not None else 1
    elastic = muloco is not None and muloco.elastic is not None
    check_worker_id(args.worker_id, workers, elastic)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:  # sizes are validated there, with one message; an elastic job's world is one worker
        sizes = ParallelSizes.from_world(world_size, 1 if elastic else workers, pp, tp)
    except TopologyError as err:
        raise ConfigError(str(err)) from err

    check_layout(planned_layout, sizes)

    overrides = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                     ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels, seq_length=args.seq_length)
    for name, value in overrides.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    shape = PRESETS[args.model].with_overrides(**overrides, arch="llama" if args.no_qk_layernorm else args.arch)
    check_model_shape(shape, tp, pp)

    batch = _resolve_batch(ds, args, sizes.data, workers)
    recipe_table = None
    if args.recipe is not None:  # fills what the ds_config leaves out, before the blocks are parsed
        flags = {"optimizer.params.lr": args.lr, "optimizer.params.weight_decay": args.weight_decay,
                 "scheduler.params.train_iters": args.train_iters, "scheduler.params.warmup_iters": args.lr_warmup_iters,
                 "scheduler.params.min_lr_ratio": args.min_lr_ratio, "gradient_clipping": args.clip_grad}
        recipe_table = fill_ds_config(ds, muloco_block, args.model, args.optimizer, batch.global_batch, flags)
        muloco = _muloco_from_ds(muloco_block)

    optimizer = _optimizer_from_ds(ds.pop("optimizer", None)).with_peak(
        lr=args.lr, weight_decay=args.weight_decay, name=args.optimizer)

    clip = ds.pop("gradient_clipping", None)
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
        raise ConfigError(f"ds_config gradient_clipping must be a number, got {clip!r}")
    schedule_values = _scheduler_values(ds.pop("scheduler", None))
    if clip is not None:
        schedule_values["clip_grad"] = float(clip)
    for flag, key in (("train_iters", "train_iters"), ("lr_warmup_iters", "warmup_iters"),
                      ("min_lr_ratio", "min_lr_ratio"), ("clip_grad", "clip_grad")):
        if getattr(args, flag) is not None:
            schedule_values[key] = getattr(args, flag)
    schedule = ScheduleConfig(**schedule_values)

    if args.load_worker is not None and (args.load_worker < 0 or not args.load):
        raise ConfigError(f"--load-worker must be >= 0 and needs --load DIR, got {args.load_worker}"
                          + ("" if args.load else " without --load"))
    run_dir = args.run_dir or str(Path("runs") / Path(args.ds_config).stem)
    # Mixed precision is Megatron's autocast over fp32 parameters (the optimizers need whole fp32
    # tensors, not DeepSpeed's flattened bf16 partitions), so DeepSpeed never sees the bf16 block.
    bf16 = _bf16_from_ds(ds.pop("bf16", None))
    auth_key_file = None
    if muloco is not None and muloco.talks and muloco.auth != "none":
        key_path = resolve_key_file(muloco.auth, Path(args.ds_config).parent)
        read_job_key(key_path, muloco.auth.job_id)  # a missing or bad secret stops the run here, with one line
        auth_key_file = str(key_path)
    return RunConfig(
        model_preset=args.model, model=shape, tensor_parallel=tp, pipeline_parallel=pp, batch=batch,
        optimizer=optimizer, schedule=schedule,
        data=DataConfig(tuple(args.data_path), tuple(args.valid_data_path), args.split, args.tokenizer_model,
                        args.vocab_size, args.data_args_path, args.per_split_data_args_path),
        seed=args.seed, run_dir=run_dir, tensorboard_dir=args.tensorboard_dir or str(Path(run_dir) / "tensorboard"),
        log_interval=args.log_interval, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        save=args.save, load=args.load, load_worker=args.load_worker, save_interval=args.save_interval,
        **_fault_settings(args),
        bf16=bf16, distributed_backend=args.distributed_backend,
        deterministic=args.deterministic_mode, ds_config=ds, muloco=muloco, auth_key_file=auth_key_file,
        recipe_table=recipe_table,
        worker_id=args.worker_id)


def _fault_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Retention, integrity, hang and preemption flags, checked here so a bad value stops the run at once."""
    problems = []
    for flag, value, minimum in (("keep-last", args.keep_last, 1), ("exit-interval", args.exit_interval, 1)):
        if value is not None and value < minimum:
            problems.append(f"--{flag} must be >= {minimum}, got {value}")
    if args.hang_timeout_s < 0:
        problems.append(f"--hang-timeout-s must be >= 0 (0: off), got {args.hang_timeout_s}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        problems.append(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    stops = [f for f, on in (("--exit-signal-handler", args.exit_signal_handler),
                             ("--exit-interval", args.exit_interval is not None),
                             ("--exit-duration-in-mins", args.exit_duration_in_mins is not None)) if on]
    if stops and not args.save:
        problems.append(f"{' and '.join(stops)} save a checkpoint before exiting: give --save DIR")
    if problems:
        raise ConfigError("; ".join(problems))
    return dict(keep_last=args.keep_last, verify_checksums=args.verify_checksums, hang_timeout_s=args.hang_timeout_s,
                exit_signal_handler=args.exit_signal_handler, exit_interval=args.exit_interval,
                exit_duration_in_mins=args.exit_duration_in_mins)


def check_layout(layout: dict[str, Any] | None, sizes) -> None:
    """The ds_config's "layout" block ({"tensor": T, "pipeline": P, "data": D}) is the layout its
    batch and memory were planned for (tools/plan.py); running it with other sizes is an error."""
    if layout is None:
        return
    unknown = sorted(set(layout) - {"tensor", "pipeline", "data"})
    if unknown:
        raise ConfigError(f'unknown ds_config layout keys {unknown}; known: ["data", "pipeline", "tensor"]')
    actual = {"tensor": sizes.tensor, "pipeline": sizes.pipeline, "data": sizes.data}
    wrong = [f"{k} {layout[k]} planned, {actual[k]} in this run" for k in ("tensor", "pipeline", "data")
             if k in layout and int(layout[k]) != actual[k]]
    if wrong:
        raise ConfigError("the ds_config was planned for another layout: " + "; ".join(wrong)
                          + " (set --tensor-model-parallel-size/--pipeline-model-parallel-size and the world size "
                          "to match, or re-plan with tools/plan.py and edit its layout block)")


def check_model_shape(shape: ModelShape, tp: int, pp: int) -> None:
    """Model sizes Megatron can shard at T x P (the trainer and tools/plan.py share this rule)."""
    problems = []
    if shape.num_attention_heads % tp:
        problems.append(f"num-attention-heads {shape.num_attention_heads} is not divisible by tensor-model-parallel-size {tp}")
    if shape.query_groups % tp:
        problems.append(f"num-query-groups {shape.query_groups} is not divisible by tensor-model-parallel-size {tp}")
    if shape.num_attention_heads % shape.query_groups:
        problems.append(f"num-attention-heads {shape.num_attention_heads} is not divisible by num-query-groups {shape.query_groups}")
    if shape.ffn_hidden_size % tp:
        problems.append(f"ffn-hidden-size {shape.ffn_hidden_size} is not divisible by tensor-model-parallel-size {tp}")
    try:
        stage_layers(shape.num_layers, pp)  # uneven stages are fine; fewer layers than stages are not
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ConfigError("; ".join(problems))


def _resolve_batch(ds: dict[str, Any], args: argparse.Namespace, data_parallel: int, workers: int) -> BatchConfig:
    """The batch keys leave `ds` here; trainer/engine.py writes DeepSpeed's view of them back."""
    micro = args.micro_batch_size if args.micro_batch_size is not None else ds.get("train_micro_batch_size_per_gpu", 4)
    ds_accumulation = ds.pop("gradient_accumulation_steps", 1)
    ds.pop("train_micro_batch_size_per_gpu", None)
    ds.pop("train_batch_size", None)  # derived: micro x accumulation x D
    _at_least("micro batch size (train_micro_batch_size_per_gpu / --micro-batch-size)", micro, 1)
    if args.global_batch_size is not None:
        _at_least("global-batch-size", args.global_batch_size, 1)
        per_step = micro * data_parallel * workers
        if args.global_batch_size % per_step:
            raise ConfigError(f"global-batch-size {args.global_batch_size} is not divisible by micro-batch-size x D x K "
                              f"= {micro} x {data_parallel} x {workers}")
        accumulation = args.global_batch_size // per_step
    else:
        accumulation = ds_accumulation
    return BatchConfig(micro, accumulation, data_parallel, workers)
