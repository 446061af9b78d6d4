"""Every command the README names (and every installed command) answers `--help` and a mistyped flag before it
imports Megatron, transformers or DeepSpeed: each work imports what it needs when it needs it, so a tool starts at
once and each preprocessing process pays no import it does not use. Checked in the command's own process, by the
modules it imported (not with a clock)."""
from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("megatron", "transformers", "deepspeed")
# Whose flags are the trainer's own declarations, which stand on torch (the muloco and optimizer blocks).
NEEDS_TORCH_FOR_FLAGS = {"tools.plan", "trainer.pretrain", "tools.compare_methods"}
# Named by the README but not tools: a user's own DeepSpeed loop, made of deepspeed and transformers on purpose.
NOT_TOOLS = {"examples.deepspeed_muloco"}

# Runs the command twice in one process (`--help`, then a mistyped flag), as `python PATH`, `python -m MODULE` or
# the console script's `module:function` would, and prints what each run printed and what the process imported.
PROBE = """
import contextlib, importlib, io, json, runpy, sys
how, target = sys.argv[1], sys.argv[2]

def run(args):
    sys.argv = [target, *args]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if how == "path":
                runpy.run_path(target, run_name="__main__")
            elif how == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                module, function = target.split(":")
                getattr(importlib.import_module(module), function)()
        except SystemExit as exit_:
            code = exit_.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

runs = [run(["--help"]), run(["--no-such-flag"])]
print(json.dumps({"runs": runs, "imported": sorted({name.split(".")[0] for name in sys.modules})}))
"""


def readme_commands() -> dict[str, tuple[str, str]]:
    """Module name -> how the README runs it: ("path", "tools/x.py") or ("module", "pkg.mod")."""
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())  # commands in code blocks, comments and prose
    found = {}
    for module in re.findall(r"\bpython -m ([\w.]+)", text):
        found.setdefault(module, ("module", module))
    for path in re.findall(r"\b(?:python|deepspeed(?: --[\w-]+(?: \d+)?)*) ((?:[\w-]+/)+[\w-]+\.py)\b", text):
        found.setdefault(path.removesuffix(".py").replace("/", "."), ("path", path))
    return found


def console_scripts() -> dict[str, tuple[str, str]]:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    targets = [line.split("=", 1)[1].strip() for line in lines]
    return {target.split(":")[0].removesuffix(".__main__"): ("entry", target) for target in targets}


def commands() -> dict[str, tuple[str, str]]:
    """The README's commands as it writes them, and the installed ones it does not run."""
    named = {**console_scripts(), **readme_commands()}
    return {module: how for module, how in sorted(named.items()) if module not in NOT_TOOLS}


def test_the_readme_and_the_install_name_the_tools():
    """The parsing above finds what the README shows (a README rewrite that hides a tool fails here)."""
    assert {"tokenizer.train", "tools.preprocess_data", "tools.convert_checkpoint", "tools.generate", "tools.plan",
            "trainer.pretrain", "tools.compare_methods", "tools.build_demo_corpus", "muloco.diloco.auth",
            "muloco.elastic.lighthouse"} <= set(commands())
    assert readme_commands()["examples.deepspeed_muloco"] == ("path", "examples/deepspeed_muloco.py")


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Every command's probe, run side by side."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    running = {module: subprocess.Popen([sys.executable, "-c", PROBE, how, target], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for module, (how, target) in commands().items()}
    results = {}
    for module, process in running.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{module}: {err[-3000:]}"
        results[module] = json.loads(out.splitlines()[-1])
    return results


@pytest.mark.launch
@pytest.mark.parametrize("module", sorted(commands()))
def test_help_and_a_mistyped_flag_import_no_heavy_library(module: str, probes: dict[str, dict]):
    probe = probes[module]
    help_run, mistyped = probe["runs"]
    assert help_run["code"] == 0 and "usage:" in help_run["out"], help_run
    assert mistyped["code"] == 2 and "error:" in mistyped["err"], mistyped
    heavy = [name for name in HEAVY + (() if module in NEEDS_TORCH_FOR_FLAGS else ("torch",))
             if name in probe["imported"]]
    assert not heavy, f"{module} imports {heavy} before it parses its flags"
