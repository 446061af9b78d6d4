"""The pieces of preprocessing into one output per input group, each against a plain reference: partitions
(--partition, Slurm array variables), input groups and their assignment, subsets from folder names, subset
weights, cutting documents into files of bounded tokens, and batch writes against Megatron's own builder."""
import json
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from dataprep.blend import BlendFileError, parse_subset_weights, subset_multipliers
from dataprep.indexed_writer import DocumentWriter, document_lengths, plan_files
from dataprep.listing import Listing, subset_of
from dataprep.partition import InputGroup, Partition, PartitionError, assign_groups, plan_groups


def test_partition_flag_and_its_errors():
    assert Partition.parse("3/16") == Partition(3, 16)
    for bad in ("16/16", "-1/4", "1/0", "3", "a/b", "1/2/3"):
        with pytest.raises(PartitionError, match="--partition|index"):
            Partition.parse(bad)


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "15",
      "SLURM_ARRAY_TASK_COUNT": "16"}, (0, 16)),
    ({"SLURM_ARRAY_TASK_ID": "16", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "16"}, (15, 16)),
    ({"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "14",
      "SLURM_ARRAY_TASK_STEP": "2", "SLURM_ARRAY_TASK_COUNT": "8"}, (3, 8)),
])
def test_slurm_array_variables_give_the_partition(environ, expected):
    partition = Partition.from_slurm(environ)
    assert (partition.index, partition.count) == expected if expected else partition is None


@pytest.mark.parametrize("environ", [
    {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "9",
     "SLURM_ARRAY_TASK_COUNT": "3"},  # --array=1,3,9: not an evenly spaced range
    {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MAX": "4"},  # no MIN
    {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "4"},
])
def test_slurm_arrays_that_do_not_add_up_are_refused(environ):
    with pytest.raises(PartitionError, match="SLURM_ARRAY|Slurm"):
        Partition.from_slurm(environ)


def make_listing(tmp_path: Path, sizes: dict[str, int]) -> Listing:
    paths = []
    for name, size in sizes.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        paths.append(path)
    return Listing.of(sorted(paths))


def test_subsets_come_from_hive_folders_or_relative_folders(tmp_path: Path):
    assert subset_of(Path("/data/cc/quality=high/kind=actual/kind2=actual/a.jsonl.zstd"), Path("/data/cc")) == \
        "quality=high/kind=actual/kind2=actual"
    # A run over one quality level still knows it: the key=value folders count wherever they are.
    assert subset_of(Path("/data/cc/quality=low/kind=synthetic/x.jsonl"), Path("/data/cc/quality=low/kind=synthetic")) \
        == "quality=low/kind=synthetic"
    assert subset_of(Path("/data/web/en/a.jsonl"), Path("/data")) == "web/en"
    listing = make_listing(tmp_path, {"a.jsonl": 3, "b.jsonl": 4})
    assert [file.subset for file in listing.files] == [".", "."]
    assert listing.identity() == [["a.jsonl", 3], ["b.jsonl", 4]]


def test_groups_stay_within_a_subset_and_cover_every_input_file_once(tmp_path: Path):
    listing = make_listing(tmp_path, {f"quality={q}/part-{i}.jsonl": 10 + i for q in ("high", "low") for i in range(5)})
    groups = plan_groups(listing, 2)
    assert [(g.subset, g.input_files) for g in groups] == [
        ("quality=high", (0, 1)), ("quality=high", (2, 3)), ("quality=high", (4,)),
        ("quality=low", (5, 6)), ("quality=low", (7, 8)), ("quality=low", (9,))]
    assert [g.index for g in groups] == list(range(6))
    assert groups[0].size == 10 + 11


@pytest.mark.parametrize("count", [1, 2, 3, 7, 40])
def test_assignment_covers_every_group_once_with_balanced_sizes(count: int):
    rng = np.random.default_rng(count)
    sizes = rng.integers(1, 1000, size=31).tolist()
    groups = [InputGroup(i, "s", (i,), size) for i, size in enumerate(sizes)]
    assigned = assign_groups(groups, count)
    assert len(assigned) == count
    assert sorted(g.index for mine in assigned for g in mine) == list(range(len(groups)))
    assert all([g.index for g in mine] == sorted(g.index for g in mine) for mine in assigned)
    loads = [sum(g.size for g in mine) for mine in assigned]
    if count <= len(groups):
        # Greedy largest-first: no partition exceeds the lightest by more than one group.
        assert max(loads) - min(loads) <= max(sizes)
    assert assign_groups(groups, count) == assigned  # the same on every machine


def test_subset_weights_match_folders_values_or_whole_subsets(tmp_path: Path):
    subsets = ["quality=high/kind=actual", "quality=high/kind=synthetic", "quality=low/kind=actual"]
    multipliers = subset_multipliers(subsets, parse_subset_weights("high=2,kind=synthetic=0.5"))
    assert multipliers == {"quality=high/kind=actual": 2.0, "quality=high/kind=synthetic": 1.0,
                           "quality=low/kind=actual": 1.0}
    weights_file = tmp_path / "weights.json"
    weights_file.write_text(json.dumps({"quality=low/kind=actual": 0, "actual": 3}))
    assert subset_multipliers(subsets, parse_subset_weights(str(weights_file))) == {
        "quality=high/kind=actual": 3.0, "quality=high/kind=synthetic": 1.0, "quality=low/kind=actual": 0.0}
    with pytest.raises(BlendFileError, match="hihg match no subset"):
        subset_multipliers(subsets, parse_subset_weights("hihg=2"))
    for bad in ("high", "high=-1", "high=nan", "=2", ""):
        with pytest.raises(BlendFileError):
            parse_subset_weights(bad)
    weights_file.write_text(json.dumps({"high": "2"}))
    with pytest.raises(BlendFileError, match="not a number"):
        parse_subset_weights(str(weights_file))


def greedy_cut(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The rule, one document at a time: a file takes documents while they fit; never an empty file; a
    last file under half the limit is evened out with the one before (every cut tried, both must fit)."""
    files, current, tokens = [], [], 0
    for document, length in enumerate(lengths):
        if current and tokens + length > max_tokens:
            files.append(current)
            current, tokens = [], 0
        current.append(document)
        tokens += length
    files += [current] if current else []
    if len(files) > 1 and sum(lengths[d] for d in files[-1]) < max_tokens / 2:
        pair = files[-2] + files[-1]
        best = len(files[-2])
        for cut in range(1, len(pair)):
            left, right = (sum(lengths[d] for d in docs) for docs in (pair[:cut], pair[cut:]))
            best_left, best_right = (sum(lengths[d] for d in docs) for docs in (pair[:best], pair[best:]))
            if max(left, right) <= max_tokens and abs(left - right) < abs(best_left - best_right):
                best = cut
        files[-2:] = [pair[:best], pair[best:]]
    return files


@pytest.mark.parametrize("max_tokens", [1, 5, 17, 50, 61, 100, 10**9])
def test_plan_files_cuts_as_the_one_document_at_a_time_rule(max_tokens: int):
    rng = np.random.default_rng(max_tokens)
    parts = [rng.integers(0, 20, size=n) for n in (7, 0, 1, 12, 5)]
    plan = plan_files(parts, max_tokens)
    starts = np.cumsum([0] + [len(p) for p in parts])
    files = [[int(starts[part]) + d for part, first, stop in ranges for d in range(first, stop)] for ranges in plan]
    assert files == greedy_cut(np.concatenate(parts).tolist(), max_tokens)
    assert plan_files(parts, None) == [[(i, 0, len(p)) for i, p in enumerate(parts)]]


def test_batch_writes_equal_megatrons_builder_document_by_document(tmp_path: Path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 60000, size=n).astype(np.uint16) for n in (5, 1, 0, 33, 8)]
    reference = IndexedDatasetBuilder(str(tmp_path / "reference.bin"), dtype=np.uint16)
    for document in documents:
        reference.add_document(document, [len(document)])
    reference.finalize(str(tmp_path / "reference.idx"))

    batched = DocumentWriter(str(tmp_path / "batched.bin"), np.uint16)
    batched.add_documents(np.concatenate(documents[:3]), [len(d) for d in documents[:3]])
    batched.add_documents(np.concatenate(documents[3:]), [len(d) for d in documents[3:]])
    batched.finalize(str(tmp_path / "batched.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"batched{suffix}").read_bytes() == (tmp_path / f"reference{suffix}").read_bytes()
    assert (batched.documents, batched.tokens, batched.max_token_id) == (
        5, sum(map(len, documents)), max(int(d.max()) for d in documents if len(d)))

    # Copying document ranges out of it rebuilds the same dataset, read back by Megatron's reader.
    lengths = document_lengths(str(tmp_path / "batched"))
    copied = DocumentWriter(str(tmp_path / "copied.bin"), np.uint16)
    for first, stop in ((0, 2), (2, 2), (2, 4), (4, 5)):
        copied.copy_documents(str(tmp_path / "batched"), lengths, first, stop)
    copied.finalize(str(tmp_path / "copied.idx"))
    dataset = IndexedDataset(str(tmp_path / "copied"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [d.tolist() for d in documents]
    with pytest.raises(TypeError, match="int32"):
        copied.add_documents(np.zeros(3, np.int32), [3])


def test_a_group_never_ends_in_a_sliver_of_a_file():
    """Ten documents of 100 tokens at 450 a file: 400, 400, 200 would leave a 200-token file; the last two share."""
    plan = plan_files([np.full(6, 100), np.full(4, 100)], 450)
    assert [sum(stop - first for _, first, stop in ranges) * 100 for ranges in plan] == [400, 300, 300]
    assert plan[1:] == [[(0, 4, 6), (1, 0, 1)], [(1, 1, 4)]]
