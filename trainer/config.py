"""The run's configuration: command-line flags (Megatron's names) on top of the DeepSpeed JSON config.

Each flag that sets one setting is declared beside it (`setting(..., flag="--lr")`; trainer/flags.py
generates the parser). `resolve` reads the ds_config, writes the flags that set its values (`--lr`,
`--train-iters`, `--micro-batch-size`, ... : `DS_CONFIG_FLAGS`) into it at their fields' dotted
paths, loads it once into the typed `DsConfig` (trainer/ds_config.py; again after `--recipe` fills
what it leaves out), and builds
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

from muloco.diloco.auth import read_private_job_key, resolve_key_file
from muloco.diloco.config import MuLoCoConfig
from muloco.core.typed_json import read_json_object
from trainer.ds_config import DsConfig, load_ds_config
from muloco.diloco.elastic_config import check_addresses, check_worker_id
from muloco.core.errors import ConfigError
from trainer.flags import Flag, add_flags, declared_flags
from trainer.model.presets import PRESET_SIZES, PRESETS, ModelShape, preset_of
from trainer.model.stages import stage_layers
from trainer.optim.config import OptimizerConfig, OptimizerName, retyped
from trainer.recipe import fill_ds_config
from trainer.schedule import ScheduleConfig
from muloco.core.topology import ParallelSizes
from muloco.core.typed_json import ConfigBlock, ConfigProblems, Problem, set_path, setting


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
    data_path: tuple[str, ...] = setting((), flag="--data-path",
                                         doc="prefix, or weight prefix weight prefix ... (Megatron's blend)")
    valid_data_path: tuple[str, ...] = setting((), flag="--valid-data-path",
                                               doc="the validation blend (instead of --split's share)")
    split: str = setting("98,2,0", flag="--split", doc="train, validation and test shares of each --data-path prefix")
    tokenizer_model: str | None = setting(
        None, flag="--tokenizer-model", doc="SentencePiece .model, Hugging Face tokenizer.json or a folder holding one")
    vocab_size: int | None = setting(None, ge=1, flag="--vocab-size",
                                     doc="when no tokenizer model is given (tools/plan.py without one: the paper's, "
                                         "128256)")
    data_args_path: str | None = setting(None, flag="--data-args-path",
                                         doc="a file holding what --data-path takes (Megatron's flag)")
    per_split_data_args_path: str | None = setting(
        None, flag="--per-split-data-args-path", doc='a JSON file {"train": [...], "valid": [...]} of blends '
                                                     "(Megatron's flag)")


# kw_only: the settings with flags, and so defaults, stay beside their peers (and in config.json's order).
@dataclass(frozen=True, kw_only=True)
class RunConfig(ConfigBlock):
    model_preset: str
    model: ModelShape
    tensor_parallel: int = setting(1, ge=1, flag="--tensor-model-parallel-size", doc="T")
    pipeline_parallel: int = setting(1, ge=1, flag="--pipeline-model-parallel-size", doc="P")
    batch: BatchConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    clip_grad: float  # the global-norm clip (0: off)
    data: DataConfig
    run_dir: str = setting(flag="--run-dir", doc="config.json, metrics.jsonl, tensorboard/ (default: --save, "
                                                 "else runs/<ds_config name>)")
    tensorboard_dir: str = setting(flag="--tensorboard-dir", doc="(default: <run-dir>/tensorboard)")
    seed: int = setting(1234, ge=0, flag="--seed", doc="every rank's random state starts from it")
    log_interval: int = setting(10, ge=1, flag="--log-interval", doc="steps between progress lines and records")
    eval_interval: int = setting(50, ge=0, flag="--eval-interval", doc="steps between validations (0: none)")
    eval_iters: int = setting(4, ge=1, flag="--eval-iters", doc="batches per validation")
    save: str | None = setting(None, flag="--save", doc="the checkpoint folder")
    load: str | None = setting(None, flag="--load", doc="the checkpoint folder to resume (or start) from")
    load_worker: int | None = setting(
        None, ge=0, flag="--load-worker",
        doc="start (not resume) from worker W's weights, inner optimizer state and step in the --load checkpoint, "
            "which may have any number of workers K, with this run's lr, weight decay and schedule; its outer-loop "
            "state and RNG are not carried: with a muloco block a new outer loop starts at the loaded weights (e.g. "
            "one worker's H steps with the full global batch, K workers branching from a data-parallel checkpoint, "
            "or one datacenter carrying on alone)")
    load_worker_new_batch: bool = setting(
        False, flag="--load-worker-new-batch",
        doc="with --load-worker: start even where this run's global batch differs from the checkpoint's; the run "
            "then reads its own data stream from the loaded step x its batch instead of continuing the checkpoint "
            "run's (the alignment's per-worker-batch sweep branches from one state at several batches)")
    finetune: bool = setting(
        False, flag="--finetune",
        doc="load only the model's weights from --load (worker --load-worker, default 0, resharded to this layout, "
            "the same on every worker) and start at step 0 with a fresh optimizer, lr schedule, outer-loop state "
            "and RNG (Megatron's flag); a weights-only checkpoint (an import from Hugging Face) always loads this way")
    load_optim: bool = setting(True, flag="--no-load-optim",
                               doc="resume without the inner optimizer's state (fresh moments and momentum; the lr "
                                   "follows this run's schedule at the loaded step)")
    load_rng: bool = setting(True, flag="--no-load-rng", doc="resume without the RNG states (this run's --seed)")
    model_vocab_size: int | None = setting(None, ge=1, doc="the model's vocabulary before padding, from the checkpoint "
                                                           "(--use-checkpoint-args); None: the tokenizer's")
    save_interval: int | None = setting(None, ge=1, flag="--save-interval", doc="steps between checkpoints")
    keep_last: int = setting(3, ge=1, flag="--keep-last",
                             doc="keep the newest N checkpoints, latest and the one of the best validation loss")
    verify_checksums: bool = setting(True, flag="--no-verify-checksums",
                                     doc="skip checking rank files against meta.json's SHA-256 on --load (saves a "
                                         "read at scale)")
    async_save: bool = setting(
        False, flag="--async-save",
        doc="write checkpoints in the background: training waits only for a copy of each rank's state in host "
            "memory (pinned on an accelerator); `latest` moves once every rank's file is written, at the next step; "
            "at most one save in flight; the run's end waits for the last (trainer/checkpoint/async_save.py)")
    hang_timeout_s: float = setting(1800.0, ge=0, flag="--hang-timeout-s",
                                    doc="exit non-zero with a 'hang detected:' line when a step makes no progress for "
                                        "this long (0: off); must exceed the longest step, evaluation or save")
    startup_timeout_s: float | None = setting(
        None, gt=0, flag="--startup-timeout-s",
        doc="with the hang watchdog on, the same for start-up and resume (building the model, the data index, "
            "reading the checkpoint); default: 300 s plus 0.1 s per prefix and 1 s per 10 MB of the data's .bin "
            "files (trainer.data.startup_timeout_s)")
    exit_signal_handler: bool = setting(False, flag="--exit-signal-handler",
                                        doc="on SIGTERM finish the current step, save a checkpoint and exit 0 "
                                            "(needs --save)")
    exit_interval: int | None = setting(None, ge=1, flag="--exit-interval",
                                        doc="save and exit 0 after a step divisible by N")
    exit_duration_in_mins: float | None = setting(None, gt=0, flag="--exit-duration-in-mins",
                                                  doc="save and exit 0 after the first step that ends this many "
                                                      "minutes after training started")
    bf16: bool = False
    distributed_backend: Literal["nccl", "gloo"] | None = setting(
        None, flag="--distributed-backend",
        doc="the default process group's backend (default: the accelerator's, NCCL on GPUs); gloo lets several "
            "processes share one GPU when every intra-worker group has one rank")
    deterministic: bool = setting(False, flag="--deterministic-mode",
                                  doc="deterministic kernels (torch.use_deterministic_algorithms), for bit-exact "
                                      "resumes on GPUs")
    ds_config: dict[str, Any] = setting(factory=dict, doc="the keys DeepSpeed itself reads")
    muloco: MuLoCoConfig | None = None  # None: the data-parallel baseline
    auth_key_file: str | None = None  # the job secret's file when workers talk and auth is on (read at start)
    recipe_table: str | None = None  # what --recipe filled in, printed at start
    worker_id: int | None = setting(None, flag="--worker-id",
                                    doc="elastic MuLoCo (muloco.elastic): this launch is worker k, a world of "
                                        "D x P x T ranks")

    def problems(self) -> list[Problem]:
        problems = []
        stops = [f for f, on in (("--exit-signal-handler", self.exit_signal_handler),
                                 ("--exit-interval", self.exit_interval is not None),
                                 ("--exit-duration-in-mins", self.exit_duration_in_mins is not None)) if on]
        if stops and not self.save:
            problems.append(("", f"{' and '.join(stops)} save a checkpoint before exiting: give --save DIR"))
        if self.async_save and not self.save:
            problems.append(("--async-save", "needs --save DIR"))
        if self.load_worker_new_batch and self.load_worker is None:
            problems.append(("--load-worker-new-batch", "needs --load-worker W"))
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


# Every flag that sets one setting is declared beside it (trainer/flags.py): the run's own settings,
# the model's shape (over the preset's), and the ds_config's (written into its JSON at their paths).
RUN_FLAGS = declared_flags(RunConfig, nested=False)
DATA_FLAGS = declared_flags(DataConfig)
MODEL_FLAGS = declared_flags(ModelShape)
DS_CONFIG_FLAGS = declared_flags(DsConfig)


def add_ds_config_flag(parser, *, required: bool, help: str) -> None:
    """The ds_config's one flag, with DeepSpeed's spelling and the planner's former one as aliases."""
    parser.add_argument("--ds_config", "--deepspeed_config", "--ds-config", dest="ds_config", required=required,
                        help=help)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `--deepspeed` would otherwise be taken for `--deepspeed_config` and eat the next flag.
    p = argparse.ArgumentParser(description="MuLoCo pretraining on Megatron-core shards under DeepSpeed",
                                allow_abbrev=False)
    # The launcher's and meta flags: none sets one setting.
    add_ds_config_flag(p, required=True, help="DeepSpeed JSON config")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted from DeepSpeed's and Megatron-DeepSpeed's command lines and ignored: this trainer "
                        "always runs under DeepSpeed")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset (default: %(default)s)")
    p.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's architecture, shape and vocabulary, and without --tokenizer-model the "
                        "tokenizer saved with it, from the --load checkpoint (model flags given still win, e.g. "
                        "--seq-length), so a run from an imported model needs no shape or tokenizer flags")
    g = p.add_argument_group("model (override the preset)")
    add_flags(g, MODEL_FLAGS, override=True, where="default: the preset's")
    g.add_argument("--no-qk-layernorm", action="store_true", help="same as --arch llama")
    g = p.add_argument_group("ds_config (override its values)")
    add_flags(g, DS_CONFIG_FLAGS, override=True, where="ds_config {path}")
    add_global_batch_size(g)
    g.add_argument("--optimizer", choices=get_args(OptimizerName), default=None,
                   help="override the ds_config's optimizer type (params only the other type takes are dropped)")
    g.add_argument("--recipe", choices=["paper"], default=None,
                   help="fill what the ds_config leaves out with the paper's hyperparameter rules (trainer/recipe.py)")
    add_flags(p.add_argument_group("data"), DATA_FLAGS, override=False)
    add_flags(p.add_argument_group("run"), RUN_FLAGS, override=False)
    return p


def add_global_batch_size(group: argparse._ActionsContainer) -> None:
    """B: not one setting, it sets gradient_accumulation_steps from the micro-batch, D and K (also the planner's)."""
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="B, sequences per inner step over all workers (sets gradient_accumulation_steps)")


def with_flags(raw: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The ds_config JSON with the given flags written in, and {dotted path: flag} of what they set."""
    raw = json.loads(json.dumps(raw))  # the caller's object stays as read
    origins = {}
    if args.optimizer is not None:
        optimizer = raw.get("optimizer")
        raw["optimizer"] = retyped(optimizer if isinstance(optimizer, dict) else {}, args.optimizer)
        origins["optimizer.type"] = "--optimizer"
    for flag in DS_CONFIG_FLAGS:
        value = getattr(args, flag.field)
        if value is None:
            continue
        if flag.within is not None and not isinstance(_at(raw, flag.within), dict):
            raise ConfigError(f"{flag.name}: the ds_config has no {flag.within} block (a flag sets one of its "
                              "values, it does not add the block)")
        set_path(raw, flag.path, value)
        origins[flag.path] = flag.name
    return raw, origins


def _at(raw: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw


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
    try:
        data = DataConfig(**{**_given(args, DATA_FLAGS), "tokenizer_model": tokenizer_model})
        return RunConfig(**{
            **_given(args, RUN_FLAGS),  # then what the run derives, some of it from these flags
            "model_preset": args.model if checkpoint is None else f"of {args.load}", "model": shape,
            "tensor_parallel": sizes.tensor, "pipeline_parallel": sizes.pipeline, "batch": batch,
            "optimizer": ds.optimizer, "schedule": ds.scheduler.params, "clip_grad": ds.gradient_clipping,
            "data": data, "run_dir": run_dir,
            "tensorboard_dir": args.tensorboard_dir or str(Path(run_dir) / "tensorboard"),
            # Mixed precision is Megatron's autocast over fp32 parameters (the optimizers need whole fp32
            # tensors, not DeepSpeed's flattened bf16 partitions), so DeepSpeed never sees the bf16 block.
            "bf16": ds.bf16.enabled, "ds_config": ds.deepspeed_keys(), "muloco": ds.muloco,
            "auth_key_file": _job_secret_file(ds.muloco, Path(args.ds_config).parent), "recipe_table": recipe_table,
            "model_vocab_size": checkpoint.vocab_size if checkpoint else None})
    except ConfigProblems as err:  # a value a flag set: named by the flag
        raise ConfigProblems(err.problems, {f.field: f.name for f in [*RUN_FLAGS, *DATA_FLAGS]}) from err


def _given(args: argparse.Namespace, flags: list[Flag]) -> dict[str, Any]:
    """The flags' values by the field each sets."""
    return {f.field: getattr(args, f.field) for f in flags}


def _parallel_sizes(ds: DsConfig, args: argparse.Namespace, world_size: int) -> ParallelSizes:
    """K x D x P x T as the batch sees them: D from the world size (an elastic job's world is one of
    the K workers), checked against the layout the config was planned for."""
    workers = ds.muloco.workers if ds.muloco is not None else 1
    elastic = ds.muloco is not None and ds.muloco.elastic is not None
    check_worker_id(args.worker_id, workers, elastic)
    if elastic:
        check_addresses(ds.muloco.elastic, ds.muloco.outer_backend)
    sizes = ParallelSizes.from_world(world_size, 1 if elastic else workers, args.pipeline_parallel,
                                     args.tensor_parallel)
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
    given = {name: value for name, value in _given(args, MODEL_FLAGS).items() if value is not None}
    if args.no_qk_layernorm:
        given["arch"] = "llama"
    try:
        return (base or PRESETS[args.model]).with_overrides(**given)
    except ConfigProblems as err:
        raise ConfigProblems(err.problems, {f.field: f.name for f in MODEL_FLAGS if f.field in given}) from err


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
