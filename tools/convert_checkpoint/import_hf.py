"""Import a Hugging Face model (Llama, Qwen3, or the Gemma3 form the exporter writes) as a checkpoint
the trainer starts from, cut into T x P shards.

python -m tools.convert_checkpoint --from-hf HF_DIR --save CKPT --tensor-model-parallel-size T \
    --pipeline-model-parallel-size P [--verify]

The folder is read and checked whole first (hf_folder: one error naming everything the trainer
cannot represent, every tensor's name, shape and dtype, the tokenizer against the embedding rows).
Then T x P processes (gloo, on the host) each build their stage of the trainer's model, fill it with
their shard of the mapped weights (hf_mapping, through the TP sharding as the trainer's own
initializer does), run the checkpointer's fp32 probe through the tensor- and pipeline-parallel model
and write their rank file. The checkpoint is weights only (meta.json `weights_only`, step 0, like
Megatron's release checkpoints): a run loads it as --finetune does.

Vocabulary: the model's vocabulary is the embedding's rows (config.json's vocab_size; Qwen's
tokenizer has fewer ids than rows, the rest are the model's own padding, kept). Every id of the
tokenizer and every special-token id of config.json must be a row. The trainer pads the rows to a
multiple of 128 with copies of the last row, as Megatron's checkpoint converter pads a vocabulary;
the export drops them again.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenizer.interface import load_tokenizer
from tools.convert_checkpoint.folder_files import folder_file, has_entry
from tools.convert_checkpoint.hf_folder import (HfFolderError, HfModel, HfWeights, checked_weights, read_hf_model,
                                                special_token_ids)
from tools.convert_checkpoint.hf_mapping import megatron_tensor
from trainer.checkpoint.format import CheckpointMeta, complete_iterations, iteration_dir, publish, rank_file
from muloco.core.rank_file import write_rank_file
from trainer.config import check_model_shape
from muloco.core.errors import ConfigError
from muloco.core.durable import write_durably, write_text_durably
from trainer.model.builder import padded_vocab_size
from trainer.model.presets import ModelShape
from muloco.core.topology import ParallelSizes, coordinates

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_MAX_BYTES = 256 << 20  # the largest on the Hub (Gemma's) is about 33 MB
IMPORTED_STEP = 0


@dataclass
class ImportResult:
    directory: Path  # the checkpoint's iteration folder
    architecture: str
    layout: str
    tokenizer: bool
    notes: list[str] = field(default_factory=list)  # what the user should know (vocabulary, eos)


def import_hf(hf_dir: str | Path, save: str | Path, tensor: int, pipeline: int,
              untie_embeddings: bool = False) -> ImportResult:
    model = read_hf_model(hf_dir, untie_embeddings)
    checked_weights(model)
    try:
        check_model_shape(model.shape, tensor, pipeline)
    except ConfigError as err:
        raise HfFolderError(f"{model.directory}: cannot be cut into T={tensor} P={pipeline} shards: {err}") from None
    try:
        padded = padded_vocab_size(model.vocab_size, tensor)
    except ValueError as err:
        raise HfFolderError(str(err)) from None
    tokenizer, notes = _checked_tokenizer(model)
    notes.insert(0, _vocabulary_note(model.vocab_size, padded))
    root = Path(save)
    if (root / "latest").exists() or complete_iterations(root):
        raise HfFolderError(f"--save {root} already holds checkpoints: import into a new folder")
    directory = iteration_dir(root, IMPORTED_STEP)
    directory.mkdir(parents=True, exist_ok=True)
    sizes = ParallelSizes(1, 1, pipeline, tensor)
    try:
        digests = _write_rank_files(model, directory, sizes, padded)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)  # unpublished: nothing refers to it
        raise
    meta = CheckpointMeta(
        step=IMPORTED_STEP, sizes=sizes, model=model.shape, vocab_size=model.vocab_size, padded_vocab_size=padded,
        ranks=[coordinates(r, sizes) for r in range(sizes.world)],
        tokenizer_model=TOKENIZER_FILE if tokenizer else None, extra_state=[],
        config={"imported_from": {"directory": str(Path(hf_dir).resolve()), "architecture": model.architecture,
                                  "untied_embeddings": model.untied}},
        rank_files={rank_file(Path(), r).name: d for r, d in enumerate(digests)}, weights_only=True)
    write_text_durably(directory / "meta.json", meta.to_json())
    if tokenizer:
        source = tokenizer.read_bytes()
        write_durably(directory / TOKENIZER_FILE, lambda f: f.write(source))
    publish(root, IMPORTED_STEP)
    return ImportResult(directory, model.architecture, meta.describe_layout(), tokenizer is not None, notes)


def _vocabulary_note(rows: int, padded: int) -> str:
    pad = (f"; the trainer pads it to {padded} rows with copies of the last row (as Megatron pads a vocabulary), "
           "which the export drops" if padded > rows else "")
    return f"vocabulary: {rows} embedding rows{pad}"


def _checked_tokenizer(model: HfModel) -> tuple[Path | None, list[str]]:
    """The folder's tokenizer.json (the file it resolves to; None without one), checked against the embedding rows."""
    rows = model.vocab_size
    problems = [f"config.json's {key} {i} is not a row of the {rows}-row embedding"
                for key, ids in special_token_ids(model.config).items() for i in ids if not 0 <= i < rows]
    if not has_entry(model.directory, TOKENIZER_FILE):
        if problems:
            raise HfFolderError("; ".join(problems))
        return None, [f"no {TOKENIZER_FILE} in {model.directory}: give the run a --tokenizer-model with at most "
                      f"{rows} ids"]
    path = model.directory / TOKENIZER_FILE
    file = folder_file(model.directory, TOKENIZER_FILE, TOKENIZER_MAX_BYTES)  # a hub-cache link: its blob
    try:
        tokenizer = load_tokenizer(file)
    except ValueError as err:
        raise HfFolderError(f"{path}: {err}") from None
    if tokenizer.vocab_size > rows:
        problems.append(f"{path} has {tokenizer.vocab_size} ids but the embedding only {rows} rows")
    if problems:
        raise HfFolderError("; ".join(problems))
    notes = [f"tokenizer: {path} ({tokenizer.vocab_size} ids; documents end with "
             f"{tokenizer.id_to_piece(tokenizer.eod_id)!r}, id {tokenizer.eod_id})"]
    if tokenizer.vocab_size < rows:
        notes.append(f"rows {tokenizer.vocab_size}..{rows - 1} are the model's own padding beyond the tokenizer's "
                     "ids (kept)")
    eos = special_token_ids(model.config)["eos_token_id"]
    if eos and tokenizer.eod_id not in eos:
        notes.append(f"config.json's eos_token_id {eos} is not the end-of-document id {tokenizer.eod_id} the "
                     "training data will use")
    return file, notes


@contextmanager
def _host_only_children():
    """Spawned processes see no accelerator: the import runs on the host (gloo), whatever the machine has."""
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")}
    os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _write_rank_files(model: HfModel, directory: Path, sizes: ParallelSizes, padded: int) -> list[str]:
    """One process per rank writes its rank file; their SHA-256s in rank order."""
    context = mp.get_context("spawn")
    digests = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as rendezvous, _host_only_children():
        store = os.path.join(rendezvous, "store")
        # The shape, not the transformers config: the writers need not import transformers.
        mp.start_processes(_write_rank_file, args=(model.shape, model.vocab_size, HfWeights(model.directory, model.untied),
                                                   directory, sizes, padded, store, digests),
                           nprocs=sizes.world, start_method="spawn", join=True)
    found = dict(digests.get() for _ in range(sizes.world))
    return [found[r] for r in range(sizes.world)]


def _write_rank_file(rank: int, shape: ModelShape, vocab_size: int, weights: HfWeights, directory: Path,
                     sizes: ParallelSizes, padded: int, store: str, digests) -> None:
    """In a spawned process: this rank's stage of the trainer's model from the Hugging Face weights,
    its share of the probe, and its rank file."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_cpu_shims_if_needed, initialize_megatron_groups
    from muloco.core import comm
    from trainer.checkpoint.checkpointer import PROBE_LENGTH, probe_logits, probe_tokens
    from trainer.model.builder import assign_full_weights, build_model, canonical_names
    from muloco.core.topology import build_topology

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sizes.world))
    dist.init_process_group("gloo", store=dist.FileStore(store, sizes.world), rank=rank, world_size=sizes.world,
                            timeout=comm.COLLECTIVE_TIMEOUT)
    apply_cpu_shims_if_needed()
    initialize_megatron_groups(build_topology(sizes, comm.COLLECTIVE_TIMEOUT), comm.COLLECTIVE_TIMEOUT)
    model_parallel_cuda_manual_seed(0)
    stage = build_model(shape, padded)
    assign_full_weights(stage, lambda name, _: megatron_tensor(name, weights.get, shape, padded))
    tokens = probe_tokens(vocab_size, min(PROBE_LENGTH, shape.seq_length))
    logits = probe_logits(stage, tokens)
    names = canonical_names(stage)
    state = {"step": IMPORTED_STEP, "model": {names[n]: p.detach() for n, p in stage.named_parameters()},
             "probe": None if logits is None else {"tokens": tokens, "logits": logits}}
    digest = []
    write_durably(rank_file(directory, rank), lambda f: digest.append(write_rank_file(f, state)))
    digests.put((rank, digest[0]))
    dist.destroy_process_group()
