"""Entry point: deepspeed [--num_gpus N] trainer/pretrain.py --ds_config ds_configs/X.json [flags]

Without a "muloco" block in the ds_config this is a plain data-parallel trainer (the baseline);
with one, each worker trains H inner steps and the workers sync compressed pseudogradients.
"""
from __future__ import annotations

import os
import sys
from contextlib import nullcontext


import torch.distributed as dist

from muloco.core import comm
from trainer.config import RunConfig, build_parser, check_environment, resolve
from muloco.diloco.wire import CollectiveError
from trainer.checkpoint.format import checkpoint_args
from muloco.core.durable import check_output_folders
from muloco.core.errors import ConfigError, TopologyError
from trainer.failures import stop_together
from trainer.folder_lock import JobLocks
from trainer.file_limit import check_open_file_limit, raise_open_file_limit
from trainer.parent_watch import ParentWatch, launched
from trainer.threads import apply_thread_default

# What a bad setting, size, file or folder raises while the config is checked.
STARTUP_ERRORS = (ConfigError, TopologyError, FileNotFoundError, ValueError)


def checked_config(args, world_size: int) -> RunConfig:
    """The run's config with everything checked that can be before any collective: values and sizes,
    what they ask of this machine, the data and tokenizer, the output folders. Every rank checks the
    same things, so every rank stops here together."""
    from trainer.data import check_data, check_model_vocabulary, index_cache_dir, refuse_unsafe_index_cache, run_blends

    config = resolve(args, world_size, checkpoint_args(args.load) if args.use_checkpoint_args else None)
    check_environment(config, comm.compute_device().type)
    check_data(config.data)
    check_model_vocabulary(config.data, config.model_vocab_size)
    check_output_folders(config)
    refuse_unsafe_index_cache(index_cache_dir(config.run_dir))
    blends = run_blends(config.data, config.model.seq_length)  # a split no prefix can feed would loop in Megatron
    check_open_file_limit(len({*blends.train[0], *(blends.valid[0] if blends.valid else ())}))
    return config


def _stop(line: str, rank: int) -> None:
    """End this rank with exit status 2; rank 0 prints the one line (every rank stops the same way)."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None, trainer_class=None) -> dict:
    """`trainer_class`: a trainer.training.Trainer subclass whose loop replaces the usual one, in a run
    assembled and checked exactly as here (tools/compare/simulated_workers.py)."""
    args = build_parser().parse_args(argv)
    has_launcher = launched()
    if not has_launcher and comm.one_rank_without_launcher():
        print("no launcher: running as one process (world size 1); for more, "
              "`deepspeed --num_gpus N trainer/pretrain.py ...`", flush=True)
    with ParentWatch() if has_launcher else nullcontext():
        return _main(args, trainer_class)


def _main(args, trainer_class) -> dict:
    threads = apply_thread_default()  # before any work: the ranks on a host share its cores
    raised = raise_open_file_limit()  # a blend of thousands of prefixes reads more files than ulimit -n's 1024
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(threads.line, flush=True)
        if raised:
            print(raised, flush=True)
        if args.deepspeed:
            print("note: --deepspeed is ignored (this trainer always runs under DeepSpeed)", flush=True)
    if args.deterministic:  # cuBLAS reads this when it starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The device first: NCCL binds each process to the accelerator current when it starts.
    comm.init_compute_device(int(os.environ.get("LOCAL_RANK", args.local_rank or 0)))
    if args.distributed_backend == "nccl" and comm.compute_device().type == "cpu":
        _stop("configuration error: --distributed-backend nccl needs an accelerator: use gloo on CPU",
              int(os.environ.get("RANK", "0")))
    try:
        comm.init_distributed(args.distributed_backend or comm.default_backend())
    except ConfigError as err:
        _stop(f"configuration error: {err}", int(os.environ.get("RANK", "0")))
    try:
        config = checked_config(args, dist.get_world_size())
    except STARTUP_ERRORS as err:
        _stop(f"configuration error: {err}", dist.get_rank())
    locks = JobLocks([("--run-dir", config.run_dir), ("--save", config.save)])
    problem = locks.acquire() if dist.get_rank() == 0 else None
    stop_together(f"configuration error: {problem}" if problem else None, "lock the run's folders")
    try:
        from trainer.run import run  # heavy imports only after the config is known to be good
        from trainer.training import Trainer

        summary = run(config, trainer_class or Trainer)
    except CollectiveError as err:  # the outer group cannot go on: no quorum in time, every attempt of a sync failed
        print(f"stopping: rank {dist.get_rank()}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        locks.release()
    comm.close_distributed()
    return summary


if __name__ == "__main__":
    main()
