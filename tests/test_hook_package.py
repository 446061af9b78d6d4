"""The DeepSpeed hook as a team's own loop meets it (muloco/): a public name that does not collide with
the team's packages and pulls in nothing of the Megatron trainer, an install whose base and `hook` extra
cover what it imports, `muloco.check` before `deepspeed.initialize`, and an uncaught hook error printed as
one line per job."""
from __future__ import annotations

import ast
import configparser
import json
import subprocess
import sys
from pathlib import Path

import pytest

import muloco
from muloco.core.errors import ConfigError
from muloco.diloco.auth import write_new_key

ROOT = Path(__file__).resolve().parents[1]
TRAINER_ONLY = {"megatron", "torchft", "transformers", "trainer", "dataprep", "tokenizer", "megatron_patches", "tools",
                "sentencepiece", "pyarrow", "tensorboard"}


def run_python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.launch
def test_importing_the_hook_pulls_in_nothing_of_the_trainer(tmp_path):
    """Run beside a team's own `trainer` package: `import muloco` still finds ours, and the hook's whole
    import tree holds none of the trainer's packages (so its install needs none of them)."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("raise ImportError('the team trainer, not ours')\n")
    code = ("import sys, muloco; muloco.attach, muloco.check, muloco.data_parallel_workers, muloco.Workers\n"
            "import muloco.hook.attach, muloco.assembly\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout.replace("'", '"'))) & TRAINER_ONLY == set()


def _requirements(cfg: configparser.ConfigParser, key: str, section: str = "options") -> set[str]:
    lines = cfg.get(section, key).strip().splitlines()
    return {line.strip().split("=")[0].split(">")[0].split("<")[0].replace("-", "_") for line in lines if line.strip()}


def test_the_base_install_and_the_hook_extras_cover_every_import_of_the_muloco_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    installed = (_requirements(cfg, "install_requires") | _requirements(cfg, "hook", "options.extras_require")
                 | _requirements(cfg, "elastic", "options.extras_require") | _requirements(cfg, "hf", "options.extras_require"))
    assert "megatron_core" not in installed and "torchft" not in _requirements(cfg, "install_requires")
    imported = set()
    for path in (ROOT / "muloco").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "muloco"}
    assert third_party <= installed, sorted(third_party - installed)


def key_in(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_new_key(folder / "job.key")
    return folder / "job.key"


def test_check_reads_the_key_file_relative_to_the_ds_configs_folder_as_documented(tmp_path, monkeypatch):
    key_in(tmp_path / "configs")
    ds_config = tmp_path / "configs" / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                     "muloco": {"workers": 2, "auth": {"key_file": "job.key"}}}))
    monkeypatch.chdir(tmp_path)  # not the ds_config's folder: before, the key was looked for here
    assert muloco.check(str(ds_config), world_size=4).workers == 2
    with pytest.raises(ConfigError, match="'job.key' is relative to the ds_config's folder: pass the ds_config's path"):
        muloco.check({"workers": 2, "auth": {"key_file": "job.key"}}, world_size=4)
    assert muloco.check({"workers": 2, "auth": {"key_file": "job.key"}}, 4, config_dir=tmp_path / "configs").workers == 2


@pytest.mark.parametrize("block, world, message", [
    ({"workers": 3, "auth": "none"}, 4, "world size 4 is not divisible by workers x pipeline x tensor = 3 x 1 x 1"),
    ({"workers": 2, "auth": "none", "sync_interval": 0}, 4, "sync_interval"),
    ({"workers": 2, "auth": "none", "elastic": {"lighthouse": "http://h:1"}}, 1, "needs worker_id in 0..1"),
    ({"workers": 2, "auth": {"key_file": "missing.key"}}, 4, "missing.key"),
])
def test_check_finds_a_config_problem_before_deepspeed_builds_anything(block, world, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        muloco.check(block, world, config_dir=tmp_path)


def test_a_ds_config_path_that_is_not_a_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="has no \"muloco\" block"):
        (tmp_path / "ds.json").write_text("{}")
        muloco.check(str(tmp_path / "ds.json"), 2)
    with pytest.raises(ConfigError, match="is not a regular file"):
        muloco.check(str(tmp_path), 2)


@pytest.mark.launch
def test_an_uncaught_hook_error_is_one_line_and_any_other_error_keeps_its_traceback():
    raising = ("from muloco.hook.reports import report_uncaught_in_one_line\n"
               "from muloco.core.errors import {kind}\n"
               "report_uncaught_in_one_line()\nraise {kind}('the message')\n")
    result = run_python(raising.format(kind="ConfigError"))
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == "muloco: configuration error: the message"
    assert "Traceback" not in result.stderr
    result = run_python(raising.format(kind="DisagreementError"))
    assert result.stderr.strip().splitlines()[-1] == "muloco: workers disagree: the message"
    result = run_python(raising.replace("from muloco.core.errors import {kind}\n", "").format(kind="KeyError"))
    assert "Traceback" in result.stderr and "KeyError: 'the message'" in result.stderr


@pytest.mark.launch
def test_a_message_every_rank_raises_is_printed_by_the_first_rank_that_reports_it(tmp_path):
    """The job's store (torch.distributed's) counts each message: the first rank to report it prints."""
    code = (f"import torch.distributed as dist\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
            f"from muloco.hook.reports import _first_to_report\n"
            f"print(_first_to_report('a'), _first_to_report('a'), _first_to_report('b'))\n")
    result = run_python(code)
    assert result.stdout.split() == ["True", "False", "True"], result.stderr
