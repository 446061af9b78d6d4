"""Data preparation per corpus and launches of the real trainer (`deepspeed --num_gpus K
trainer/pretrain.py`, one rank per worker, D = P = T = 1), each on its own free master port and,
where workers talk, with its own job secret beside its ds_config."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tools.compare.protocol import ARCH, MODEL, QUERY_GROUPS, REPO, VOCAB_SIZE, Method, RunSpec, Settings
from tools.trainer_runs import launcher_command
from trainer.checkpoint.format import sha256_of
from muloco.diloco.auth import write_new_key


@dataclass(frozen=True)
class Data:
    train: str  # indexed-dataset prefixes
    valid: str
    vocabulary: tuple[str, str]  # ("--tokenizer-model", path), or ("--vocab-size", n) for pre-tokenized data
    sha256: str  # of the files the trainer reads: a record's numbers hold for this data only

    def flags(self) -> list[str]:
        return ["--data-path", self.train, "--valid-data-path", self.valid, *self.vocabulary]


def files_sha256(root: Path, paths: list[Path]) -> str:
    """One digest of the files' names (relative to `root`, so not of where they lie) and contents."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.relative_to(root).as_posix()}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


def prepare_data(corpus: Path, work: Path) -> Data:
    """A tokenizer (vocab VOCAB_SIZE) trained on the corpus's train/ split and both splits tokenized
    under `work` (a corpus in Nemotron-CC form: DIR/train and DIR/valid), once per content of the
    corpus: `work/source.sha256`, written last, says what the files were prepared from, so a corpus
    that changed, or a preparation that was cut short, is prepared again from nothing."""
    splits = ("train", "valid")
    for split in splits:
        if not (corpus / split).is_dir():
            raise SystemExit(f"--corpus {corpus}: no {corpus / split} (in Nemotron-CC form: train/ and valid/)")
    source = files_sha256(corpus, sorted(p for split in splits for p in (corpus / split).rglob("*") if p.is_file()))
    tokenizer, stamp = work / "tok.model", work / "source.sha256"
    data_prefixes = {split: work / f"{split}_text_document" for split in splits}
    if not (stamp.exists() and stamp.read_text() == source):
        shutil.rmtree(work, ignore_errors=True)  # derived files only: made again below
        work.mkdir(parents=True)
        # Trained in `work` under a relative name: the model file holds its output prefix, and the digest
        # of the prepared data must not depend on where it was prepared.
        _check_call([sys.executable, "-m", "tokenizer.train", "--input", str(corpus / "train"), "--vocab-size",
                     str(VOCAB_SIZE), "--output-prefix", tokenizer.stem], cwd=work)
        for split, prefix in data_prefixes.items():
            _check_call([sys.executable, "tools/preprocess_data.py", "--input", str(corpus / split),
                         "--output-prefix", str(work / split), "--tokenizer-model", str(tokenizer), "--processes", "2"])
        stamp.write_text(source)
    read = [tokenizer, *(Path(f"{prefix}{suffix}") for prefix in data_prefixes.values() for suffix in (".bin", ".idx"))]
    return Data(str(data_prefixes["train"]), str(data_prefixes["valid"]), ("--tokenizer-model", str(tokenizer)),
                files_sha256(work, read))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _check_call(command: list[str], cwd: Path = REPO) -> None:
    subprocess.run(command, cwd=cwd, env=_env(), check=True, stdout=subprocess.DEVNULL)


class _Ports:
    """Free ports for concurrent launches, never the same one twice from this process (a port is
    free when asked for but only bound by the launcher later)."""

    def __init__(self):
        self._given: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            while True:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                if port not in self._given:
                    self._given.add(port)
                    return port


_PORTS = _Ports()
# Sequences per micro-batch: the per-worker batches of the alignment's batch sweep (up to 1,024 sequences
# in the K=1 reference) in one micro-batch would hold gigabytes of logits.
MAX_MICRO_BATCH = 64
SHARED_MEMORY = Path("/dev/shm")
_LIVE: set[int] = set()  # process groups of running launches, ended if the tool is interrupted


def end_live_launches() -> None:
    for pgid in list(_LIVE):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_shared_memory(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves one ~70 MB buffer per rank in /dev/shm, named by the master port."""
    for path in SHARED_MEMORY.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def run_config(method: Method, settings: Settings, outer_lr: float | None, outer_loop: bool = True,
               outer_momentum: float | None = None) -> dict:
    """The method's ds_config with this run's warm-up, sync interval and outer lr (and outer momentum,
    where given); without the outer loop (`outer_loop` False) it is the one-worker run of the same
    inner optimizer."""
    config = json.loads(json.dumps(method.config))
    config["scheduler"]["params"]["warmup_iters"] = settings.warmup
    if not outer_loop:
        config.pop("muloco", None)
    elif "muloco" in config:
        config["muloco"]["sync_interval"] = settings.sync_interval
        config["muloco"]["outer_lr"] = outer_lr
        if outer_momentum is not None:
            config["muloco"]["outer_momentum"] = outer_momentum
    return config


def trainer_flags(spec: RunSpec, settings: Settings, data: Data, workers: int, run_dir: Path,
                  eval_interval: int) -> list[str]:
    """The trainer's flags shared by a run and its alignment references: the same data, schedule and
    seed (the seed also fixes the data order), global batch B, B/K per worker in micro-batches of at
    most MAX_MICRO_BATCH."""
    per_worker = settings.global_batch // workers
    return ["--model", MODEL, "--arch", ARCH, "--num-query-groups", str(QUERY_GROUPS), *data.flags(), "--train-iters", str(settings.steps), "--lr", str(spec.inner_lr),
            "--global-batch-size", str(settings.global_batch),
            "--micro-batch-size", str(math.gcd(per_worker, MAX_MICRO_BATCH)), "--seed", str(spec.seed),
            "--eval-interval", str(eval_interval),
            "--eval-iters", str(settings.eval_batches * workers),  # E*K batches of B/K: E*B sequences
            "--log-interval", str(settings.sync_interval), "--run-dir", str(run_dir)]


def with_job_secret(config: dict, run_dir: Path) -> dict:
    """`config` with a fresh job secret in `run_dir` (beside the ds_config) when its workers talk: the
    trainer refuses unauthenticated workers, and each launch is its own job."""
    if config.get("muloco", {}).get("workers", 1) == 1:
        return config
    key = run_dir / "job.key"
    key.unlink(missing_ok=True)
    write_new_key(key)
    return {**config, "muloco": {**config["muloco"], "auth": {"key_file": key.name, "job_id": run_dir.name}}}


def launch(config: dict, flags: list[str], workers: int, run_dir: Path, timeout_s: int) -> None:
    """Run the trainer with `config` and `flags` on `workers` ranks; raise RuntimeError when it fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a half-finished earlier attempt
    ds_config = run_dir / "ds_config.json"
    ds_config.write_text(json.dumps(with_job_secret(config, run_dir), indent=2))
    port = _PORTS.take()
    command = [*launcher_command("deepspeed", workers, port), "trainer/pretrain.py", "--ds_config", str(ds_config),
               *flags]
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _LIVE.add(proc.pid)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks share this session
            proc.wait()
            code = f"timeout after {timeout_s} s"
        finally:
            _LIVE.discard(proc.pid)
            _remove_shared_memory(port)
    if code != 0 or not (run_dir / "summary.json").exists():
        raise RuntimeError(f"launch in {run_dir} failed ({code}); see {run_dir / 'log.txt'}")


@dataclass(frozen=True)
class Curves:
    val: list[list[float]]  # [step, val loss]
    sent: list[list[float]]  # [step, cumulative bytes sent per worker]
    worker_cosine: float | None


def read_curves(run_dir: Path, workers: int) -> Curves:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    syncs = [r for r in records if "outer_step" in r and r.get("skipped") is None]
    sent, curve = 0.0, []
    for r in syncs:
        sent += r["bytes_sent_per_rank"]  # one rank per worker here (D = P = T = 1)
        curve.append([r["step"], sent])
    cosines = [r["pseudograd_cosine"] for r in syncs]
    # K = 1 "averages" over one worker: the cosine is 1 by construction, not a measurement.
    return Curves(val, curve, statistics.fmean(cosines) if cosines and workers > 1 else None)
