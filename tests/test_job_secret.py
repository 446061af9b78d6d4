"""The job secret (muloco.auth, muloco/diloco/auth.py): required whenever workers talk, read and
checked before any collective, confined to the ds_config's folder, never overwritten."""
from __future__ import annotations

import json
import stat

import pytest

from trainer.config import build_parser, resolve
from muloco.diloco.auth import KEY_FILE_ENV, main as auth_main, read_job_key
from muloco.core.errors import ConfigError


def resolved(tmp_path, muloco: dict, world: int = 2):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "muloco": {"workers": 2, **muloco}}))
    return resolve(build_parser().parse_args(["--ds_config", str(config), "--data-path", "x"]), world)


def test_workers_that_talk_need_the_secret_or_an_explicit_none(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf'muloco.auth.key_file or \${KEY_FILE_ENV}.*"auth": "none"'):
        resolved(tmp_path, {})
    assert resolved(tmp_path, {"auth": "none"}).auth_key_file is None
    # One worker alone sends nothing: no secret needed.
    config = tmp_path / "k1.json"
    config.write_text(json.dumps({"muloco": {"workers": 1}}))
    assert resolve(build_parser().parse_args(["--ds_config", str(config), "--data-path", "x"]), 1).auth_key_file is None


def test_the_key_file_comes_from_the_config_folder_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    auth_main(["new-key", str(tmp_path / "job.key")])
    assert resolved(tmp_path, {"auth": {"key_file": "job.key"}}).auth_key_file == str((tmp_path / "job.key").resolve())
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "job.key"))
    assert resolved(tmp_path, {}).auth_key_file == str(tmp_path / "job.key")


@pytest.mark.parametrize("key_file, content, message", [
    ("../outside.key", "00" * 32, "leaves the ds_config's folder"),
    ("/etc/hostname", None, "leaves the ds_config's folder"),
    ("missing.key", None, "cannot read the job secret"),
    ("short.key", "00" * 8, "holds 8 bytes; at least 16"),
    ("text.key", "not hex at all", "must hold hex digits"),
])
def test_a_bad_secret_is_one_config_error(tmp_path, key_file, content, message):
    if content is not None:
        (tmp_path / key_file).write_text(content)
    with pytest.raises(ConfigError, match=message):
        resolved(tmp_path, {"auth": {"key_file": key_file}})


def test_a_secret_others_may_read_is_refused_by_the_run_and_the_lighthouse(tmp_path, monkeypatch):
    from muloco.elastic.lighthouse import main as lighthouse_main

    auth_main(["new-key", str(tmp_path / "job.key")])
    (tmp_path / "job.key").chmod(0o644)
    line = rf"the job secret {tmp_path / 'job.key'} has mode 0644, so other users may read it: chmod 600 "
    with pytest.raises(ConfigError, match=f"^{line}"):
        resolved(tmp_path, {"auth": {"key_file": "job.key"}})
    with pytest.raises(SystemExit, match=f"^configuration error: {line}"):
        lighthouse_main(["--bind", "127.0.0.1:0", "--key-file", str(tmp_path / "job.key")])
    (tmp_path / "job.key").chmod(0o600)
    assert resolved(tmp_path, {"auth": {"key_file": "job.key"}}).auth_key_file


def test_a_bad_auth_block_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="muloco.auth"):
        resolved(tmp_path, {"auth": "off"})
    with pytest.raises(ConfigError, match=r"^muloco\.auth\.keyfile is not a known key: did you mean key_file\?$"):
        resolved(tmp_path, {"auth": {"keyfile": "x"}})


def test_new_key_is_private_random_and_never_overwritten(tmp_path):
    path = tmp_path / "job.key"
    auth_main(["new-key", str(path)])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    with pytest.raises(SystemExit, match="never overwritten"):
        auth_main(["new-key", str(path)])
    assert path.read_text() == first
    other = tmp_path / "other.key"
    auth_main(["new-key", str(other)])
    assert other.read_text() != first
    assert "secret" not in repr(read_job_key(path, "j")) and first.strip() not in repr(read_job_key(path, "j"))
