"""The outer loop attached to a DeepSpeed engine, in a few lines of a user's loop:

    workers = muloco.data_parallel_workers(K)               # after init_distributed, before initialize
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=workers.mpu, ...)
    outer = muloco.attach(engine, "ds_config.json", workers, last_step=N)   # or the "muloco" block itself
    for batch in loader:                                    # the loop, unchanged
        loss = engine(**batch).loss; engine.backward(loss); engine.step()
    outer.detach()                                          # syncs in flight land; the membership is left

Checkpoints: `outer.save_checkpoint(DIR)` saves DeepSpeed's files and this rank's outer state into
DIR/worker_<k>/ (the K workers' files never meet), `outer.load_checkpoint(DIR)` loads both and checks
that every worker resumed at the same step with the same global weights; `outer.save(folder)` /
`outer.load(folder)` handle the outer state alone, beside a checkpoint saved some other way.

The hook point. DeepSpeed (0.19) has no hook after an engine step: the inner optimizer's
`register_step_post_hook` runs once per ZeRO parameter group, before DeepSpeed copies its fp32
master partitions into the model's weights, and on stage 0 before the lr schedule steps. So `attach`
wraps this engine's `step` (an attribute of the instance: other engines and the class are
untouched, and `detach` removes it): after a `step()` that moved `engine.global_steps` (an optimizer
step, applied or skipped by DeepSpeed's overflow check: every worker counts it alike; micro-steps inside
gradient accumulation do not move it), the outer loop runs `after_inner_step(engine.global_steps)`.

The position of the run is `engine.global_steps`: a worker that catches up from its peers (the elastic
mode), or that ends an interval at its deadline (`muloco.pace`, wall-clock pacing), moves it and the
lr schedule; a loop that draws its data by step should read it there, and with pacing loop
`while engine.global_steps < last_step` (a slow worker takes fewer steps than the others).

Guards, each one line before harm (hook/reports.py): a config problem before `deepspeed.initialize`
when the loop calls `muloco.check` first; workers that start from different weights (or, with
`start="worker0"`, every worker takes worker 0's); DeepSpeed's own training dataloader, which would read
the same samples on every worker, sharded across the K x D readers; a step past `last_step`; a step
counter moved outside `engine.step()` (a DeepSpeed checkpoint loaded without the outer state); workers
at different steps or with different global weights at a resume and at every sync.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.distributed as dist

from muloco.assembly import assemble_outer_loop
from muloco.core import comm
from muloco.core.durable import write_text_durably
from muloco.core.errors import CheckpointError, ConfigError
from muloco.core.topology import ParallelSizes
from muloco.core.typed_json import load, read_json_object
from muloco.diloco.agreement import check_resumed
from muloco.diloco.auth import read_private_job_key, resolve_key_file
from muloco.diloco.config import MuLoCoConfig
from muloco.diloco.elastic_config import check_addresses
from muloco.diloco.outer_loop import OuterLoop
from muloco.diloco.outer_state import digest_of
from muloco.diloco.snapshot import CHECKPOINT, read_rank_snapshot, save_rank_snapshot, snapshot_file
from muloco.hook.data import shard_across_workers
from muloco.hook.engine_host import EngineHost
from muloco.hook.engine_shards import engine_tensors, refusal
from muloco.hook.reports import report_uncaught_in_one_line
from muloco.hook.workers import Workers

ATTACHED = "_muloco_outer_loop"  # the engine attribute that marks an engine the outer loop is attached to
_LATEST_BYTES = 4096  # DeepSpeed's `latest` file holds a tag


class MuLoCoHook:
    """The outer loop attached to one engine (made by `attach`)."""

    def __init__(self, engine, loop: OuterLoop, host: EngineHost):
        self.engine, self.loop = engine, loop
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(loop.attached(host))
        self._seen = engine.global_steps  # the last step the outer loop was told of
        inner_step = engine.step

        def step(*args, **kwargs):
            last = host.last_step
            if last is not None and engine.global_steps >= last:
                raise ConfigError(f"a step after step {last}, the last_step given to attach: the run has ended "
                                  f"(its final sync is done); attach with the run's real last step")
            if engine.global_steps != self._seen:
                raise ConfigError(f"engine.global_steps moved from {self._seen} to {engine.global_steps} outside "
                                  f"engine.step(): load checkpoints with outer.load_checkpoint (or outer.load after "
                                  f"engine.load_checkpoint), so the outer state moves with them")
            result = inner_step(*args, **kwargs)
            if engine.global_steps == self._seen + 1:
                loop.after_inner_step(engine.global_steps)
            self._seen = engine.global_steps  # (a member that caught up, or pacing, moved it)
            return result

        engine.step = step
        setattr(engine, ATTACHED, self)

    def __enter__(self) -> MuLoCoHook:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.detach()
        else:  # a failed loop: leave without finishing the syncs in flight (its peers may be gone)
            self._release()
            self._stack.__exit__(kind, error, traceback)

    def detach(self) -> None:
        """Let the syncs in flight land (not applied: the run is over), log their metrics, leave the
        membership and give the engine its own `step` back."""
        self._release()
        self._stack.close()

    def _release(self) -> None:
        if getattr(self.engine, ATTACHED, None) is self:
            del self.engine.step
            delattr(self.engine, ATTACHED)

    @property
    def outer_step(self) -> int:
        return self.loop.state.outer_step

    def global_weights_sha256(self) -> str:
        """sha256 over the global weights of this rank's (p, t) shard in its worker (the D data-parallel
        ranks' checksums of their own, in rank order; at T = P = 1 the worker's whole model): equal on two
        workers iff they hold that shard bit-identical. Every rank of the worker calls it."""
        mine = torch.frombuffer(bytearray(bytes.fromhex(self.loop.state.checksum())), dtype=torch.uint8)
        group = self.loop.topology.inner_dp_group
        worker = torch.empty(mine.numel() * self.loop.topology.sizes.data, dtype=torch.uint8,
                             device=comm.group_device(group))
        comm.all_gather_into_tensor(worker, mine, group=group)
        return hashlib.sha256(worker.cpu().numpy().tobytes()).hexdigest()

    # -- checkpoints -------------------------------------------------------------------------------

    def worker_folder(self, directory: str | Path) -> Path:
        """Where this worker's files go in a checkpoint folder the K workers share."""
        return Path(directory) / f"worker_{self.loop.topology.coords.worker}"

    def save(self, folder: str | Path) -> Path:
        """This rank's outer state (global weights, momentum, error feedback, the syncs in flight, the step
        and who wrote it) into FOLDER/muloco_outer/, checksummed and durable; every rank calls it. Save it
        in the folder of the DeepSpeed checkpoint of the same step (outer.save_checkpoint does both)."""
        return save_rank_snapshot(folder, self.loop.snapshot(CHECKPOINT))

    def load(self, folder: str | Path) -> None:
        """This rank's outer state from FOLDER (after engine.load_checkpoint restored the engine to the
        same step); every rank calls it. Refused with one line: a missing or damaged file, another
        worker's, rank's, plan's or job's state, another step's; then the workers check they all resumed
        at the same step with the same global weights, and the syncs that were in flight run again."""
        rank = self.loop.topology.rank
        self.loop.finish()  # (a load mid-run) the syncs in flight land first: their wires are needed
        snapshot = self.loop.read_snapshot(read_rank_snapshot(folder, rank), CHECKPOINT,
                                           f"snapshot {snapshot_file(folder, rank)}")
        check_resumed(self.loop, snapshot.outer_step, snapshot.step, digest_of(snapshot.global_weights.values()))
        self.loop.load_snapshot(snapshot)
        self._seen = self.engine.global_steps

    def save_checkpoint(self, directory: str | Path, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, **kwargs):
        """engine.save_checkpoint into DIRECTORY/worker_<k>/ and this rank's outer state beside it, in the
        tag's folder; then each worker's `latest` names the tag (DeepSpeed writes it on global rank 0
        alone, so for worker 0 alone). Every rank calls it; DeepSpeed's keyword arguments pass through."""
        folder = self.worker_folder(directory)
        tag = tag or f"global_step{self.engine.global_steps}"
        self.save(folder / tag)
        saved = self.engine.save_checkpoint(str(folder), tag=tag, client_state=client_state or {}, save_latest=False,
                                            **kwargs)  # ends with a barrier: every rank's files are written
        if save_latest and self.loop.topology.rank % self.loop.topology.sizes.ranks_per_worker == 0:
            write_text_durably(folder / "latest", tag)
        return saved

    def load_checkpoint(self, directory: str | Path, tag: str | None = None, **kwargs):
        """The inverse of save_checkpoint: DeepSpeed's files (DeepSpeed's keyword arguments pass through),
        then the outer state of the same tag; returns engine.load_checkpoint's (path, client_state)."""
        folder = self.worker_folder(directory)
        tag = tag or _latest_tag(folder)
        path, client_state = self.engine.load_checkpoint(str(folder), tag=tag, **kwargs)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint {tag!r} in {folder}")
        self.load(folder / tag)
        return path, client_state


def _latest_tag(folder: Path) -> str:
    latest = folder / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{folder} holds no checkpoint (no regular file {latest}): was it saved with "
                              f"outer.save_checkpoint, and with this worker count?")
    with open(latest, "rb") as f:
        tag = f.read(_LATEST_BYTES).decode(errors="replace").strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"{latest} does not name a checkpoint tag")
    return tag


def _print_record(record: dict, step: int) -> None:
    print("outer " + json.dumps(record, default=str), flush=True)


def _muloco_block(config: MuLoCoConfig | dict | str | Path, config_dir: str | Path | None
                  ) -> tuple[MuLoCoConfig, Path | None]:
    """The typed `muloco` block and the folder its relative paths start from (the ds_config's)."""
    if isinstance(config, (str, Path)):
        raw = read_json_object(config)
        if "muloco" not in raw:
            raise ConfigError(f"ds_config {config} has no \"muloco\" block")
        return load(MuLoCoConfig, raw["muloco"], "muloco"), Path(config).parent
    block = config if isinstance(config, MuLoCoConfig) else load(MuLoCoConfig, config, "muloco")
    return block, None if config_dir is None else Path(config_dir)


def _key_file(config: MuLoCoConfig, config_dir: Path | None) -> Path | None:
    """The job secret's file, checked (readable, private, long enough); None when there is none."""
    if not config.talks or config.auth == "none":
        return None
    if config.auth.key_file and not Path(config.auth.key_file).is_absolute() and config_dir is None:
        raise ConfigError(f"muloco.auth.key_file {config.auth.key_file!r} is relative to the ds_config's folder: pass "
                          f"the ds_config's path to attach (attach(engine, 'path/ds_config.json', ...)) or config_dir=")
    path = resolve_key_file(config.auth, config_dir or Path("."))
    read_private_job_key(path, config.auth.job_id)
    return path


def _check_elastic_worker(config: MuLoCoConfig, worker_id) -> None:
    """An elastic worker's id, and the addresses its peers on other hosts would dial."""
    if config.elastic is None:
        return
    if not (isinstance(worker_id, int) and 0 <= worker_id < config.workers):
        raise ConfigError(f"an elastic worker needs worker_id in 0..{config.workers - 1}, got {worker_id!r}")
    check_addresses(config.elastic, config.outer_backend)


def check(config: MuLoCoConfig | dict | str | Path, world_size: int | None = None, *, worker_id: int | None = None,
          config_dir: str | Path | None = None) -> MuLoCoConfig:
    """The ds_config's `muloco` block (a dict, or the ds_config's path), checked before anything is built:
    its settings, the world's split into K workers (`world_size`, default torch.distributed's), an
    elastic job's worker id and the job secret. Returns it typed; one ConfigError line per problem."""
    report_uncaught_in_one_line()
    block, folder = _muloco_block(config, config_dir)
    if world_size is None and dist.is_initialized():
        world_size = dist.get_world_size()
    if world_size is not None and block.elastic is None:
        ParallelSizes.from_world(world_size, block.workers, 1, 1)
    _check_elastic_worker(block, worker_id)
    _key_file(block, folder)
    return block


def attach(engine, config: MuLoCoConfig | dict | str | Path, workers: Workers, *, worker_id: int | None = None,
           last_step: int | None = None, config_dir: str | Path | None = None,
           start: Literal["check", "worker0"] = "check",
           log: Callable[[dict, int], None] | None = None) -> MuLoCoHook:
    """The outer loop on `engine` (see the module docstring). `config`: the ds_config's path, or its
    "muloco" block (a dict, or a MuLoCoConfig) with `config_dir`, the folder the block's relative paths
    start from (the job secret's key_file). With an `elastic` block each worker is a job of its own
    (`data_parallel_workers(1)`) that says which worker it is (`worker_id`). `last_step`: the run's last
    inner step, when known: no quorum is asked for past it, after it the final sync (`final_sync`)
    leaves every worker holding the global weights, and a step past it is refused; without it the
    workers end with their own. `start`: "check" refuses workers whose weights differ at the start,
    "worker0" makes every worker take worker 0's. `log(record, step)` receives each sync's record on the
    logging rank (default: printed as one JSON line). Every problem is one ConfigError line, before any
    collective of the outer loop."""
    report_uncaught_in_one_line()
    config, folder = _muloco_block(config, config_dir)
    topology = workers.topology
    if getattr(engine, ATTACHED, None) is not None:
        raise ConfigError("the outer loop is already attached to this engine (attach once; detach() first)")
    if start not in ("check", "worker0"):
        raise ConfigError(f"start must be 'check' or 'worker0', got {start!r}")
    expected = 1 if config.elastic is not None else config.workers
    if topology.sizes.workers != expected:
        raise ConfigError(f"the world was split into {topology.sizes.workers} workers (data_parallel_workers), but "
                          + ("an elastic job is one worker" if config.elastic is not None
                             else f"muloco.workers is {config.workers}"))
    _check_elastic_worker(config, worker_id)
    why_not = refusal(engine)
    if why_not:
        raise ConfigError(why_not)
    key_file = _key_file(config, folder)
    data_parallel = sorted(dist.get_process_group_ranks(engine.data_parallel_group))
    worker = workers.data_parallel_ranks  # this rank's shard in its worker
    if data_parallel != worker:
        raise ConfigError(f"DeepSpeed's data-parallel group is ranks {data_parallel}, not this worker's {worker}: "
                          f"pass mpu=workers.mpu to deepspeed.initialize so its all-reduce stays inside one worker")
    if config.elastic is not None:
        topology = replace(topology, coords=replace(topology.coords, worker=worker_id))
    D, c = topology.sizes.data, topology.coords
    if shard_across_workers(engine, config.workers * D, c.worker * D + c.data, D) and topology.is_logging_rank:
        print(f"outer loop: DeepSpeed's training dataloader reads 1/{config.workers * D} of the dataset on each rank "
              f"(K={config.workers} workers x D={D} ranks), not 1/{D}", flush=True)
    tensors, replicated = engine_tensors(engine, config.streaming.fragments)
    host = EngineHost(engine, last_step)
    loop = assemble_outer_loop(config, tensors, topology, log or _print_record, key_file=key_file,
                               step=engine.global_steps, replicated=replicated, worker_id=worker_id,
                               take_worker_zeros=start == "worker0", weights_written=host.weights_written)
    return MuLoCoHook(engine, loop, host)
