"""Saving at the configured steps (a trainer step hook) and resuming at start-up, with the layout
checks and resharding described in trainer/checkpoint/__init__.py."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from megatron.core import parallel_state as mps
from megatron.core.pipeline_parallel import get_forward_backward_func

import trainer.checkpoint.state as rank_state
from tokenizer.interface import tokenizer_file
from trainer import comm
from trainer.checkpoint.format import (COMPLETE, CheckpointError, CheckpointMeta, CheckpointReader, iteration_dir,
                                       publish, rank_file, remove_incomplete)
from trainer.config import RunConfig
from trainer.durable import write_durably, write_text_durably
from trainer.model.layout import layout_of, shard
from trainer.model.presets import ModelShape
from trainer.topology import ParallelSizes, Topology, coordinates

PROBE_LENGTH = 32
# Test hook: "STEP:RANK" makes that rank die after writing its temporary file, before publishing it.
CRASH_ENV = "MULOCO_CKPT_CRASH_AT"


def probe_tokens(vocab_size: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def probe_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits of the (pipeline- and tensor-parallel) training model on `tokens`: this rank's vocab
    slice on the last stage, None elsewhere. Every rank of the worker must call it."""
    tokens = comm.to_compute_device(tokens)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)

    def forward_step(data_iterator, module):
        logits = module(tokens, positions, None)
        return logits, lambda out: (torch.zeros((), device=out.device), {"logits": out.detach().float().clone()})

    was_training = model.training
    model.eval()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True)
    model.train(was_training)
    return outputs[0]["logits"] if mps.is_pipeline_last_stage() else None


def check_fits(meta: CheckpointMeta, sizes: ParallelSizes, model: ModelShape, padded_vocab_size: int,
               global_batch: int, extra_state: list[str]) -> bool:
    """Raise on what cannot be resumed; return whether the layout must be resharded."""
    if meta.sizes.workers != sizes.workers:
        raise CheckpointError(f"checkpoint has K={meta.sizes.workers} workers, this run K={sizes.workers}; "
                              "the number of workers cannot change on resume")
    if meta.model != model:
        diffs = [f"{k}: checkpoint {v}, this run {getattr(model, k)}"
                 for k, v in asdict(meta.model).items() if getattr(model, k) != v]
        raise CheckpointError("model shape differs: " + "; ".join(diffs))
    if meta.padded_vocab_size != padded_vocab_size:
        raise CheckpointError(f"checkpoint has padded vocabulary {meta.padded_vocab_size}, "
                              f"this run {padded_vocab_size} (a different tokenizer?)")
    batch = meta.config["batch"]
    saved_batch = batch["micro_batch_size"] * batch["gradient_accumulation_steps"] * batch["data_parallel"] * batch["workers"]
    if saved_batch != global_batch:
        raise CheckpointError(f"checkpoint global batch is {saved_batch} sequences, this run {global_batch}: "
                              "the data stream would not continue")
    if meta.extra_state != extra_state:
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


class Checkpointer:
    def __init__(self, config: RunConfig, topology: Topology, trainer, canonical: dict[str, str],
                 vocab_size: int, padded_vocab_size: int):
        self.config, self.topology, self.trainer = config, topology, trainer
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.param_of = {canonical[n]: p for n, p in trainer.model.named_parameters()}
        self.name_of = {p: n for n, p in self.param_of.items()}

    @contextlib.contextmanager
    def attached_to(self, trainer):
        """Save at --save-interval steps and at the end while inside the block (a trainer step hook)."""
        handle = trainer.register_step_hook(self._after_step)
        try:
            yield self
        finally:
            handle.remove()

    # -- saving ---------------------------------------------------------------------------------

    def _after_step(self, step: int) -> dict | None:
        interval = self.config.save_interval
        if step == self.config.schedule.train_iters or (interval and step % interval == 0):
            return {"checkpoint_seconds": self.save(step)}
        return None

    def _meta(self, step: int) -> CheckpointMeta:
        sizes = self.topology.sizes
        tokenizer = self.config.data.tokenizer_model
        return CheckpointMeta(
            step=step, sizes=sizes, model=self.config.model, vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size, ranks=[coordinates(r, sizes) for r in range(sizes.world)],
            tokenizer_model="tokenizer.model" if tokenizer else None, extra_state=sorted(self.trainer.extra_state),
            config=json.loads(self.config.to_json()))

    def save(self, step: int) -> float:
        start = time.perf_counter()
        root = Path(self.config.save)
        directory = iteration_dir(root, step)
        is_rank0 = self.topology.rank == 0
        if is_rank0:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / COMPLETE).unlink(missing_ok=True)  # re-saving a step: unpublished until done
        comm.barrier()
        rng = rank_state.capture_rng()  # the probe must not move any generator the run uses
        tokens = probe_tokens(self.vocab_size, min(PROBE_LENGTH, self.config.model.seq_length))
        logits = probe_logits(self.trainer.model, tokens)
        rank_state.restore_rng(rng)
        probe = None if logits is None else {"tokens": tokens, "logits": logits}
        saved = rank_state.capture(self.trainer, self.name_of, probe)
        write_durably(rank_file(directory, self.topology.rank), lambda f: torch.save(saved, f),
                      before_publish=lambda: self._crash_if_requested(step))
        if is_rank0:
            meta = self._meta(step)
            write_text_durably(directory / "meta.json", meta.to_json())
            if meta.tokenizer_model:
                source = tokenizer_file(self.config.data.tokenizer_model).read_bytes()  # a folder's tokenizer.json
                write_durably(directory / meta.tokenizer_model, lambda f: f.write(source))
        comm.barrier()  # every rank's file is durable
        if is_rank0:
            publish(root, step)
            remove_incomplete(root, keep=step)
            print(f"saved checkpoint {directory} in {time.perf_counter() - start:.2f}s", flush=True)
        return time.perf_counter() - start

    def _crash_if_requested(self, step: int) -> None:
        if os.environ.get(CRASH_ENV) == f"{step}:{self.topology.rank}":
            os._exit(17)

    # -- resuming -------------------------------------------------------------------------------

    def resume(self, root: str) -> None:
        """Every rank stops together, with one message from rank 0, when the checkpoint does not fit."""
        try:
            reader = CheckpointReader(root)
            how = self._load(reader)
        except CheckpointError as err:
            if self.topology.rank == 0:
                print(f"checkpoint error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        if self.topology.rank == 0:
            print(f"resumed from {reader.directory} at step {self.trainer.step} ({how})", flush=True)

    def _load(self, reader: CheckpointReader) -> str:
        if check_fits(reader.meta, self.topology.sizes, self.config.model, self.padded_vocab_size,
                      self.config.batch.global_batch, sorted(self.trainer.extra_state)):
            saved, how = self._resharded_state(reader), f"resharded from {reader.meta.describe_layout()}"
        else:
            saved, how = reader.rank_state(self.topology.rank), "same layout"
        rank_state.restore(self.trainer, saved, self.param_of)
        return how

    def _resharded_state(self, reader: CheckpointReader) -> dict:
        """This rank's state cut from the checkpoint's shards: weights and elementwise optimizer state
        are merged over the checkpoint's TP ranks and re-cut for ours; the rest (hyperparameters,
        scheduler, counters, step) is the same on every rank. RNG states stay freshly seeded."""
        coords = self.topology.coords
        tp_size = self.topology.sizes.tensor
        stage_of = reader.stage_of(coords.worker, 0)
        first = reader.rank_state(reader.stage_ranks(coords.worker, 0, 0)[0])
        model, optimizer_state = {}, {}
        for name in self.param_of:
            ranks = reader.stage_ranks(coords.worker, 0, stage_of[name])
            layout = layout_of(name)
            model[name] = shard(reader.full_tensor(ranks, name, lambda s: s["model"][name]), layout,
                                coords.tensor, tp_size)
            source_shape = reader.rank_state(ranks[0])["model"][name].shape
            entries = {}
            for key, value in reader.rank_state(ranks[0])["optimizer"]["state"].get(name, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == source_shape:
                    value = shard(reader.full_tensor(ranks, name, lambda s: s["optimizer"]["state"][name][key]),
                                  layout, coords.tensor, tp_size)
                entries[key] = value
            if entries:
                optimizer_state[name] = entries
        return {"step": first["step"], "model": model, "scheduler": first["scheduler"], "engine": first["engine"],
                "optimizer": {"param_groups": first["optimizer"]["param_groups"], "state": optimizer_state},
                "extra": {}}
