"""MuLoCo: DiLoCo whose inner optimizer is Muon, as an outer loop that attaches to a DeepSpeed engine.

    import muloco
    workers = muloco.data_parallel_workers(K)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=workers.mpu)
    outer = muloco.attach(engine, ds_config["muloco"], workers, last_step=N)

The package holds the outer loop (diloco/, elastic/) and the ground floor it stands on (core/); the
Megatron trainer that also uses it is the `trainer` package of the full install. The names below are
imported on first use, so `import muloco` costs nothing.
"""
from __future__ import annotations

import importlib

_PUBLIC = {"attach": "muloco.hook.attach", "check": "muloco.hook.attach", "data_parallel_workers": "muloco.hook.workers",
           "Workers": "muloco.hook.workers", "ConfigError": "muloco.core.errors"}

__all__ = ["ConfigError", "Workers", "attach", "check", "data_parallel_workers"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'muloco' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
