"""Saving at the configured steps (a trainer step hook) and resuming at start-up, with the layout
checks and resharding described in trainer/checkpoint/__init__.py."""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state as mps
from megatron.core.pipeline_parallel import get_forward_backward_func

import trainer.checkpoint.state as rank_state
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import load_tokenizer, tokenizer_file
from muloco.core import comm
from trainer.checkpoint.async_save import BackgroundWrite, SaveInFlight
from muloco.core.errors import CheckpointError
from trainer.checkpoint.format import (COMPLETE, CheckpointMeta, CheckpointReader, iteration_dir,
                                       latest_iteration, prune, publish, rank_file, remove_incomplete)
from muloco.core.rank_file import to_plain, write_rank_file
from trainer.checkpoint.schema import check_rank_state, check_weight, checked_rank_state, own_form
from trainer.config import RunConfig
from muloco.core.durable import write_durably, write_text_durably
from trainer.failures import stop_together
from trainer.metrics import METRICS_FILE, validation_losses
from trainer.model.builder import assign_full_weights, canonical_names
from trainer.model.sharding import sharding_of, shard
from trainer.model.presets import ModelShape
from muloco.core.topology import ParallelSizes, Topology, coordinates

PROBE_LENGTH = 32
# Of the largest recorded logit. The probe is an fp32 forward (_full_precision): the same weights give it
# again within rounding (~1e-6), weights changed after saving (two same-shaped tensors swapped) do not.
PROBE_RELATIVE_TOLERANCE = 1e-4
DIGEST_BYTES = 32  # SHA-256
# Test hook: "STEP:RANK" makes that rank die after writing its temporary file, before publishing it.
CRASH_ENV = "MULOCO_CKPT_CRASH_AT"
# Test hook: "STEP:RANK:ERRNO" makes that rank's write fail with that OSError (a full or read-only disk).
FAIL_ENV = "MULOCO_CKPT_FAIL_AT"


def _errno(error: OSError) -> int:
    return error.errno or errno.EIO


def probe_tokens(vocab_size: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


@contextmanager
def _full_precision(config):
    """fp32 compute and fp32 activations between pipeline stages, whatever the run trains in: the
    probe is a reference for an fp32 model (the export's verify), and bf16 autocast alone moves the
    150m model's logits by ~0.06. Megatron reads both fields at every forward."""
    saved = config.enable_autocast, config.pipeline_dtype
    config.enable_autocast, config.pipeline_dtype = False, torch.float32
    try:
        yield
    finally:
        config.enable_autocast, config.pipeline_dtype = saved


@torch.no_grad()
def probe_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """fp32 logits of the (pipeline- and tensor-parallel) training model on `tokens`: this rank's
    vocab slice on the last stage, None elsewhere. Every rank of the worker must call it."""
    tokens = comm.to_compute_device(tokens)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)

    def forward_step(data_iterator, module):
        logits = module(tokens, positions, None)
        return logits, lambda out: (torch.zeros((), device=out.device), {"logits": out.detach().clone()})

    was_training = model.training
    model.eval()
    with _full_precision(model.config):
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True)
    model.train(was_training)
    return outputs[0]["logits"] if mps.is_pipeline_last_stage() else None


def probe_problem(model: torch.nn.Module, reader: CheckpointReader, worker: int, seq_length: int) -> str | None:
    """Why the weights now in `model` do not give the probe logits worker `worker` of `reader` recorded
    when it saved (None: they do, or nothing comparable was recorded). Each last-stage rank compares its
    vocabulary slice, whatever the checkpoint's layout. Every rank of the worker must call it (the probe
    is a forward pass); no generator of the run moves."""
    vocab_size = reader.meta.vocab_size
    tokens = probe_tokens(vocab_size, min(PROBE_LENGTH, seq_length))
    rng = rank_state.capture_rng()
    logits = probe_logits(model, tokens)
    rank_state.restore_rng(rng)
    if logits is None:
        return None
    last = reader.meta.sizes.pipeline - 1
    recorded = [reader.rank_state(rank).get("probe") for rank in reader.stage_ranks(worker, 0, last)]
    if any(probe is None or not torch.equal(probe["tokens"], tokens) for probe in recorded):
        return None  # saved without a probe, or with other tokens (another --seq-length)
    full = torch.cat([probe["logits"] for probe in recorded], dim=-1)  # vocabulary-parallel slices, in order
    start = mps.get_tensor_model_parallel_rank() * logits.shape[-1]
    stop = min(start + logits.shape[-1], vocab_size, full.shape[-1])  # the padding rows are no one's vocabulary
    if stop <= start:
        return None
    ours, theirs = logits[..., :stop - start].float().cpu(), full[..., start:stop].float()
    difference = (ours - theirs).abs().max().item()
    tolerance = PROBE_RELATIVE_TOLERANCE * max(1.0, theirs.abs().max().item())
    if difference <= tolerance:
        return None
    return (f"{reader.directory}: the weights of worker {worker} give logits up to {difference:.3g} away from the "
            f"probe recorded when they were saved (tolerance {tolerance:.3g}): tensors were changed after saving "
            "(swapped or edited, their checksums recomputed)")


def check_fits(meta: CheckpointMeta, sizes: ParallelSizes, model: ModelShape, padded_vocab_size: int,
               global_batch: int, extra_state: list[str]) -> bool:
    """Raise on what cannot be resumed; return whether the layout must be resharded."""
    if meta.sizes.workers != sizes.workers:
        raise CheckpointError(f"checkpoint has K={meta.sizes.workers} workers, this run K={sizes.workers}; "
                              "the number of workers cannot change on resume (--load-worker starts a run "
                              "from one worker's state)")
    _check_model_and_stream(meta, model, padded_vocab_size, global_batch)
    if list(meta.extra_state) != extra_state:
        raise CheckpointError(f"checkpoint holds state for {meta.extra_state or 'no extra components'}, "
                              f"this run has {extra_state or 'none'} (MuLoCo on one side only?)")
    dims = [(n, getattr(meta.sizes, a), getattr(sizes, a)) for n, a in (("D", "data"), ("P", "pipeline"), ("T", "tensor"))
            if getattr(meta.sizes, a) != getattr(sizes, a)]
    if dims and meta.extra_state:
        theirs = " ".join(f"{n}={old}" for n, old, _ in dims)
        ours = " ".join(f"{n}={new}" for n, _, new in dims)
        raise CheckpointError(f"checkpoint has {theirs}, this run {ours}: the state of {meta.extra_state} is sharded "
                              f"by (d, p, t) and cannot be resharded; resume with the checkpoint's layout "
                              f"({meta.describe_layout()})")
    return bool(dims)


def check_worker_start(meta: CheckpointMeta, worker: int, model: ModelShape, padded_vocab_size: int,
                       global_batch: int | None) -> None:
    """Raise unless this run can start from worker `worker` of the checkpoint (--load-worker): any K and
    sharding, the same model, vocabulary and global batch (so the data stream continues; `global_batch`
    None: any, --load-worker-new-batch)."""
    if not 0 <= worker < meta.sizes.workers:
        raise CheckpointError(f"--load-worker {worker}: the checkpoint has workers 0..{meta.sizes.workers - 1}")
    if global_batch is None:
        _check_model(meta, model, padded_vocab_size)
    else:
        _check_model_and_stream(meta, model, padded_vocab_size, global_batch)


# What loading weights alone may change: the training length (RoPE has no learned positions) and the
# initializer's std (unused when the weights come from the checkpoint).
NOT_IN_WEIGHTS = ("seq_length", "init_std")


def check_weights_start(meta: CheckpointMeta, worker: int, model: ModelShape, padded_vocab_size: int) -> None:
    """Raise unless this run can take worker `worker`'s weights (--finetune, or a weights-only
    checkpoint): any K, sharding, batch and outer loop; the same model up to NOT_IN_WEIGHTS and vocabulary."""
    if not 0 <= worker < meta.sizes.workers:
        raise CheckpointError(f"--load-worker {worker}: the checkpoint has workers 0..{meta.sizes.workers - 1}")
    _check_model(meta, model, padded_vocab_size, ignore=NOT_IN_WEIGHTS)


def _check_model(meta: CheckpointMeta, model: ModelShape, padded_vocab_size: int, ignore: tuple[str, ...] = ()) -> None:
    diffs = [f"{k}: checkpoint {v}, this run {getattr(model, k)}"
             for k, v in asdict(meta.model).items() if getattr(model, k) != v and k not in ignore]
    if diffs:
        raise CheckpointError("model shape differs: " + "; ".join(diffs)
                              + " (--use-checkpoint-args takes the checkpoint's)")
    if meta.padded_vocab_size != padded_vocab_size:
        raise CheckpointError(f"checkpoint has padded vocabulary {meta.padded_vocab_size}, this run "
                              f"{padded_vocab_size} (a different tokenizer? --use-checkpoint-args takes the checkpoint's "
                              "vocabulary)")


def _check_model_and_stream(meta: CheckpointMeta, model: ModelShape, padded_vocab_size: int, global_batch: int) -> None:
    _check_model(meta, model, padded_vocab_size)
    if meta.global_batch != global_batch:
        raise CheckpointError(f"checkpoint global batch is {meta.global_batch} sequences, this run {global_batch}: "
                              "the data stream would not continue")


def start_from_weights(config: RunConfig, model: torch.nn.Module, padded_vocab_size: int) -> str | None:
    """With --finetune, or when --load is a weights-only checkpoint (an import), set this rank's
    parameters to worker --load-worker's (default 0) weights, resharded to this sharding, on every worker
    alike; everything else starts fresh. Call before the optimizer and the outer loop see the weights.
    Returns what was loaded, or None when the load is a resume (Checkpointer.resume). If any rank
    cannot load, every rank stops together."""
    error, started, reader = None, None, None
    try:
        reader = CheckpointReader(config.load, verify_checksums=config.verify_checksums)
        started = _assign_weights(config, reader, model, padded_vocab_size)
    except CheckpointError as err:
        error = f"checkpoint error: {err}"
    stop_together(error, "load the checkpoint's weights")
    if started is not None:
        _stop_unless_probe_reproduced(model, reader, config.load_worker or 0, config.model.seq_length)
    return started


def _stop_unless_probe_reproduced(model: torch.nn.Module, reader: CheckpointReader, worker: int,
                                  seq_length: int) -> None:
    try:
        problem = probe_problem(model, reader, worker, seq_length)
    except CheckpointError as err:
        problem = str(err)
    stop_together(problem and f"checkpoint error: {problem}", "reproduce the checkpoint's probe")


def _assign_weights(config: RunConfig, reader: CheckpointReader, model: torch.nn.Module,
                    padded_vocab_size: int) -> str | None:
    meta = reader.meta
    if not (config.finetune or meta.weights_only):
        return None
    worker = config.load_worker or 0
    check_weights_start(meta, worker, config.model, padded_vocab_size)
    _check_same_tokenizer(reader, config.data.tokenizer_model)
    stage_of = reader.stage_of(worker, 0)
    names = set(canonical_names(model).values())
    if not names <= set(stage_of):
        raise CheckpointError(f"checkpoint lacks parameters {sorted(names - set(stage_of))[:5]}")

    def weight(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        try:
            full = reader.full_tensor(reader.stage_ranks(worker, 0, stage_of[name]), name, lambda s: s["model"][name])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:  # crafted shards that do not fit
            raise CheckpointError(f"{reader.directory}: the shards of model.{name} do not fit together ({err})") from None
        return check_weight(full, name, shape, str(reader.directory))

    assign_full_weights(model, weight)
    kind = "weights-only checkpoint" if meta.weights_only else "--finetune"
    return f"the weights of worker {worker} of {reader.directory} ({meta.describe_layout()}, {kind}), at step 0"


def _check_same_tokenizer(reader: CheckpointReader, tokenizer_model: str | None) -> None:
    """The tokenizer saved with the weights must be the run's: the same ids must mean the same text
    (the same tokenizer in another format, a SentencePiece model and its tokenizer.json, is the same)."""
    saved = reader.tokenizer_path
    if saved is None or tokenizer_model is None:
        return
    ours = tokenizer_file(tokenizer_model)
    if tokenizer_identity(load_tokenizer(saved)) != tokenizer_identity(load_tokenizer(ours)):
        raise CheckpointError(f"the checkpoint's tokenizer {saved} is not --tokenizer-model's {ours} (their SHA-256 "
                              "differ): train with the tokenizer the model was made with")


class Checkpointer:
    def __init__(self, config: RunConfig, topology: Topology, trainer, canonical: dict[str, str],
                 vocab_size: int, padded_vocab_size: int):
        self.config, self.topology, self.trainer = config, topology, trainer
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.param_of = {canonical[n]: p for n, p in trainer.model.named_parameters()}
        self.name_of = {p: n for n, p in self.param_of.items()}
        self.last_saved: int | None = None
        self._in_flight: SaveInFlight | None = None  # --async-save: the save being written
        # Read once, at start: every save carries the tokenizer the run started with, even when its file
        # goes (--use-checkpoint-args' is a file of a --load iteration, which --keep-last may remove).
        tokenizer = config.data.tokenizer_model
        self.tokenizer_bytes = tokenizer_file(tokenizer).read_bytes() if tokenizer and topology.rank == 0 else None

    @contextmanager
    def attached_to(self, trainer):
        """Save at --save-interval steps and at the end while inside the block (a trainer step hook);
        leaving it waits for an asynchronous save still in flight and publishes it (every rank leaves
        together), unless the block ends in an error: then its writer is joined and nothing published."""
        handle = trainer.register_step_hook(self._after_step)
        try:
            yield self
        except BaseException:
            self._abandon_save()
            raise
        else:
            self.wait_for_save()
        finally:
            handle.remove()

    # -- saving ---------------------------------------------------------------------------------

    def _after_step(self, step: int) -> dict | None:
        interval = self.config.save_interval
        if step == self.config.schedule.train_iters or (interval and step % interval == 0):
            return {"checkpoint_seconds": self.save(step)}  # the seconds training waited
        if self._in_flight is not None:
            self._publish_if_written()
        return None

    def save_unless_saved(self, step: int) -> None:
        """Save at `step` unless this step is already saved (for the preemption hook)."""
        if self.last_saved != step:
            self.save(step)

    def _meta(self, step: int, checksums: list[str], one_model: bool) -> CheckpointMeta:
        sizes = self.topology.sizes
        tokenizer = self.config.data.tokenizer_model
        return CheckpointMeta(
            step=step, sizes=sizes, model=self.config.model, vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size, ranks=[coordinates(r, sizes) for r in range(sizes.world)],
            tokenizer_model="tokenizer.model" if tokenizer else None, extra_state=sorted(self.trainer.extra_state),
            config=json.loads(self.config.to_json()),
            rank_files={rank_file(Path(), r).name: digest for r, digest in enumerate(checksums)},
            workers_hold_one_model=one_model)

    def save(self, step: int) -> float:
        """Every rank writes its file; rank 0 then writes meta.json (with every file's SHA-256) and
        publishes. An OSError on any rank (full disk, read-only folder) stops every rank together after
        one line from rank 0; temporary files are removed and `latest` is left as it was. With
        --async-save the file is written in the background from a host copy and published at a later
        step (trainer/checkpoint/async_save.py). Returns the seconds training waited."""
        start = time.perf_counter()
        self.wait_for_save()  # at most one save in flight
        directory = iteration_dir(Path(self.config.save), step)
        rng = rank_state.capture_rng()  # the probe must not move any generator the run uses
        tokens = probe_tokens(self.vocab_size, min(PROBE_LENGTH, self.config.model.seq_length))
        logits = probe_logits(self.trainer.model, tokens)
        rank_state.restore_rng(rng)
        probe = None if logits is None else {"tokens": tokens, "logits": logits}
        # Asynchronous: a copy, since training changes the tensors while the file is written.
        saved = rank_state.capture(self.trainer, self.name_of, probe, copy=self.config.async_save)
        one_model = rank_state.holds_global_weights(saved)
        write = partial(self._write_iteration, directory, saved, step)
        del saved  # only `write` holds the state: freed once written
        self.last_saved = step
        if self.config.async_save:
            self._in_flight = SaveInFlight(step, directory, one_model, start,
                                           BackgroundWrite(write, name=f"async-save-{step}"))
            return time.perf_counter() - start
        digest, error = "", None
        try:
            digest = write()
        except OSError as err:  # its temporary file is already gone (write_durably)
            error = err
        del write
        self._finish(step, directory, digest, error, one_model, start)
        return time.perf_counter() - start

    def wait_for_save(self) -> None:
        """Wait until the save in flight (if any) is written on this rank, then publish it as a
        synchronous save is published. Every rank calls this together."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        digest, error = in_flight.write.result()
        self._finish(in_flight.step, in_flight.directory, digest, error, in_flight.one_model, in_flight.started)

    def _publish_if_written(self) -> None:
        """Publish the save in flight if every rank's writer has finished; else leave it (training goes on)."""
        writing = comm.all_reduce(torch.tensor([0 if self._in_flight.write.done() else 1]))
        if writing.item() == 0:
            self.wait_for_save()

    def _abandon_save(self) -> None:
        """The run is ending in an error: let this rank's writer finish its file, publish nothing (the
        other ranks may never reach the agreement; the next save removes the unpublished iteration)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.write.join()

    def _finish(self, step: int, directory: Path, digest: str, error: OSError | None, one_model: bool,
                start: float) -> None:
        """Every rank, once its own file is written (or failed): agree, then rank 0 publishes."""
        outcome = self._agree_on_files(error, digest, one_model)  # also: every rank's file is durable
        if isinstance(outcome, str):
            self._fail(step, directory, outcome)
        error = None
        if self.topology.rank == 0:
            try:
                self._publish(step, directory, *outcome)
            except OSError as err:
                error = err
        failed = comm.broadcast(torch.tensor([_errno(error) if error else 0]), src=0)
        if failed.item():
            self._fail(step, directory, f"rank 0: {error}" if error else "")
        if self.topology.rank == 0:
            seconds = time.perf_counter() - start
            how = (f"(written in the background, published {seconds:.2f}s after its step)" if self.config.async_save
                   else f"in {seconds:.2f}s")
            print(f"saved checkpoint {directory} {how}", flush=True)

    def _write_iteration(self, directory: Path, state: dict, step: int) -> str:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / COMPLETE).unlink(missing_ok=True)  # re-saving a step: unpublished until done
        return self._write_rank_file(rank_file(directory, self.topology.rank), state, step)

    def _write_rank_file(self, path: Path, state: dict, step: int) -> str:
        digest = []

        def write(f) -> None:
            digest.append(write_rank_file(f, state))
            self._fail_if_requested(step)

        write_durably(path, write, before_publish=lambda: self._crash_if_requested(step))
        return digest[0]

    def _agree_on_files(self, error: OSError | None, digest: str, one_model: bool) -> tuple[list[str], bool] | str:
        """Every rank's SHA-256 and whether every rank held the global weights, when all ranks wrote
        their file; else a description of the first failure."""
        mine = torch.zeros(2 + DIGEST_BYTES, dtype=torch.int64)
        mine[1] = int(one_model)
        if error is not None:
            mine[0] = _errno(error)
        else:
            mine[2:] = torch.tensor(list(bytes.fromhex(digest)))
        everyone = torch.zeros(self.topology.sizes.world, 2 + DIGEST_BYTES, dtype=torch.int64)
        comm.all_gather_into_tensor(everyone.view(-1), mine)
        failed = [r for r in range(len(everyone)) if everyone[r, 0]]
        if not failed:
            return [bytes(everyone[r, 2:].tolist()).hex() for r in range(len(everyone))], bool(everyone[:, 1].all())
        first = failed[0]
        code = int(everyone[first, 0])
        reason = str(error) if first == self.topology.rank else f"[Errno {code}] {os.strerror(code)}"
        return f"rank {first}: {reason} ({len(failed)} of {len(everyone)} ranks failed)"

    def _publish(self, step: int, directory: Path, checksums: list[str], one_model: bool) -> None:
        """Rank 0, after every rank's file is durable: meta.json and the tokenizer, then `complete` and
        `latest`; then the leftovers of crashed saves and checkpoints beyond --keep-last go."""
        root = directory.parent
        meta = self._meta(step, checksums, one_model)
        write_text_durably(directory / "meta.json", meta.to_json())
        if meta.tokenizer_model:
            write_durably(directory / meta.tokenizer_model, lambda f: f.write(self.tokenizer_bytes))
        publish(root, step)
        remove_incomplete(root, keep=step)
        val_losses = validation_losses(Path(self.config.run_dir) / METRICS_FILE)  # the best checkpoint stays
        removed = prune(root, self.config.keep_last, val_losses)
        if removed:
            print(f"removed checkpoints at steps {removed} (--keep-last {self.config.keep_last}; latest and the best "
                  "validation loss are kept)", flush=True)

    def _fail(self, step: int, directory: Path, reason: str) -> None:
        """Every rank calls this together: rank 0 removes the unpublished iteration and says why in one
        line; every rank exits non-zero (the scheduler restarts from `latest`)."""
        if self.topology.rank == 0:
            root = directory.parent
            latest = latest_iteration(root)
            if latest != step:
                shutil.rmtree(directory, ignore_errors=True)
            print(f"checkpoint error: could not save step {step} in {directory}: {reason}; temporary files removed, "
                  f"{root / 'latest'} still names step {latest}", file=sys.stderr, flush=True)
        raise SystemExit(1)

    def _crash_if_requested(self, step: int) -> None:
        if os.environ.get(CRASH_ENV) == f"{step}:{self.topology.rank}":
            os._exit(17)

    def _fail_if_requested(self, step: int) -> None:
        at, _, code = os.environ.get(FAIL_ENV, "").rpartition(":")
        if at == f"{step}:{self.topology.rank}":
            raise OSError(int(code), os.strerror(int(code)))

    # -- resuming -------------------------------------------------------------------------------

    def resume(self, root: str) -> None:
        """Every rank checks what it loads (trainer/checkpoint/schema.py) before loading it; if any rank
        cannot, each such rank prints its own `checkpoint error:` line and every rank stops together."""
        error, how, reader = None, "", None
        try:
            reader = CheckpointReader(root, verify_checksums=self.config.verify_checksums)
            how = self._load(reader)
        except CheckpointError as err:
            error = f"checkpoint error: {err}"
        stop_together(error, "load the checkpoint")
        worker = self.topology.coords.worker if self.config.load_worker is None else self.config.load_worker
        _stop_unless_probe_reproduced(self.trainer.model, reader, worker, self.config.model.seq_length)
        if self.topology.rank == 0:
            print(f"resumed from {reader.directory} at step {self.trainer.step} ({how})", flush=True)

    def _load(self, reader: CheckpointReader) -> str:
        worker, own = self.config.load_worker, own_form(self.trainer)
        source = f"checkpoint {reader.directory}"
        # --no-load-optim / --no-load-rng: those parts are neither loaded nor checked; they stay fresh.
        skipped = tuple(key for key, loaded in (("optimizer", self.config.load_optim), ("rng", self.config.load_rng))
                        if not loaded)
        if worker is not None:
            # A start loads before the outer loop exists (run.py), which then begins at the loaded weights.
            assert not self.trainer.extra_state, "--load-worker must load before the outer loop is built"
            check_worker_start(reader.meta, worker, self.config.model, self.padded_vocab_size,
                               None if self.config.load_worker_new_batch else self.config.batch.global_batch)
            saved = self._resharded_state(reader, worker, self.config.load_optim)
            if self.config.load_optim:
                engine = self.trainer.engine
                saved = rank_state.with_run_hyperparameters(saved, engine.optimizer, engine.lr_scheduler)
            how = f"worker {worker} of {reader.meta.describe_layout()}"
            check_rank_state(saved, f"{source} (worker {worker})", reader.meta.step, self.param_of, own, skipped)
        elif check_fits(reader.meta, self.topology.sizes, self.config.model, self.padded_vocab_size,
                        self.config.batch.global_batch, sorted(self.trainer.extra_state)):
            saved = self._resharded_state(reader, with_optimizer=self.config.load_optim)
            how = f"resharded from {reader.meta.describe_layout()}"
            check_rank_state(saved, f"{source} (resharded)", reader.meta.step, self.param_of, own, skipped)
        else:
            saved, how = checked_rank_state(reader, self.topology.rank, self.param_of, own, skipped), "same layout"
            source = f"rank file {rank_file(reader.directory, self.topology.rank)}"
        try:
            rank_state.restore(self.trainer, saved, self.param_of)
        except (ValueError, TypeError, KeyError, RuntimeError) as err:  # what a component's own check refuses
            raise CheckpointError(f"{source}: {type(err).__name__}: {err}") from None
        fresh = {"optimizer": "inner optimizer", "rng": "RNG"}
        return how + (f", fresh {' and '.join(fresh[k] for k in skipped)}" if skipped else "")

    def _resharded_state(self, reader: CheckpointReader, worker: int | None = None, with_optimizer: bool = True) -> dict:
        """This rank's state cut from the shards of the checkpoint's worker `worker` (default: this
        rank's own): weights and elementwise optimizer state are merged over the checkpoint's TP ranks
        and re-cut for ours; the rest (hyperparameters, scheduler, counters, step) is the same on every
        rank. RNG states stay freshly seeded; without `with_optimizer`, so does the inner optimizer."""
        try:
            return self._merged_and_cut(reader, self.topology.coords.worker if worker is None else worker,
                                        with_optimizer)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:  # shards that do not fit together
            raise CheckpointError(f"checkpoint {reader.directory} cannot be resharded: {type(err).__name__}: "
                                  f"{str(err)[:200]}") from None

    def _merged_and_cut(self, reader: CheckpointReader, worker: int, with_optimizer: bool) -> dict:
        coords = self.topology.coords
        tp_size = self.topology.sizes.tensor
        stage_of = reader.stage_of(worker, 0)
        first = reader.rank_state(reader.stage_ranks(worker, 0, 0)[0])
        model, optimizer_state = {}, {}
        for name in self.param_of:
            ranks = reader.stage_ranks(worker, 0, stage_of[name])
            sharding = sharding_of(name)
            model[name] = shard(reader.full_tensor(ranks, name, lambda s: s["model"][name]), sharding,
                                coords.tensor, tp_size)
            if not with_optimizer:
                continue
            source_shape = reader.rank_state(ranks[0])["model"][name].shape
            entries = {}
            for key, value in reader.rank_state(ranks[0])["optimizer"]["state"].get(name, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == source_shape:
                    value = shard(reader.full_tensor(ranks, name, lambda s: s["optimizer"]["state"][name][key]),
                                  sharding, coords.tensor, tp_size)
                entries[key] = value
            if entries:
                optimizer_state[name] = entries
        state = {"step": first["step"], "model": model, "scheduler": first["scheduler"], "engine": first["engine"],
                 "extra": {}}
        if with_optimizer:
            state["optimizer"] = {"param_groups": first["optimizer"]["param_groups"], "state": optimizer_state}
        return to_plain(state)
