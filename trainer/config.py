"""The run's configuration: command-line flags (Megatron's names) on top of the DeepSpeed JSON config.

`resolve` reads the ds_config, writes the flags that set its values (`--lr`, `--train-iters`,
`--micro-batch-size`, ... : `DS_CONFIG_FLAGS`) into it as dotted overrides, loads it once into the
typed `DsConfig` (trainer/ds_config.py; again after `--recipe` fills what it leaves out), and builds
the frozen `RunConfig` the run uses and writes to `config.json`. Every value is checked before any
collective: a bad one raises `ConfigError`, printed by the entry point as one `configuration error:`
line naming every problem (a flag by its name, a ds_config value by its dotted path).

Batch semantics (the paper's): the global batch B, in sequences per inner step, is split over the
K workers. The ds_config's `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` are
per rank, as DeepSpeed sees them, and DeepSpeed only sees one worker (trainer/engine.py tells it
the per-worker batch B/K = micro x accumulation x D). `--global-batch-size` (Megatron's flag) is B.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from trainer.diloco.auth import read_private_job_key, resolve_key_file
from trainer.diloco.config import MuLoCoConfig
from trainer.ds_config import DsConfig, load_ds_config, read_json_object
from trainer.elastic.config import check_worker_id
from trainer.errors import ConfigError
from trainer.model.presets import ARCHITECTURES, PRESET_SIZES, PRESETS, ModelShape, preset_of
from trainer.model.stages import stage_layers
from trainer.optim.config import OptimizerConfig, OptimizerName, retyped
from trainer.recipe import fill_ds_config
from trainer.schedule import ScheduleConfig
from trainer.topology import ParallelSizes
from trainer.typed_json import ConfigBlock, ConfigProblems, Problem, field_default, set_path, setting


@dataclass(frozen=True)
class BatchConfig(ConfigBlock):
    micro_batch_size: int = setting(ge=1)
    gradient_accumulation_steps: int = setting(ge=1)
    data_parallel: int = setting(1, ge=1, doc="D, derived from the world size")
    workers: int = setting(1, ge=1, doc="K")

    @property
    def per_worker(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel

    @property
    def global_batch(self) -> int:
        return self.per_worker * self.workers


@dataclass(frozen=True)
class DataConfig(ConfigBlock):
    data_path: tuple[str, ...] = ()  # Megatron blend: (prefix,) or (w1, p1, w2, p2, ...)
    valid_data_path: tuple[str, ...] = ()
    split: str = "98,2,0"
    tokenizer_model: str | None = None
    vocab_size: int | None = setting(None, ge=1, flag="--vocab-size")
    data_args_path: str | None = None  # a file holding the train blend (trainer/data.py reads it)
    per_split_data_args_path: str | None = None  # a JSON file of train and valid blends


@dataclass(frozen=True)
class RunConfig(ConfigBlock):
    model_preset: str
    model: ModelShape
    tensor_parallel: int
    pipeline_parallel: int
    batch: BatchConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    clip_grad: float  # the global-norm clip (0: off)
    data: DataConfig
    run_dir: str
    tensorboard_dir: str
    seed: int = setting(1234, ge=0, flag="--seed")
    log_interval: int = setting(10, ge=1, flag="--log-interval")
    eval_interval: int = setting(50, ge=0, flag="--eval-interval", doc="0: no evaluation")
    eval_iters: int = setting(4, ge=1, flag="--eval-iters")
    save: str | None = None
    load: str | None = None
    load_worker: int | None = setting(None, ge=0, flag="--load-worker",
                                      doc="start from this worker's state in --load (any K; no outer state)")
    finetune: bool = False  # --load takes the weights only: step 0, fresh optimizer, schedule, outer state, RNG
    load_optim: bool = True  # False (--no-load-optim): a resume keeps this run's fresh inner optimizer state
    load_rng: bool = True  # False (--no-load-rng): a resume keeps this run's fresh seeds
    model_vocab_size: int | None = setting(None, ge=1, doc="the model's vocabulary before padding, from the checkpoint "
                                                           "(--use-checkpoint-args); None: the tokenizer's")
    save_interval: int | None = setting(None, ge=1, flag="--save-interval")
    keep_last: int = setting(3, ge=1, flag="--keep-last",
                             doc="the newest N checkpoints stay, and always latest and the best validation loss")
    verify_checksums: bool = True
    async_save: bool = setting(False, flag="--async-save",
                               doc="write checkpoints in the background from a host copy (trainer/checkpoint/async_save.py)")
    hang_timeout_s: float = setting(1800.0, ge=0, flag="--hang-timeout-s", doc="0: no hang watchdog")
    startup_timeout_s: float | None = setting(None, gt=0, flag="--startup-timeout-s",
                                              doc="the watchdog's limit for start-up and resume (with the hang "
                                                  "watchdog on); None: in proportion to the data "
                                                  "(trainer.data.startup_timeout_s)")
    exit_signal_handler: bool = False  # SIGTERM: finish the step, save, exit 0
    exit_interval: int | None = setting(None, ge=1, flag="--exit-interval")
    exit_duration_in_mins: float | None = setting(None, gt=0, flag="--exit-duration-in-mins")
    bf16: bool = False
    distributed_backend: Literal["nccl", "gloo"] | None = None  # None: the accelerator's
    deterministic: bool = False
    ds_config: dict[str, Any] = setting(factory=dict, doc="the keys DeepSpeed itself reads")
    muloco: MuLoCoConfig | None = None  # None: the data-parallel baseline
    auth_key_file: str | None = None  # the job secret's file when workers talk and auth is on (read at start)
    recipe_table: str | None = None  # what --recipe filled in, printed at start
    worker_id: int | None = None  # elastic workers (muloco.elastic): this job's worker k; the world is one worker

    def problems(self) -> list[Problem]:
        problems = []
        stops = [f for f, on in (("--exit-signal-handler", self.exit_signal_handler),
                                 ("--exit-interval", self.exit_interval is not None),
                                 ("--exit-duration-in-mins", self.exit_duration_in_mins is not None)) if on]
        if stops and not self.save:
            problems.append(("", f"{' and '.join(stops)} save a checkpoint before exiting: give --save DIR"))
        if self.async_save and not self.save:
            problems.append(("--async-save", "needs --save DIR"))
        for flag, given in (("--load-worker", self.load_worker is not None), ("--finetune", self.finetune),
                            ("--no-load-optim", not self.load_optim), ("--no-load-rng", not self.load_rng)):
            if given and not self.load:
                problems.append((flag, "needs --load DIR"))
        if self.muloco is not None and self.muloco.pace.paced:
            problems += self._paced_problems(self.muloco.sync_interval)
        return problems

    def _paced_problems(self, interval: int) -> list[Problem]:
        """Wall-clock pacing: workers take different numbers of inner steps between syncs (a slow one
        jumps to the sync's step), so whatever every worker must do at one step happens at sync steps."""
        problems = [(flag, f"({value}) must be a multiple of muloco.sync_interval ({interval}) with muloco.pace.mode "
                           "'wall_clock': a worker that ends an interval early skips the steps before the sync")
                    for flag, value in (("--save-interval", self.save_interval), ("--exit-interval", self.exit_interval))
                    if value is not None and value % interval]
        problems += [(flag, "is not supported with muloco.pace.mode 'wall_clock' yet: its all-reduce after every inner "
                            "step needs every worker to take the same steps")
                     for flag, on in (("--exit-signal-handler", self.exit_signal_handler),
                                      ("--exit-duration-in-mins", self.exit_duration_in_mins is not None)) if on]
        return problems

    @property
    def elastic(self) -> bool:
        return self.muloco is not None and self.muloco.elastic is not None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--deepspeed` would otherwise be taken for `--deepspeed_config` and eat the next flag.
    p = argparse.ArgumentParser(description="MuLoCo pretraining on Megatron-core shards under DeepSpeed",
                                allow_abbrev=False)
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted from DeepSpeed's and Megatron-DeepSpeed's command lines and ignored: this trainer "
                        "always runs under DeepSpeed")
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
    g.add_argument("--emulate-slowdown", type=float, nargs="+", default=None, metavar="F",
                   help="one factor per worker: each worker sleeps after every inner step so it takes F times as long "
                        "(muloco.emulate_slowdown; tests and benchmarks of unequal workers)")
    g.add_argument("--no-final-sync", dest="final_sync", action="store_const", const=False, default=None,
                   help="end the run without the last outer sync (muloco.final_sync false): its last checkpoint then "
                        "holds K models (export takes the global weights, or --worker k)")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[], help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--valid-data-path", nargs="+", default=[])
    g.add_argument("--data-args-path", default=None, help="a file holding what --data-path takes (Megatron's flag)")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='a JSON file {"train": [...], "valid": [...]} of blends (Megatron\'s flag)')
    g.add_argument("--split", default=field_default(DataConfig, "split"))
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
    g.add_argument("--optimizer", choices=get_args(OptimizerName), default=None,
                   help="override the ds_config's optimizer type (params only the other type takes are dropped)")
    g.add_argument("--recipe", choices=["paper"], default=None,
                   help="fill what the ds_config leaves out with the paper's hyperparameter rules (trainer/recipe.py)")
    g.add_argument("--seed", type=int, default=field_default(RunConfig, "seed"))
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms), for bit-exact resumes on GPUs")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--run-dir", default=None, help="config.json, metrics.jsonl, tensorboard/ (default: --save, "
                   "else runs/<ds_config name>)")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-interval", type=int, default=field_default(RunConfig, "log_interval"))
    g.add_argument("--eval-interval", type=int, default=field_default(RunConfig, "eval_interval"))
    g.add_argument("--eval-iters", type=int, default=field_default(RunConfig, "eval_iters"))
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--load-worker", type=int, default=None, metavar="W",
                   help="start (not resume) from worker W's weights, inner optimizer state and step in the --load "
                        "checkpoint, which may have any number of workers K, with this run's lr, weight decay and "
                        "schedule; its outer-loop state and RNG are not carried: with a muloco block a new outer "
                        "loop starts at the loaded weights (e.g. one worker's H steps with the full global batch, "
                        "K workers branching from a data-parallel checkpoint, or one datacenter carrying on alone)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model's weights from --load (worker --load-worker, default 0, resharded to this "
                        "layout, the same on every worker) and start at step 0 with a fresh optimizer, lr schedule, "
                        "outer-loop state and RNG (Megatron's flag); a weights-only checkpoint (an import from Hugging "
                        "Face) always loads this way")
    g.add_argument("--no-load-optim", dest="load_optim", action="store_false",
                   help="resume without the inner optimizer's state (fresh moments and momentum; the lr follows this "
                        "run's schedule at the loaded step)")
    g.add_argument("--no-load-rng", dest="load_rng", action="store_false",
                   help="resume without the RNG states (this run's --seed)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's architecture, shape and vocabulary, and without --tokenizer-model the "
                        "tokenizer saved with it, from the --load checkpoint (model flags given still win, e.g. "
                        "--seq-length), so a run from an imported model needs no shape or tokenizer flags")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--keep-last", type=int, default=field_default(RunConfig, "keep_last"),
                   help="keep the newest N checkpoints, latest and the one of the best validation loss "
                        f"(default {field_default(RunConfig, 'keep_last')})")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: training waits only for a copy of each rank's state "
                        "in host memory (pinned on an accelerator); `latest` moves once every rank's file is "
                        "written, at the next step; at most one save in flight; the run's end waits for the last")
    g.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="skip checking rank files against meta.json's SHA-256 on --load (saves a read at scale)")
    g = p.add_argument_group("faults and preemption")
    g.add_argument("--hang-timeout-s", type=float, default=field_default(RunConfig, "hang_timeout_s"),
                   help="exit non-zero with a 'hang detected:' line when a step makes no progress for this long "
                        "(0: off); must exceed the longest step, evaluation or checkpoint save")
    g.add_argument("--startup-timeout-s", type=float, default=field_default(RunConfig, "startup_timeout_s"),
                   help="with the hang watchdog on, the same for start-up and resume (building the model, the "
                        "data index, reading the checkpoint); default: 300 s plus 1 s per 10 MB of the data's "
                        ".bin files")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM finish the current step, save a checkpoint and exit 0 (needs --save)")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit 0 after a step divisible by N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 after the first step that ends this many minutes after training started")
    return p


# The flags that set ds_config values: flag destination -> dotted path (written into the JSON
# before it is loaded, so a flag's value is checked like the config's, and named by the flag).
DS_CONFIG_FLAGS = {
    "lr": "optimizer.params.lr", "weight_decay": "optimizer.params.weight_decay",
    "train_iters": "scheduler.params.train_iters", "lr_warmup_iters": "scheduler.params.warmup_iters",
    "min_lr_ratio": "scheduler.params.min_lr_ratio", "clip_grad": "gradient_clipping",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
}
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "kv_channels", "seq_length")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def with_flags(raw: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The ds_config JSON with the given flags written in, and {dotted path: flag} of what they set."""
    raw = json.loads(json.dumps(raw))  # the caller's object stays as read
    origins = {}
    if args.optimizer is not None:
        optimizer = raw.get("optimizer")
        raw["optimizer"] = retyped(optimizer if isinstance(optimizer, dict) else {}, args.optimizer)
        origins["optimizer.type"] = "--optimizer"
    for dest, path in DS_CONFIG_FLAGS.items():
        if getattr(args, dest) is not None:
            set_path(raw, path, getattr(args, dest))
            origins[path] = _flag(dest)
    # Settings of the muloco block only: a flag must not create one.
    for key, flag in (("final_sync", "--no-final-sync"), ("emulate_slowdown", "--emulate-slowdown")):
        if getattr(args, key) is None:
            continue
        if not isinstance(raw.get("muloco"), dict):
            raise ConfigError(f"{flag}: the ds_config has no muloco block (a data-parallel run has no outer syncs)")
        raw["muloco"][key] = getattr(args, key)
        origins[f"muloco.{key}"] = flag
    return raw, origins


@dataclass(frozen=True)
class CheckpointArgs:
    """What --use-checkpoint-args takes from the --load checkpoint (trainer.checkpoint.format reads it)."""
    model: ModelShape
    vocab_size: int  # the model's rows before padding
    tokenizer_model: str | None  # the tokenizer file saved with it


def resolve(args: argparse.Namespace, world_size: int, checkpoint: CheckpointArgs | None = None) -> RunConfig:
    """Read the ds_config, write the flags into it, load it (again once --recipe has filled it), and
    check it against the world and the model."""
    raw, origins = with_flags(read_json_object(args.ds_config), args)
    ds = load_ds_config(raw, origins)
    if args.use_checkpoint_args and checkpoint is None:  # trainer.checkpoint.format.checkpoint_args reads it
        raise ConfigError("--use-checkpoint-args: the --load checkpoint was not read")
    preset, run_model = _preset(args, checkpoint)
    ds.check_model(preset, run_model)
    sizes = _parallel_sizes(ds, args, world_size)
    shape = model_shape(args, checkpoint.model if checkpoint else None)
    saved_tokenizer = checkpoint.tokenizer_model if checkpoint else None
    tokenizer_model = args.tokenizer_model or (saved_tokenizer if args.vocab_size is None else None)
    check_model_shape(shape, sizes.tensor, sizes.pipeline)
    batch = BatchConfig(ds.train_micro_batch_size_per_gpu,
                        _accumulation(ds, args.global_batch_size, sizes.data, sizes.workers), sizes.data, sizes.workers)
    recipe_table = None
    if args.recipe is not None:  # fills what the ds_config (and the flags) leave out
        if preset is None:
            raise ConfigError(f"--recipe {args.recipe} has rules for the presets only, and the model is {run_model}")
        recipe_table = fill_ds_config(raw, ds, preset, batch.global_batch, set(origins))
        ds = load_ds_config(raw, origins)
    # Without --run-dir the logs go beside the checkpoints they describe (else runs/<ds_config name>).
    run_dir = args.run_dir or args.save or str(Path("runs") / Path(args.ds_config).stem)
    return RunConfig(
        model_preset=args.model if checkpoint is None else f"of {args.load}", model=shape,
        tensor_parallel=sizes.tensor, pipeline_parallel=sizes.pipeline,
        batch=batch, optimizer=ds.optimizer, schedule=ds.scheduler.params, clip_grad=ds.gradient_clipping,
        data=DataConfig(tuple(args.data_path), tuple(args.valid_data_path), args.split, tokenizer_model,
                        args.vocab_size, args.data_args_path, args.per_split_data_args_path),
        run_dir=run_dir, tensorboard_dir=args.tensorboard_dir or str(Path(run_dir) / "tensorboard"),
        # Mixed precision is Megatron's autocast over fp32 parameters (the optimizers need whole fp32
        # tensors, not DeepSpeed's flattened bf16 partitions), so DeepSpeed never sees the bf16 block.
        bf16=ds.bf16.enabled, ds_config=ds.deepspeed_keys(), muloco=ds.muloco,
        auth_key_file=_job_secret_file(ds.muloco, Path(args.ds_config).parent), recipe_table=recipe_table,
        model_vocab_size=checkpoint.vocab_size if checkpoint else None,
        **{name: getattr(args, name) for name in RUN_FLAGS}, deterministic=args.deterministic_mode)


# RunConfig fields set by the flag of the same name.
RUN_FLAGS = ("seed", "log_interval", "eval_interval", "eval_iters", "save", "load", "load_worker", "finetune",
             "load_optim", "load_rng", "save_interval", "keep_last", "verify_checksums", "async_save", "hang_timeout_s",
             "startup_timeout_s", "exit_signal_handler", "exit_interval",
             "exit_duration_in_mins", "distributed_backend", "worker_id")


def _parallel_sizes(ds: DsConfig, args: argparse.Namespace, world_size: int) -> ParallelSizes:
    """K x D x P x T as the batch sees them: D from the world size (an elastic job's world is one of
    the K workers), checked against the layout the config was planned for."""
    workers = ds.muloco.workers if ds.muloco is not None else 1
    elastic = ds.muloco is not None and ds.muloco.elastic is not None
    check_worker_id(args.worker_id, workers, elastic)
    sizes = ParallelSizes.from_world(world_size, 1 if elastic else workers, args.pipeline_model_parallel_size,
                                     args.tensor_model_parallel_size)
    if ds.layout is not None and (wrong := ds.layout.mismatches(sizes.tensor, sizes.pipeline, sizes.data)):
        raise ConfigError("the ds_config was planned for another layout: " + "; ".join(wrong)
                          + " (set --tensor-model-parallel-size/--pipeline-model-parallel-size and the world size "
                          "to match, or re-plan with tools/plan.py and edit its layout block)")
    return replace(sizes, workers=workers)


def _job_secret_file(muloco: MuLoCoConfig | None, config_dir: Path) -> str | None:
    """The job secret's file when workers talk and auth is on; a missing or bad secret stops the run
    here, with one line."""
    if muloco is None or not muloco.talks or muloco.auth == "none":
        return None
    path = resolve_key_file(muloco.auth, config_dir)
    read_private_job_key(path, muloco.auth.job_id)
    return str(path)


def check_environment(config: RunConfig, device_type: str) -> None:
    """What the config asks of this machine and environment, checked where the run starts (tools that
    plan a GPU run on a laptop resolve configs too): bf16 and NCCL need an accelerator, an elastic worker
    its lighthouse's address."""
    problems = []
    if device_type == "cpu":
        if config.bf16:
            problems.append("bf16.enabled needs an accelerator: on CPU remove the bf16 block (training runs in fp32)")
        if config.muloco is not None and config.muloco.outer_backend == "nccl":
            problems.append("muloco.outer_backend 'nccl' needs an accelerator: use 'gloo' on the host")
    if config.elastic:
        try:
            config.muloco.elastic.lighthouse_address()
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("; ".join(problems))


def _preset(args: argparse.Namespace, checkpoint: CheckpointArgs | None) -> tuple[str | None, str]:
    """The run's model preset (None if its model is none) and how an error names that model: with
    --use-checkpoint-args the model is the checkpoint's, whatever --model says."""
    if checkpoint is None:
        return args.model, args.model
    preset = preset_of(checkpoint.model)
    sizes = ", ".join(f"{f} {getattr(checkpoint.model, f)}" for f in PRESET_SIZES)
    return preset, (f"the --load checkpoint's model (--use-checkpoint-args), which is "
                    f"{f'preset {preset}' if preset else 'no preset'} ({sizes})")


def model_shape(args: argparse.Namespace, base: ModelShape | None = None) -> ModelShape:
    """The preset (or `base`, the checkpoint's shape) with the model flags given (each checked like the
    preset's own values): a flag given wins over the checkpoint, as in Megatron's --use-checkpoint-args."""
    given = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    arch = "llama" if args.no_qk_layernorm else args.arch
    try:
        return (base or PRESETS[args.model]).with_overrides(**given, arch=arch)
    except ConfigProblems as err:
        raise ConfigProblems(err.problems, {name: _flag(name) for name in [*given, "arch"]}) from err


def _accumulation(ds: DsConfig, global_batch: int | None, data_parallel: int, workers: int) -> int:
    """Micro-batches per rank per step: the ds_config's, or B / (micro x D x K) for --global-batch-size B."""
    if global_batch is None:
        return ds.gradient_accumulation_steps
    micro = ds.train_micro_batch_size_per_gpu
    per_step = micro * data_parallel * workers
    if global_batch < 1 or global_batch % per_step:
        raise ConfigError(f"--global-batch-size {global_batch} is not a positive multiple of micro-batch-size x D x K "
                          f"= {micro} x {data_parallel} x {workers}")
    return global_batch // per_step


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
