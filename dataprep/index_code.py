"""Megatron's indexed_dataset module (its .idx writer and reader), reached at about the cost of torch alone.

Imported the ordinary way, `megatron.core.datasets.indexed_dataset` first runs `megatron/core/__init__.py`, which
imports the whole package (tensor parallelism, DDP, the Transformer Engine probes), and the module's own
`from megatron.core.utils import log_single_rank` imports torch.distributed's tensor machinery: ~3.4 CPU s, of which
`import torch` is ~1.1. The module itself needs torch, numpy, two small Megatron modules (msc_utils and
datasets.object_storage_utils) and that one logging helper, which Megatron defines in `megatron.core._rank_utils`
(megatron.core.utils re-exports it).

So the module is imported with Megatron's files unchanged under a `megatron.core` package whose `__init__` is not
run, `megatron.core._rank_utils` standing in for `megatron.core.utils`; then these modules leave sys.modules again, so
that a later `import megatron.core` in the process imports the real package, whole. Where that does not apply
(megatron.core already imported, which makes the ordinary import free; a Megatron version whose module needs more of
megatron.core than this gives it) the ordinary import runs instead: the same module, at the full cost.

No other thread of the process may import megatron.core while the shortcut runs (preprocessing's parent, which
imports it in a thread, imports no other Megatron code).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
import warnings
from types import ModuleType

INDEX_MODULE = "megatron.core.datasets.indexed_dataset"
PACKAGE = "megatron.core"
# A module the index code imports one helper from -> Megatron's module that defines the helper.
STAND_INS = {"megatron.core.utils": "megatron.core._rank_utils"}

_loading = threading.Lock()  # one import at a time: a second caller waits for the first's module


def load_index_code() -> ModuleType:
    """Megatron's indexed_dataset module, imported on first use; a process with a core to spare can call this ahead
    of writing or reading an .idx while others work."""
    with _loading:
        return _index_code()


@functools.cache
def _index_code() -> ModuleType:
    with warnings.catch_warnings():  # megatron.core warns about GPU kernels that .bin/.idx files never use
        warnings.simplefilter("ignore")
        return import_without_package_init() or importlib.import_module(INDEX_MODULE)


def import_without_package_init() -> ModuleType | None:
    """INDEX_MODULE imported without running megatron/core/__init__.py or megatron/core/utils.py, leaving no module of
    megatron.core in sys.modules; None where that does not apply (the caller imports it the ordinary way)."""
    if PACKAGE in sys.modules:
        return None
    before = set(sys.modules)
    try:
        spec = importlib.util.find_spec(PACKAGE)
        sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
        for name, stand_in in STAND_INS.items():
            sys.modules[name] = importlib.import_module(stand_in)
        module = importlib.import_module(INDEX_MODULE)
    except Exception:  # noqa: BLE001 - whatever went wrong, the ordinary import runs (and raises what is real)
        return None
    finally:
        for name in set(sys.modules) - before:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                del sys.modules[name]
    # A module bound as a whole (`import megatron.core.x`) would be looked up in the package at call time, where
    # these modules are gone: only the names it imported from them are certain to be the ones it runs.
    top = PACKAGE.partition(".")[0]
    if any(isinstance(value, ModuleType) and (value.__name__ + ".").startswith(top + ".")
           for value in vars(module).values()):
        return None
    return module
