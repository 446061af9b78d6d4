"""Training and validation data: megatron-core's GPTDataset (packing, shuffling, blends, splits)
behind a deterministic per-worker sampler.

The global sample stream is the train GPTDataset's index order. Inner step s consumes global
samples [s*B, (s+1)*B); worker k takes the k-th B/K of them and inner-DP rank d the d-th share of
that, cut into micro-batches. Streams of different workers and ranks are disjoint, and the only
state is the step, so a resumed run sees exactly the samples an uninterrupted run would have seen.
The order depends on the run length only through the number of epochs Megatron builds: extending
--train-iters keeps the stream while the run stays within the same number of epochs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.datasets.gpt_dataset import GPTDataset

from dataprep.blend import read_data_args, read_per_split_data_args
from dataprep.dataset_meta import meta_path, read_dataset_meta
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import load_tokenizer, tokenizer_sha256
from muloco.core.comm import barrier
from trainer.config import BatchConfig, DataConfig
from muloco.core.errors import ConfigError
from trainer.data_splits import Blend, SplitBlends, SplitBlendsBuilder, SplitBlendsConfig, split_blends
from trainer.indexed_files import read_indexed_files, regular_file_problem
from trainer.open_files import MappedGPTDataset


@dataclass(frozen=True)
class TokenizerInfo:
    """What GPTDataset needs from a tokenizer: vocabulary size and end-of-document id."""

    vocab_size: int
    eod: int

    @property
    def unique_identifiers(self) -> dict:
        """Megatron hashes this into its dataset cache keys."""
        return {"class": "TokenizerInfo", "vocab_size": self.vocab_size, "eod": self.eod}


def tokenizer_info(data: DataConfig) -> TokenizerInfo:
    if data.tokenizer_model:
        tok = load_tokenizer(data.tokenizer_model)
        return TokenizerInfo(tok.vocab_size, tok.eod_id)
    if data.vocab_size:
        return TokenizerInfo(data.vocab_size, 0)
    raise ValueError("give --tokenizer-model (or --vocab-size for pre-tokenized data without a tokenizer)")


_BLEND_SHOWN = 8  # prefixes printed before "... and N more"
_PREFIX_SHOWN = 300  # characters of a prefix printed in an error (one read from a file may be of any length)


def data_blends(data: DataConfig) -> tuple[Blend, Blend | None]:
    """The train blend and the validation blend (None: split off the train blend) from --data-path and
    --valid-data-path, --data-args-path (instead of --data-path) or --per-split-data-args-path (instead of
    both), each checked: weights positive, every prefix's .bin and .idx present."""
    return tuple(_blend(items, source) if items else None for items, source in _blend_lists(data))


def _blend_lists(data: DataConfig) -> list[tuple[list[str] | None, str]]:
    given = [flag for flag, value in (("--data-path", data.data_path), ("--valid-data-path", data.valid_data_path),
                                      ("--data-args-path", data.data_args_path),
                                      ("--per-split-data-args-path", data.per_split_data_args_path)) if value]
    if data.per_split_data_args_path and len(given) > 1 or data.data_path and data.data_args_path:
        raise ConfigError(f"{' and '.join(given)} cannot be combined: give one (--per-split-data-args-path "
                          "replaces --data-path and --valid-data-path, --data-args-path replaces --data-path)")
    if data.per_split_data_args_path:
        splits = read_per_split_data_args(data.per_split_data_args_path)
        return [(splits[split], f"{data.per_split_data_args_path} ({split})") for split in ("train", "valid")]
    if data.data_args_path:
        train = (read_data_args(data.data_args_path), data.data_args_path)
    elif data.data_path:
        train = (list(data.data_path), "--data-path")
    else:
        raise ValueError("no training data: give --data-path PREFIX (the P of P.bin/P.idx) or --data-args-path FILE")
    return [train, (list(data.valid_data_path), "--valid-data-path")]


def _blend(items: list[str], source: str) -> Blend:
    if len(items) == 1:
        prefixes, weights = items, None
    elif len(items) % 2 == 0:
        weights, prefixes = [_weight(item, source) for item in items[0::2]], items[1::2]
    else:
        raise ConfigError(f"{source} takes one prefix or weight/prefix pairs, got {len(items)} items: "
                          f"{' '.join(items[:6])}{' ...' if len(items) > 6 else ''}")
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if problem := regular_file_problem(prefix + suffix):  # missing, or a folder, FIFO, device, too long
                raise (FileNotFoundError if problem == "not found" else ConfigError)(
                    f"dataset file {_shown(prefix + suffix)} {problem} (from {source})")
    return prefixes, weights


def _shown(name: str) -> str:
    return name if len(name) <= _PREFIX_SHOWN else f"{name[:_PREFIX_SHOWN]}... ({len(name)} characters)"


def _weight(item: str, source: str) -> float:
    try:
        weight = float(item)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError(f"{source}: blend weight {item!r} is not a number > 0 (the form is weight prefix ...)")
    return weight


def describe_blend(blend: Blend, what: str) -> str:
    """The blend as the run uses it, weights normalised as Megatron normalises them."""
    prefixes, weights = blend
    if weights is None:
        return f"data: {what}: {prefixes[0]}"
    total = sum(weights)
    lines = [f"  {weight / total:.6f} {prefix}" for weight, prefix in zip(weights[:_BLEND_SHOWN], prefixes)]
    more = [f"  ... and {len(prefixes) - _BLEND_SHOWN} more"] if len(prefixes) > _BLEND_SHOWN else []
    return "\n".join([f"data: {what}: blend of {len(prefixes)} prefixes (share of samples, prefix):", *lines, *more])


def run_blends(data: DataConfig, seq_length: int) -> SplitBlends:
    """The blends the run builds for training and validation, each without the prefixes whose share of it is
    short of a sample (trainer/data_splits.py); a ConfigError when a split is left with none."""
    return split_blends(*data_blends(data), data.split, seq_length)


@dataclass
class Datasets:
    train: GPTDataset
    valid: GPTDataset | None


# The start-up watchdog's default limit: a floor for the model, the process groups and a checkpoint, plus
# Megatron's sample indices, built in time proportional to the data (1 s per 10 MB of tokens allows about
# ten times what a loaded core needs) and to the prefixes (each checked, then its indices built for each
# split: a blend of 10,000 tiny ones starts in 70-90 s on a loaded core, benchmarks/large_blend.py).
STARTUP_FLOOR_S = 300.0
STARTUP_BYTES_PER_S = 10e6
STARTUP_S_PER_PREFIX = 0.1


def startup_timeout_s(data: DataConfig) -> float:
    """The start-up limit for this data when --startup-timeout-s is not given."""
    train, valid = data_blends(data)
    prefixes = {*train[0], *(valid[0] if valid else ())}
    return (STARTUP_FLOOR_S + len(prefixes) * STARTUP_S_PER_PREFIX
            + sum(Path(prefix + ".bin").stat().st_size for prefix in prefixes) / STARTUP_BYTES_PER_S)


def index_cache_dir(run_dir: str | Path) -> Path:
    """Where Megatron caches the datasets' sample indices (built once, read by every rank)."""
    return Path(run_dir) / "data_cache"


def check_data(data: DataConfig) -> None:
    """Fail on missing, damaged or unfitting data or tokenizer before any process group or collective exists."""
    train, valid = data_blends(data)
    prefixes = [*train[0], *(valid[0] if valid else ())]
    if data.tokenizer_model and not Path(data.tokenizer_model).exists():  # a file, or a tokenizer.json folder
        raise FileNotFoundError(f"tokenizer model {data.tokenizer_model} not found (from --tokenizer-model)")
    if not data.tokenizer_model and not data.vocab_size:
        raise ValueError("give --tokenizer-model (or --vocab-size for pre-tokenized data without a tokenizer)")
    _check_token_ids_fit(data, prefixes)


def check_model_vocabulary(data: DataConfig, model_vocab_size: int | None) -> None:
    """A model vocabulary taken from a checkpoint (--use-checkpoint-args) must hold every id of the
    tokenizer; its rows beyond the tokenizer's ids (Qwen's padding, say) are simply never fed."""
    if model_vocab_size is None:
        return
    vocab_size = tokenizer_info(data).vocab_size
    if vocab_size > model_vocab_size:
        source = f"--tokenizer-model {data.tokenizer_model}" if data.tokenizer_model else "--vocab-size"
        raise ConfigError(f"{source} has {vocab_size} ids, but the checkpoint's model (--use-checkpoint-args) has "
                          f"only {model_vocab_size} embedding rows: use the tokenizer the model was made with")


def _check_token_ids_fit(data: DataConfig, prefixes: list[str]) -> None:
    """Each dataset's .bin and .idx must agree (and with PREFIX.meta.json, where preprocessing wrote
    one); its token ids must exist in this run's vocabulary and come from the same tokenizer, or the
    embedding lookup fails (or, worse, silently reads the wrong rows) long after start-up. The largest
    id is found by one scan of the .bin, never taken on trust: a .bin damaged or replaced under an
    intact .meta.json is caught by the scan disagreeing with it (a checksum would cost more than the
    scan, which runs at memory speed)."""
    tokenizer = load_tokenizer(data.tokenizer_model) if data.tokenizer_model else None
    vocab_size = tokenizer.vocab_size if tokenizer else data.vocab_size
    # The tokenizer's identity and, for data made before it existed, its file's SHA-256: computed once,
    # when a meta.json needs them (a blend may have thousands of files).
    accepted: tuple[str, str] | None = None
    flag = f"--tokenizer-model {data.tokenizer_model}" if tokenizer else "--vocab-size"
    unchecked = []  # prefixes without a .meta.json: which tokenizer made them is unknown
    for prefix in prefixes:
        files = read_indexed_files(prefix)
        path = meta_path(prefix)
        try:
            meta = read_dataset_meta(prefix)
        except ValueError as err:  # not JSON, or not the keys and types preprocessing writes
            raise ConfigError(f"{path} is not a valid data description: {err}") from None
        if meta is not None and meta.tokens != files.tokens:
            raise ConfigError(f"{path} counts {meta.tokens} tokens, but {prefix}.idx describes {files.tokens}: the "
                              "files are not from one preprocessing run")
        max_token_id = files.max_token_id()
        if meta is not None and meta.max_token_id != max_token_id:
            raise ConfigError(f"{prefix}.bin: its largest token id is {max_token_id}, but {path} records "
                              f"{meta.max_token_id}: the .bin was damaged or replaced after preprocessing")
        if max_token_id >= vocab_size:
            raise ConfigError(f"{prefix}.bin: the data holds token id {max_token_id}, but the vocabulary of {flag} "
                              f"has only {vocab_size} ids (0..{vocab_size - 1}): tokenize with this tokenizer, or use "
                              "the one the data was made with")
        if tokenizer is not None and meta is None:
            unchecked.append(path)
        elif tokenizer is not None:
            accepted = accepted or (tokenizer_identity(tokenizer), tokenizer_sha256(tokenizer))
            if meta.tokenizer_sha256 not in accepted:
                raise ConfigError(f"{path}: the data was tokenized with a tokenizer whose SHA-256 is "
                                  f"{meta.tokenizer_sha256}, but {flag} has {accepted[0]}: use the "
                                  "tokenizer the data was made with")
    if unchecked and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"warning: {len(unchecked)} of {len(prefixes)} dataset(s) have no .meta.json (e.g. {unchecked[0]}): "
              f"that {flag} made them is not checked, only that their token ids fit its {vocab_size} ids", flush=True)


def refuse_unsafe_index_cache(cache_dir: Path) -> None:
    """Megatron reads its index cache with numpy.load(allow_pickle=True), which unpickles any file
    without the .npy magic, so a planted file could run code. Every cached index must be a plain
    .npy array (numpy's header parser evaluates no code; memory-mapping refuses object dtypes)."""
    for path in sorted(cache_dir.rglob("*.npy")) if cache_dir.is_dir() else []:
        with open(path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}[version]
                dtype = read_header(f)[2]
            except (ValueError, KeyError) as err:
                raise ConfigError(f"data index cache file {path} is not a plain .npy array ({err!r}); it would be "
                                  f"unpickled: delete {cache_dir} and let the run rebuild it") from None
        if dtype.hasobject:
            raise ConfigError(f"data index cache file {path} holds Python objects; delete {cache_dir} and let the "
                              "run rebuild it")


def build_datasets(data: DataConfig, tokenizer: TokenizerInfo, seq_length: int, seed: int,
                   train_samples: int, valid_samples: int, cache_dir: str,
                   document_masking: bool = False) -> Datasets:
    """Every rank must call this (Megatron builds on rank 0 first, then the others read its cache).
    With `document_masking` positions restart at each document and each micro-batch carries its
    tokens' document ids (`collate`), from which attention builds its block-causal mask on the
    compute device; Megatron's per-sample [s, s] host mask is not made."""
    train_blend, valid_blend = data_blends(data)
    blends = split_blends(train_blend, valid_blend, data.split, seq_length)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(describe_blend(train_blend, "training" if valid_blend else "training and validation"), flush=True)
        if valid_blend:
            print(describe_blend(valid_blend, "validation"), flush=True)
        for note in blends.notes:
            print(note, flush=True)
    refuse_unsafe_index_cache(Path(cache_dir))
    if dist.is_initialized():
        # Megatron's rank 0 writes the cache while the others wait; none may start writing while a
        # slower rank is still scanning, or that rank would read a half-written file.
        barrier()
    config = SplitBlendsConfig(
        blend_per_split=[blends.train, blends.valid, None], prefix_split=blends.prefix_split, random_seed=seed,
        sequence_length=seq_length, tokenizer=tokenizer, reset_position_ids=document_masking,
        reset_attention_mask=document_masking, eod_mask_loss=False, create_attention_mask=False,
        path_to_cache=cache_dir)
    # Test split size 0, not None: Megatron refuses a None size for a weighted blend.
    train, valid, _ = SplitBlendsBuilder(
        MappedGPTDataset, [train_samples, valid_samples, 0], lambda: True, config).build()
    return Datasets(train, valid)


@dataclass(frozen=True)
class StreamPosition:
    """Which slice of the global sample stream this rank reads."""

    worker: int
    data_rank: int
    batch: BatchConfig
    identical_workers: bool = False  # every worker reads worker 0's stream (a test identity)

    def sample_indices(self, step: int, micro: int) -> range:
        worker = 0 if self.identical_workers else self.worker
        return self._micro_batch(step * self.batch.global_batch + worker * self.batch.per_worker, micro)

    def validation_indices(self, iteration: int, micro: int) -> range:
        """Every worker evaluates the same samples, so the numbers compare across workers and methods."""
        return self._micro_batch(iteration * self.batch.per_worker, micro)

    def _micro_batch(self, worker_start: int, micro: int) -> range:
        """Micro-batch `micro` of this rank's share of the per-worker batch that starts at `worker_start`."""
        per_rank = self.batch.micro_batch_size * self.batch.gradient_accumulation_steps
        start = worker_start + self.data_rank * per_rank + micro * self.batch.micro_batch_size
        return range(start, start + self.batch.micro_batch_size)


def collate(dataset, indices: range) -> dict[str, torch.Tensor]:
    # Never wrap around: silently repeating samples would corrupt an experiment.
    if indices.stop > len(dataset):
        raise IndexError(f"sample {indices.stop - 1} is past the end of the dataset ({len(dataset)} samples); "
                         f"the datasets are built for train-iters x global batch samples (and eval-iters x "
                         f"per-worker batch for validation), so the same settings must be used when reading")
    samples = [dataset[i] for i in indices]
    batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}
    if dataset.config.reset_attention_mask:
        batch["document_ids"] = document_ids(batch["tokens"], dataset.config.tokenizer.eod)
    return batch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int32: the number of end-of-document tokens before each position, so an end-of-document
    token belongs to the document it ends (Megatron's reset_attention_mask: no token attends across one)."""
    is_eod = (tokens == eod).to(torch.int32)
    return (torch.cumsum(is_eod, dim=-1, dtype=torch.int32) - is_eod)


def micro_batches(dataset, position: StreamPosition, step: int):
    """The micro-batches this rank trains on at inner step `step`."""
    for micro in range(position.batch.gradient_accumulation_steps):
        yield collate(dataset, position.sample_indices(step, micro))


def validation_batches(dataset, position: StreamPosition, eval_iters: int):
    """The same validation samples at every evaluation; inner-DP ranks split them."""
    for iteration in range(eval_iters):
        for micro in range(position.batch.gradient_accumulation_steps):
            yield collate(dataset, position.validation_indices(iteration, micro))
