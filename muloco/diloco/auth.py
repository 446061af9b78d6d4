"""The job secret, and the tags that authenticate every message between workers.

Workers meet over links the trainer does not own, so every outer message (payload buckets, the
headers that carry the skip vote and the payload claims, membership rows, sync metrics, the state a
rejoining worker receives) carries an HMAC-SHA256 tag. The tag covers the message's bytes and where
the message belongs, each field length-prefixed so no two messages can be read as each other:

    job id | channel | epoch | outer step | fragment | sequence number | sender | receiver | bytes

- job id: `muloco.auth.job_id`, so one secret used by two jobs cannot splice them;
- channel: which group carried it (the outer exchange, the sync metrics, the elastic quorum);
- epoch: the elastic quorum's id (0 in the single-world mode), so a message of an earlier quorum or
  attempt is not accepted in a later one;
- outer step and fragment: a replay of an earlier sync's message fails;
- sequence number: the message's place among the sync's collectives (every rank runs the same ones
  in the same order), so a message of one phase cannot stand for another;
- sender and receiver: the group ranks (receiver -1 for a message every rank receives).

A message whose tag does not verify is dropped and its sender left out of that sync, as a worker
with a non-finite pseudogradient is. What this does not give: secrecy (nothing is encrypted; the
traffic is readable on the wire) and protection from a member that holds the secret (its payloads
are checked by content instead, muloco/diloco/payload_checks.py).

The secret is a file of hex digits (at least 16 bytes of key), made once per job and copied to
every worker: `python -m muloco.diloco.auth new-key FILE`.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from muloco.core.errors import ConfigError
from muloco.core.typed_json import ConfigBlock, Problem, setting

if TYPE_CHECKING:
    import torch

KEY_FILE_ENV = "MULOCO_AUTH_KEY_FILE"  # the key file when the ds_config names none
TAG_BYTES = 32
MIN_KEY_BYTES = 16
NEW_KEY_BYTES = 32
EVERY_RANK = -1  # the receiver of a message that every rank of the group receives


@dataclass(frozen=True)
class AuthConfig(ConfigBlock):
    """The ds_config's `muloco.auth` block; `"auth": "none"` turns authentication off (logged as a
    warning)."""
    key_file: str = setting("", doc=f"the job secret's file, relative to the ds_config's folder (and inside it); "
                                    f"empty: ${KEY_FILE_ENV}")
    job_id: str = setting("muloco", doc="bound into every tag: jobs that share a secret cannot splice each other")

    def problems(self) -> list[Problem]:
        return [] if self.job_id else [("job_id", "must not be empty")]


@dataclass(frozen=True)
class Scope:
    """Where a message belongs (see the module docstring)."""
    channel: str
    epoch: int
    outer_step: int
    fragment: int


class JobKey:
    """The job's secret; computes and checks tags."""

    def __init__(self, secret: bytes, job_id: str):
        if len(secret) < MIN_KEY_BYTES:
            raise ConfigError(f"the job secret must hold at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = secret
        self.job_id = job_id

    def __repr__(self) -> str:  # never the secret
        return f"JobKey(job_id={self.job_id!r})"

    def mac(self, *fields: bytes | memoryview) -> bytes:
        """HMAC-SHA256 under the secret over the job id and `fields`, each length-prefixed."""
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for value in (self.job_id.encode(), *fields):
            mac.update(struct.pack("<Q", len(value)))
            mac.update(value)
        return mac.digest()

    def snapshot_tag(self) -> str:
        """What the outer-state snapshots of this job carry (hex): equal for the same secret and job id,
        and telling nothing of the secret."""
        return self.mac(b"outer-loop snapshot").hex()

    def tag(self, scope: Scope, sequence: int, sender: int, receiver: int, data: torch.Tensor | bytes) -> bytes:
        place = struct.pack("<qqqqqq", scope.epoch, scope.outer_step, scope.fragment, sequence, sender, receiver)
        return self.mac(scope.channel.encode(), place, _host_bytes(data))

    def verify(self, tag: bytes, scope: Scope, sequence: int, sender: int, receiver: int,
               data: torch.Tensor | bytes) -> bool:
        return hmac.compare_digest(tag, self.tag(scope, sequence, sender, receiver, data))


def _host_bytes(data: torch.Tensor | bytes) -> memoryview | bytes:
    """The bytes of a uint8 tensor (copied to the host only when it lives on an accelerator)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    import torch  # here, not above: `python -m muloco.diloco.auth new-key` needs no torch

    host = data.detach().reshape(-1).view(torch.uint8).cpu()
    return memoryview(host.contiguous().numpy()) if host.numel() else b""


def resolve_key_file(auth: AuthConfig, config_dir: Path) -> Path:
    """The key file's path: the ds_config's key_file, which must stay inside the config's folder, or
    $MULOCO_AUTH_KEY_FILE. Raises ConfigError naming what is missing or wrong."""
    if auth.key_file:
        base = config_dir.resolve()
        path = (base / auth.key_file).resolve()
        if not path.is_relative_to(base):
            raise ConfigError(f"muloco.auth.key_file {auth.key_file!r} leaves the ds_config's folder {base}: keep the "
                              f"key beside the config, or point ${KEY_FILE_ENV} at it")
        return path
    from_env = os.environ.get(KEY_FILE_ENV, "")
    if not from_env:
        raise ConfigError(f"workers exchange pseudogradients, so the job needs a secret: set muloco.auth.key_file or "
                          f"${KEY_FILE_ENV} (make one with `python -m muloco.diloco.auth new-key FILE`), or write "
                          f'"auth": "none" to send them unauthenticated')
    return Path(from_env)


def read_job_key(path: Path, job_id: str) -> JobKey:
    """The secret in `path` (hex digits); one ConfigError line for a missing, unreadable or short key."""
    try:
        text = path.read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read the job secret {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"the job secret {path} must hold hex digits") from None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"the job secret {path} must hold hex digits (make one with "
                          f"`python -m muloco.diloco.auth new-key FILE`)") from None
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(f"the job secret {path} holds {len(secret)} bytes; at least {MIN_KEY_BYTES} are needed")
    return JobKey(secret, job_id)


def read_private_job_key(path: Path, job_id: str) -> JobKey:
    """The secret in `path`; one ConfigError line for a bad one, or one that group or others may access
    (a secret others on the machine can read is no secret: anyone who copies it can join the quorum
    and send weights, so the run and the lighthouse refuse it rather than warn)."""
    key = read_job_key(path, job_id)
    if not key_file_is_private(path):
        mode = stat.S_IMODE(path.stat().st_mode)
        raise ConfigError(f"the job secret {path} has mode {mode:04o}, so other users may read it: chmod 600 {path}")
    return key


def job_key(path: Path | None, job_id: str, talks: bool, warn: bool) -> JobKey | None:
    """The job secret that tags the outer messages, from its resolved file (None: the workers do not
    talk, or auth is off, which `warn` says once)."""
    if path is None:
        if talks and warn:
            print('WARNING: muloco.auth is "none": messages between workers are not authenticated, so anyone who '
                  "reaches the outer link can change the weights", flush=True)
        return None
    return read_private_job_key(path, job_id)


def key_file_is_private(path: Path) -> bool:
    """Whether only its owner can read the key file (the run warns otherwise)."""
    return not path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO)


def write_new_key(path: Path) -> None:
    """A fresh random secret, readable by its owner only; refuses to overwrite a file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(NEW_KEY_BYTES) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="the job secret of a MuLoCo run")
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new-key", help="write a fresh secret to FILE (mode 0600); copy it to every worker")
    new.add_argument("file", type=Path)
    args = p.parse_args(argv)
    try:
        write_new_key(args.file)
    except FileExistsError:
        sys.exit(f"{args.file} exists: a job secret is never overwritten")
    print(f"wrote a {NEW_KEY_BYTES}-byte job secret to {args.file}")


if __name__ == "__main__":
    main()
