"""The modules of scripts/ (a folder of scripts, not a package), loaded from their files for tests.
Loading registers each under its own name after loading the modules beside it that it imports, so that
gpu_check.py's `from device_runner import ...` finds its module as it does when run as a script."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    path = SCRIPTS / f"{name}.py"
    for node in ast.parse(path.read_text()).body:
        imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for module in imported:
            if (SCRIPTS / f"{module}.py").exists():
                load_script(module)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
