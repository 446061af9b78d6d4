"""trainer/data.py: the per-worker sampler over megatron-core's GPTDataset, on real preprocessed text.

Covers: worker and inner-DP streams partition every global batch; builds are deterministic; a fresh
build resumes at any step; weighted blends; the validation split; packed samples hold exactly the
tokens Megatron's IndexedDataset reader returns; the identical-workers identity; runs longer than
one epoch; no silent wrap-around past the end of the built dataset.
"""
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core.datasets.indexed_dataset import IndexedDataset

from test_tokenizer import sentencepiece_model  # noqa: F401 - shared session fixture
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tools import preprocess_data
from trainer.config import BatchConfig, DataConfig
from trainer.data import (StreamPosition, TokenizerInfo, build_datasets, collate, micro_batches,
                          validation_batches)

SEQ = 64
SEED = 1234
# K=4 workers x D=2 inner-DP ranks, 3 micro-batches of 2: B = 48 sequences per step.
BATCH = BatchConfig(micro_batch_size=2, gradient_accumulation_steps=3, data_parallel=2, workers=4)
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def single_process_group(tmp_path_factory):
    """Megatron's BlendedDataset asks torch.distributed for the rank when it writes its cache."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("process_group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer(sentencepiece_model: Path) -> TokenizerInfo:  # noqa: F811
    tok = SentencePieceTokenizer(sentencepiece_model)
    return TokenizerInfo(tok.vocab_size, tok.eod_id)


@pytest.fixture(scope="module")
def prefixes(shakespeare: Path, sentencepiece_model: Path, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """The sample corpus's train and valid shards, each preprocessed in-process into its own prefix."""
    out = tmp_path_factory.mktemp("sampler_data")
    result = {}
    for split in ("train", "valid"):
        assert preprocess_data.main(["--input", str(shakespeare / split), "--output-prefix", str(out / split),
                                     "--tokenizer-model", str(sentencepiece_model)]) == 0
        result[split] = f"{out / split}_text_document"
    return result


def build(tokenizer, tmp_path: Path, data_path: list[str], valid_data_path=(), train_samples=STEPS * BATCH.global_batch,
          valid_samples=8, seq_length=SEQ, cache="cache"):
    """A build into its own cache folder, so every call really builds (as a fresh process would)."""
    data = DataConfig(data_path=list(data_path), valid_data_path=list(valid_data_path))
    return build_datasets(data, tokenizer, seq_length, SEED, train_samples, valid_samples, str(tmp_path / cache))


def every_position(batch: BatchConfig = BATCH, identical_workers: bool = False) -> list[StreamPosition]:
    return [StreamPosition(k, d, batch, identical_workers) for k in range(batch.workers)
            for d in range(batch.data_parallel)]


def step_tokens(dataset, step: int) -> list[torch.Tensor]:
    """Every rank's micro-batch tokens at one step, in rank order."""
    return [mb["tokens"] for pos in every_position() for mb in micro_batches(dataset, pos, step)]


def test_worker_and_rank_streams_partition_each_global_batch():
    seen = set()
    for step in range(STEPS):
        indices = [i for pos in every_position() for micro in range(BATCH.gradient_accumulation_steps)
                   for i in pos.sample_indices(step, micro)]
        assert sorted(indices) == list(range(step * BATCH.global_batch, (step + 1) * BATCH.global_batch))
        assert seen.isdisjoint(indices)
        seen.update(indices)
    # Worker k reads the k-th B/K of the step, as the design says.
    first = every_position()[2 * BATCH.data_parallel]
    assert first.sample_indices(1, 0).start == BATCH.global_batch + 2 * BATCH.per_worker


def test_identical_workers_read_worker_zeros_stream():
    for plain, identical in zip(every_position(), every_position(identical_workers=True)):
        reference = StreamPosition(0, plain.data_rank, BATCH)
        for step in range(STEPS):
            for micro in range(BATCH.gradient_accumulation_steps):
                assert identical.sample_indices(step, micro) == reference.sample_indices(step, micro)


@pytest.mark.launch
def test_micro_batches_have_trainer_shapes(prefixes, tokenizer, tmp_path):
    datasets = build(tokenizer, tmp_path, [prefixes["train"]])
    batches = list(micro_batches(datasets.train, every_position()[-1], STEPS - 1))
    assert len(batches) == BATCH.gradient_accumulation_steps
    for mb in batches:
        assert {key: tuple(t.shape) for key, t in mb.items()} == {
            key: (BATCH.micro_batch_size, SEQ) for key in ("tokens", "labels", "loss_mask", "position_ids")}
        assert mb["tokens"].dtype == torch.long and int(mb["tokens"].max()) < tokenizer.vocab_size
        assert torch.equal(mb["tokens"][:, 1:], mb["labels"][:, :-1])  # labels are the next tokens


@pytest.mark.launch
def test_builds_are_deterministic_and_resume_exactly(prefixes, tokenizer, tmp_path):
    uninterrupted = build(tokenizer, tmp_path, [prefixes["train"]], cache="first")
    stream = [step_tokens(uninterrupted.train, step) for step in range(STEPS)]
    # A restarted run builds afresh and starts reading at its checkpointed step.
    resumed = build(tokenizer, tmp_path, [prefixes["train"]], cache="second")
    for step in (STEPS - 1, 3, 0):  # the position is the step alone: any order, any start
        assert all(torch.equal(a, b) for a, b in zip(step_tokens(resumed.train, step), stream[step]))
    # Samples differ between workers (the streams are not copies of each other).
    worker0, worker1 = (next(micro_batches(uninterrupted.train, StreamPosition(k, 0, BATCH), 0)) for k in (0, 1))
    assert not torch.equal(worker0["tokens"], worker1["tokens"])


@pytest.mark.launch
def test_longer_run_keeps_the_stream_within_one_epoch(prefixes, tokenizer, tmp_path):
    """Extending --train-iters on resume is safe while the run stays within one epoch (Megatron
    reshuffles everything when the number of epochs changes)."""
    short = build(tokenizer, tmp_path, [prefixes["train"]], cache="short").train
    longer = build(tokenizer, tmp_path, [prefixes["train"]], train_samples=4 * STEPS * BATCH.global_batch,
                   cache="longer").train
    assert len(short) == len(longer)  # both one epoch
    for step in range(STEPS):
        assert all(torch.equal(a, b) for a, b in zip(step_tokens(short, step), step_tokens(longer, step)))


def _packed_stream(dataset, documents: IndexedDataset) -> np.ndarray:
    """The epoch's documents in GPTDataset's shuffled document order, concatenated: unshuffled sample j
    is this stream's tokens [j*SEQ, (j+1)*SEQ] (one extra token for the labels)."""
    # np.concatenate copies: items are views into the reader's mmap, which must outlive them.
    return np.concatenate([documents[int(doc)] for doc in dataset.document_index])


@pytest.mark.launch
def test_packed_samples_equal_megatron_indexed_dataset(prefixes, tokenizer, tmp_path):
    train = build(tokenizer, tmp_path, [prefixes["train"]]).train
    documents = IndexedDataset(prefixes["train"])
    stream = _packed_stream(train, documents)
    for index in (0, 1, 17, len(train) // 2, len(train) - 1):
        start = int(train.shuffle_index[index]) * SEQ
        sample = train[index]
        assert sample["tokens"].tolist() == stream[start:start + SEQ].tolist()
        assert sample["labels"].tolist() == stream[start + 1:start + SEQ + 1].tolist()
        assert bool(sample["loss_mask"].all())


@pytest.mark.launch
def test_validation_split_holds_other_documents(prefixes, tokenizer, tmp_path):
    datasets = build(tokenizer, tmp_path, [prefixes["train"]])  # --split 98,2,0
    train_docs, valid_docs = set(datasets.train.indices.tolist()), set(datasets.valid.indices.tolist())
    assert valid_docs and train_docs.isdisjoint(valid_docs)
    assert train_docs | valid_docs == set(range(len(IndexedDataset(prefixes["train"]))))
    assert set(datasets.valid.document_index.tolist()) <= valid_docs


@pytest.mark.launch
def test_valid_data_path_and_validation_batches(prefixes, tokenizer, tmp_path):
    eval_iters = 2
    datasets = build(tokenizer, tmp_path, [prefixes["train"]], [prefixes["valid"]],
                     valid_samples=eval_iters * BATCH.per_worker)
    assert datasets.train.dataset_path == prefixes["train"] and datasets.valid.dataset_path == prefixes["valid"]
    assert len(datasets.train.indices) == len(IndexedDataset(prefixes["train"]))  # the whole prefix trains
    by_rank = {}
    for pos in every_position():
        batches = list(validation_batches(datasets.valid, pos, eval_iters))
        assert len(batches) == eval_iters * BATCH.gradient_accumulation_steps
        by_rank.setdefault(pos.data_rank, []).append(torch.cat([b["tokens"] for b in batches]))
    # Every worker evaluates the same samples; its inner-DP ranks split them.
    for tokens in by_rank.values():
        assert all(torch.equal(t, tokens[0]) for t in tokens)
    all_samples = torch.cat([tokens[0] for tokens in by_rank.values()])
    expected = torch.stack([datasets.valid[i]["tokens"] for i in range(eval_iters * BATCH.per_worker)])
    assert sorted(map(tuple, all_samples.tolist())) == sorted(map(tuple, expected.tolist()))


@pytest.mark.launch
def test_per_split_data_args_file_builds_what_the_flags_build(prefixes, tokenizer, tmp_path):
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": [prefixes["train"]], "valid": prefixes["valid"]}))
    data = DataConfig(per_split_data_args_path=str(splits))
    from_file = build_datasets(data, tokenizer, SEQ, SEED, STEPS * BATCH.global_batch, 8, str(tmp_path / "file"))
    from_flags = build(tokenizer, tmp_path, [prefixes["train"]], [prefixes["valid"]])
    assert from_file.valid.dataset_path == prefixes["valid"]
    for ours, theirs in ((from_file.train, from_flags.train), (from_file.valid, from_flags.valid)):
        assert len(ours) == len(theirs) and torch.equal(ours[len(ours) - 1]["tokens"], theirs[len(theirs) - 1]["tokens"])


@pytest.mark.launch
def test_weighted_blend_of_two_prefixes(prefixes, tokenizer, tmp_path):
    train = build(tokenizer, tmp_path, ["0.3", prefixes["train"], "0.7", prefixes["valid"]]).train
    assert 0 <= len(train) - STEPS * BATCH.global_batch <= 1  # each source's share is rounded up
    counts = np.bincount(train.dataset_index, minlength=2)
    assert abs(counts[0] - 0.3 * len(train)) <= 1 and abs(counts[1] - 0.7 * len(train)) <= 1
    assert [d.dataset_path for d in train.datasets] == [prefixes["train"], prefixes["valid"]]
    for index in (0, 1, 2, len(train) - 1):
        source = train.datasets[train.dataset_index[index]]
        assert torch.equal(train[index]["tokens"], source[train.dataset_sample_index[index]]["tokens"])


@pytest.mark.launch
def test_training_past_one_epoch_builds_more_epochs(prefixes, tokenizer, tmp_path):
    one_epoch = len(build(tokenizer, tmp_path, [prefixes["train"]], train_samples=1, cache="one").train)
    steps = (5 * one_epoch // 2) // BATCH.global_batch  # two and a half epochs
    train = build(tokenizer, tmp_path, [prefixes["train"]], train_samples=steps * BATCH.global_batch).train
    assert len(train) >= steps * BATCH.global_batch
    assert len(train.document_index) == 3 * len(train.indices)  # every document once per epoch
    assert len(list(micro_batches(train, every_position()[-1], steps - 1))) == BATCH.gradient_accumulation_steps


@pytest.mark.launch
def test_reading_past_the_built_dataset_raises(prefixes, tokenizer, tmp_path):
    # A weighted blend is built for exactly the requested samples, so the next step is past its end.
    train = build(tokenizer, tmp_path, ["1", prefixes["train"], "1", prefixes["valid"]]).train
    last = every_position()[-1]
    list(micro_batches(train, last, STEPS - 1))
    with pytest.raises(IndexError, match="past the end of the dataset"):
        list(micro_batches(train, last, STEPS))
    with pytest.raises(IndexError, match="past the end"):
        collate(train, range(len(train) - 1, len(train) + 1))


SLOW_SCAN_S = 3.0


def _build_with_a_slow_scanner(rank: int, store: str, tokenizer: TokenizerInfo, data_path: str, cache: str,
                               seen: str) -> None:
    """One of two ranks building one cache. Rank 1 scans the cache slowly and records how many index
    files existed once its scan was over: a rank that wrote while it scanned would be caught here."""
    import trainer.data
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 1:
        scan = trainer.data.refuse_unsafe_index_cache

        def slow_scan(cache_dir: Path) -> None:
            scan(cache_dir)
            time.sleep(SLOW_SCAN_S)
            Path(seen).write_text(str(len(list(cache_dir.rglob("*.npy")))))
        trainer.data.refuse_unsafe_index_cache = slow_scan
    data = DataConfig(data_path=[data_path])
    assert len(trainer.data.build_datasets(data, tokenizer, SEQ, SEED, 64, 8, cache).train) >= 64
    dist.destroy_process_group()


@pytest.mark.launch
def test_no_rank_writes_the_cache_while_another_still_scans_it(prefixes, tokenizer, tmp_path):
    """Megatron builds the cache on rank 0 while the others wait; a rank still scanning the cache for
    unsafe files must not meet a half-written one (a race a 4-rank CI run once lost)."""
    seen = tmp_path / "files_seen_after_scan"
    torch.multiprocessing.spawn(_build_with_a_slow_scanner, nprocs=2, join=True,
                                args=(str(tmp_path / "store"), tokenizer, prefixes["train"], str(tmp_path / "cache"),
                                      str(seen)))
    assert seen.read_text() == "0"
    assert list((tmp_path / "cache").rglob("*.npy")), "the build wrote no index cache at all"
