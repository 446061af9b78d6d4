"""The installed commands (setup.cfg's console scripts): each names a `main` that parses its flags, and
the environment's install carries exactly the declared ones (scripts/venv.sh reinstalls when setup.cfg
changes). `trainer/pretrain.py --help` needs no launcher."""
from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, str]:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=")) for line in lines)


def test_the_user_facing_tools_are_commands():
    assert set(_declared()) == {"muloco-tokenizer", "muloco-preprocess", "muloco-convert", "muloco-generate",
                                "muloco-plan", "muloco-key", "muloco-lighthouse"}


@pytest.mark.parametrize("command", sorted(_declared()))
def test_each_command_parses_its_flags(command, capsys):
    module, function = _declared()[command].split(":")
    main = getattr(importlib.import_module(module), function)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_the_install_carries_the_declared_commands():
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
                 if ep.dist is not None and ep.dist.name == "muloco"}
    assert installed == _declared(), "reinstall: . scripts/venv.sh (or pip install -e .)"


@pytest.mark.launch
def test_pretrain_help_needs_no_launcher_and_no_sys_path_edit():
    """Run as the README writes it, from the checkout, with only the install making `trainer` importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "trainer/pretrain.py", "--help"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: pretrain.py" in result.stdout and "--tensor-model-parallel-size" in result.stdout
