"""Entry point: deepspeed [--num_gpus N] trainer/pretrain.py --ds_config ds_configs/X.json [flags]

Without a "muloco" block in the ds_config this is a plain data-parallel trainer (the baseline);
with one, each worker trains H inner steps and the workers sync compressed pseudogradients.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from trainer import comm  # noqa: E402
from trainer.config import build_parser, resolve  # noqa: E402
from trainer.data import check_data, check_model_vocabulary  # noqa: E402
from trainer.durable import check_output_folders  # noqa: E402
from trainer.errors import ConfigError, TopologyError  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.deterministic_mode:  # cuBLAS reads this when it starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The device first: NCCL binds each process to the accelerator current when it starts.
    comm.init_compute_device(int(os.environ.get("LOCAL_RANK", args.local_rank or 0)))
    comm.init_distributed(args.distributed_backend or comm.default_backend())
    try:  # every rank resolves the same config, so every rank stops here together, before any collective
        config = resolve(args, dist.get_world_size())
        check_data(config.data)
        check_model_vocabulary(config.data, config.model_vocab_size)
        check_output_folders(config)
    except (ConfigError, TopologyError, FileNotFoundError, ValueError) as err:
        if dist.get_rank() == 0:
            print(f"configuration error: {err}", file=sys.stderr, flush=True)
        comm.remove_host_allreduce_buffer()
        raise SystemExit(2)
    from trainer.run import run  # heavy imports only after the config is known to be good

    summary = run(config)
    comm.remove_host_allreduce_buffer()
    return summary


if __name__ == "__main__":
    main()
