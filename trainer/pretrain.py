"""Entry point: deepspeed [--num_gpus N] trainer/pretrain.py --ds_config ds_configs/X.json [flags]

Without a "muloco" block in the ds_config this is a plain data-parallel trainer (the baseline);
with one, each worker trains H inner steps and the workers sync compressed pseudogradients.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from trainer.config import ConfigError, build_parser, resolve  # noqa: E402
from trainer.data import check_data  # noqa: E402
from trainer.durable import check_output_folders  # noqa: E402
from trainer.topology import TopologyError  # noqa: E402

COLLECTIVE_TIMEOUT = timedelta(minutes=int(os.environ.get("MULOCO_COLLECTIVE_TIMEOUT_MIN", "10")))


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=COLLECTIVE_TIMEOUT)
    try:  # every rank resolves the same config, so every rank stops here together, before any collective
        config = resolve(args, dist.get_world_size())
        check_data(config.data)
        check_output_folders(config)
    except (ConfigError, TopologyError, FileNotFoundError, ValueError) as err:
        if dist.get_rank() == 0:
            print(f"configuration error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    from trainer.run import run  # heavy imports only after the config is known to be good

    return run(config)


if __name__ == "__main__":
    main()
