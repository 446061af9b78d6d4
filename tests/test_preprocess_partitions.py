"""tools/preprocess_data.py split across processes: 3 partitions of a generated corpus in Nemotron-CC form
(four subsets, one of a single document; zstd, plain, parquet and gzip input files; a few bad records), run as
separate processes with different --processes counts and chunk sizes, write the same files byte for byte as one
process; the merge checks that every input file was covered exactly once and writes a token-weighted blend; the
trainer trains 10 steps on it at the default split, the one-document piece left out of validation; a killed
partition resumes; manifests written before the renames still merge and resume; a manifest nested 100,000
levels deep is one line."""
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_tokenizer import sentencepiece_model  # noqa: F401 - shared session fixture
from tools.trainer_runs import PRETRAIN, launch_ranks, read_metrics
from tools.trainer_runs import DS_CONFIGS, REPO_ROOT

from dataprep.dataset_meta import read_dataset_meta
from dataprep.input_files import read_documents, resolve_inputs
from dataprep.manifest import FORMAT, FORMAT_1, read_manifest
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tools import preprocess_data
from tools.preprocessing.tokenize_worker import KILL_HOOK_ENV

DOCUMENTS_PER_FILE = 70
OPTIONS = ["--input-files-per-output", "2", "--max-tokens-per-file", "12000"]
HIGH = "quality=high/kind=actual/kind2=actual"
MEDIUM = "quality=medium/kind=actual/kind2=actual"
LOW = "quality=low/kind=synthetic/kind2=distill"
TINY = "quality=tiny/kind=actual/kind2=actual"  # one document: a piece no split but training can use


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


@pytest.fixture(scope="module")
def subset_corpus(shakespeare: Path, tmp_path_factory) -> Path:
    """Seven input files in three subsets, ~400-character documents of the sample corpus's text, and an eighth
    of one 2000-character document in a fourth."""
    text = " ".join(doc.text for path in resolve_inputs([str(shakespeare / "train")])
                    for doc in read_documents(path, "text", print))
    pieces = iter(text[i:i + 400] for i in range(0, len(text), 400))
    documents = lambda: [next(pieces) for _ in range(DOCUMENTS_PER_FILE)]  # noqa: E731
    corpus = tmp_path_factory.mktemp("nemotron_cc")
    for folder in (HIGH, MEDIUM, LOW):
        (corpus / folder).mkdir(parents=True)
    for index in range(3):
        (corpus / HIGH / f"CC-MAIN-part-{index:05d}.jsonl.zstd").write_bytes(zstandard.ZstdCompressor().compress(
            jsonl(documents())))
    (corpus / MEDIUM / "part-00000.jsonl").write_bytes(jsonl(documents()) + b'{"text": "unterminated\n{"body": "x"}\n')
    pq.write_table(pa.table({"text": documents()}), corpus / MEDIUM / "part-00001.parquet", row_group_size=16)
    for index in range(2):
        (corpus / LOW / f"part-{index:05d}.jsonl.gz").write_bytes(gzip.compress(jsonl(documents())))
    (corpus / TINY).mkdir(parents=True)
    (corpus / TINY / "part-00000.jsonl").write_bytes(jsonl(["".join(next(pieces) for _ in range(5))]))
    return corpus


def tool_args(corpus: Path, prefix: Path, model: Path, *extra: str) -> list[str]:
    return ["--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-model", str(model), *OPTIONS, *extra]


@pytest.fixture
def no_slurm(monkeypatch):
    for name in [name for name in os.environ if name.startswith("SLURM_ARRAY")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def one_partition(subset_corpus: Path, sentencepiece_model: Path, tmp_path_factory) -> Path:  # noqa: F811
    """The reference: the whole input in one process (partition 0/1), in-process."""
    out = tmp_path_factory.mktemp("one_partition")
    environ = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("SLURM_ARRAY")}
    try:
        assert preprocess_data.main(tool_args(subset_corpus, out / "cc", sentencepiece_model)) == 0
    finally:
        os.environ.update(environ)
    return out


@pytest.fixture(scope="module")
def three_partitions(subset_corpus: Path, sentencepiece_model: Path, tmp_path_factory) -> tuple[Path, list[str]]:  # noqa: F811
    """Three partitions as three concurrent processes: different --processes counts and chunk sizes, the last
    one told its partition by Slurm array variables (an array of tasks 1-3)."""
    out = tmp_path_factory.mktemp("three_partitions")
    base_env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_ARRAY")}
    runs = [(["--partition", "0/3", "--processes", "2", "--chunk-mb", "0.01"], {}),
            (["--partition", "1/3"], {}),
            ([], {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "3",
                  "SLURM_ARRAY_TASK_COUNT": "3"})]
    processes = [subprocess.Popen([sys.executable, "tools/preprocess_data.py",
                                   *tool_args(subset_corpus, out / "cc", sentencepiece_model, *flags)],
                                  cwd=REPO_ROOT, env={**base_env, **env}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for flags, env in runs]
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
        outputs.append(stdout + stderr)
    return out, outputs


def dataset_files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("cc_*_text_document.*"))}


@pytest.mark.launch
def test_three_partitions_write_byte_identical_files_to_one(
        one_partition: Path, three_partitions, subset_corpus: Path, sentencepiece_model: Path):  # noqa: F811
    folder, outputs = three_partitions
    reference = dataset_files(one_partition)
    assert dataset_files(folder) == reference
    # Groups of two input files of one subset: high 0-1 and 2, low 3-4, medium 5-6, tiny 7; groups of two
    # exceed 12000 tokens and are cut in two.
    names = sorted({name.split("_text_document")[0] for name in reference})
    assert names == ["cc_000000_0000", "cc_000000_0001", "cc_000001_0000", "cc_000002_0000", "cc_000002_0001",
                     "cc_000003_0000", "cc_000003_0001", "cc_000004_0000"]
    assert "partition 2/3 (from SLURM_ARRAY_TASK_ID=3 of 1-3)" in outputs[2]
    for index, output in enumerate(outputs):
        assert f"progress: partition {index}/3: input files" in output

    # The files, read by Megatron's reader in blend order, are the plain encoding of every document.
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    listing = resolve_inputs([str(subset_corpus)])
    expected = [tokenizer.encode(doc.text) + [tokenizer.eod_id]
                for path in listing for doc in read_documents(path, "text", lambda record: None)]
    written = []
    for name in names:
        dataset = IndexedDataset(str(one_partition / f"{name}_text_document"))
        meta = read_dataset_meta(one_partition / f"{name}_text_document")
        assert meta.tokens <= 12000 and meta.documents == len(dataset)
        written += [dataset[i].tolist() for i in range(len(dataset))]
    assert written == expected


@pytest.mark.launch
def test_manifests_count_documents_tokens_and_dropped_records_per_subset(one_partition: Path, three_partitions):
    folder, outputs = three_partitions
    reference = read_manifest(one_partition / "cc_partition-00000-of-00001.json").subsets()
    assert set(reference) == {HIGH, MEDIUM, LOW, TINY}
    assert [(reference[s].input_files, reference[s].documents) for s in (HIGH, MEDIUM, LOW)] == [
        (3, 3 * DOCUMENTS_PER_FILE), (2, 2 * DOCUMENTS_PER_FILE), (2, 2 * DOCUMENTS_PER_FILE)]
    assert reference[MEDIUM].dropped == {"malformed_json": 1, "missing_key": 1} and not reference[HIGH].dropped
    merged = {}
    for path in sorted(folder.glob("cc_partition-*-of-00003.json")):
        for subset, stats in read_manifest(path).subsets().items():
            merged.setdefault(subset, []).append(stats)
    for subset, parts in merged.items():
        assert sum(s.tokens for s in parts) == reference[subset].tokens
        assert sum(s.documents for s in parts) == reference[subset].documents
    summary_lines = "\n".join(outputs)
    assert f"subset {MEDIUM}: input_files=" in summary_lines and "dropped=2 (malformed_json=1, missing_key=1)" in summary_lines


def run_main(args: list, capsys) -> tuple[int, str]:
    code = preprocess_data.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def blend_lines(path: Path) -> list[tuple[float, str]]:
    return [(float(weight), Path(prefix).name) for weight, prefix in
            (line.split() for line in path.read_text().splitlines())]


@pytest.mark.trains
@pytest.mark.launch
def test_merge_writes_a_token_weighted_blend_that_trains(one_partition: Path, three_partitions,
                                                         sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    folder, _ = three_partitions
    weights = ["--subset-weights", "high=2,synthetic=0.5"]
    code, out = run_main(["--merge-manifests", str(folder / "cc_partition-*-of-00003.json"),
                          "--data-args-path", tmp_path / "cc.data_args", *weights], capsys)
    assert code == 0, out
    assert f"subset {HIGH}:" in out and "weight x2" in out and "merged 3 partition(s)" in out
    code, out = run_main(["--merge-manifests", one_partition / "cc_partition-00000-of-00001.json",
                          "--data-args-path", tmp_path / "one.data_args", *weights], capsys)
    assert code == 0, out
    blend = blend_lines(tmp_path / "cc.data_args")
    assert blend == blend_lines(tmp_path / "one.data_args")
    # high, high, low, medium, tiny
    multiplier = {"cc_000000": 2.0, "cc_000001": 2.0, "cc_000002": 0.5, "cc_000003": 1.0, "cc_000004": 1.0}
    assert blend == [(read_dataset_meta(folder / name).tokens * multiplier[name[:9]], name)
                     for name in sorted(p.name[:-len(".meta.json")] for p in folder.glob("cc_*.meta.json"))]

    run_dir = tmp_path / "run"
    result = launch_ranks(PRETRAIN, 1, [
        "--ds_config", str(DS_CONFIGS["adamw"]), "--model", "tiny", "--data-args-path", str(tmp_path / "cc.data_args"),
        "--tokenizer-model", str(sentencepiece_model), "--train-iters", "10", "--log-interval", "1",
        "--eval-interval", "10", "--eval-iters", "1", "--run-dir", str(run_dir)]).check("training on the blend")
    assert "data: training and validation: blend of 8 prefixes" in result.output
    # The one-document piece trains, and is left out of validation, where --split 98,2,0 gives it nothing.
    assert ("data: 1 of 8 prefixes hold less than one sample (129 tokens) of the valid split (--split 98,2,0) and "
            "are left out of its blend, the weights renormalized over the other 7: "
            f"{(folder / 'cc_000004_0000_text_document').resolve()}"
            in result.output)
    losses = [record["loss"] for record in read_metrics(run_dir) if "loss" in record]
    assert len(losses) == 10 and all(loss == loss for loss in losses)


def test_a_manifest_nested_100000_levels_deep_is_one_line_naming_it(tmp_path: Path, capsys):
    deep = tmp_path / "cc_partition-00000-of-00001.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    code, out = run_main(["--merge-manifests", deep, "--data-args-path", tmp_path / "blend"], capsys)
    assert (code, out) == (1, f"preprocess_data: error: manifest {deep} is not JSON: JSON nested deeper than 64 "
                              "levels\n")


def copy_manifests(folder: Path, into: Path) -> list[Path]:
    into.mkdir()
    return [Path(shutil.copy(path, into)) for path in sorted(folder.glob("cc_partition-*-of-00003.json"))]


@pytest.mark.launch
def test_merge_refuses_an_input_file_covered_twice_or_not_at_all(three_partitions, tmp_path: Path, capsys):
    folder, _ = three_partitions
    manifests = copy_manifests(folder, tmp_path / "copies")
    first_file = json.loads(manifests[0].read_text())["groups"][0]["input_files"][0]

    code, out = run_main(["--merge-manifests", *manifests[1:], "--data-args-path", tmp_path / "blend"], capsys)
    assert code == 1 and "no manifest for partition(s) 0 of 3" in out and "covered by no partition" in out
    assert first_file in out
    shutil.copy(manifests[1], tmp_path / "copies" / "duplicate.json")
    code, out = run_main(["--merge-manifests", *manifests, tmp_path / "copies" / "duplicate.json",
                          "--data-args-path", tmp_path / "blend"], capsys)
    assert code == 1 and "is covered twice" in out

    # A partition that skipped a group: its input files are named.
    lost = json.loads(manifests[0].read_text())
    lost["groups"] = lost["groups"][1:]
    manifests[0].write_text(json.dumps(lost))
    code, out = run_main(["--merge-manifests", *manifests, "--data-args-path", tmp_path / "blend"], capsys)
    assert code == 1 and "covered by no partition" in out and first_file in out
    # One that claims another's group: the input file is named with both manifests.
    claimed = json.loads(manifests[1].read_text())
    claimed["groups"].append(json.loads((folder / manifests[0].name).read_text())["groups"][0])
    manifests[1].write_text(json.dumps(claimed))
    manifests[0].write_text((folder / manifests[0].name).read_text())
    code, out = run_main(["--merge-manifests", *manifests, "--data-args-path", tmp_path / "blend"], capsys)
    assert code == 1 and f"input file {first_file} is covered twice" in out
    assert not (tmp_path / "blend").exists()


@pytest.mark.launch
def test_merge_refuses_unfinished_partitions_other_runs_and_changed_files(three_partitions, tmp_path: Path, capsys):
    folder, _ = three_partitions
    manifests = copy_manifests(folder, tmp_path / "copies")
    merge = ["--merge-manifests", *manifests, "--data-args-path", tmp_path / "blend"]
    unfinished = json.loads(manifests[2].read_text())
    unfinished["complete"] = False
    manifests[2].write_text(json.dumps(unfinished))
    code, out = run_main(merge, capsys)
    assert code == 1 and "partition 2/3 is not finished" in out and "rerun it" in out

    other_run = {**unfinished, "complete": True, "run": {**unfinished["run"], "json_key": "body"}}
    manifests[2].write_text(json.dumps(other_run))
    code, out = run_main(merge, capsys)
    assert code == 1 and "not partitions of one run" in out and "json_key" in out

    manifests[2].write_text("{not json")
    code, out = run_main(merge, capsys)
    assert code == 1 and f"manifest {manifests[2]} is not JSON" in out
    without_stats = json.loads((folder / manifests[2].name).read_text())
    del without_stats["groups"][0]["stats"]
    manifests[2].write_text(json.dumps(without_stats))
    code, out = run_main(merge, capsys)
    assert code == 1 and f"{manifests[2]}.groups[0]: expected an object with keys" in out

    # The copies name files beside them, which are not there.
    manifests[2].write_text((folder / manifests[2].name).read_text())
    code, out = run_main(merge, capsys)
    assert code == 1 and "output file" in out and "is missing" in out


@pytest.mark.launch
def test_a_killed_partition_resumes_its_unfinished_groups(one_partition: Path, subset_corpus: Path,
                                                          sentencepiece_model: Path, tmp_path: Path,  # noqa: F811
                                                          capsys, monkeypatch, no_slurm):
    folder = tmp_path / "not_yet_made"
    args = tool_args(subset_corpus, folder / "cc", sentencepiece_model, "--chunk-mb", "0.01")
    # The input files sort as high (0-2), low (3-4), medium (5-6): die inside group 2 (files 3 and 4).
    monkeypatch.setenv(KILL_HOOK_ENV, "4:0:5")
    code, out = run_main(args, capsys)
    assert code == 1 and "tokenizing process died" in out
    manifest = read_manifest(folder / "cc_partition-00000-of-00001.json")
    assert not manifest.complete and [group.index for group in manifest.groups] == [0, 1]
    finished = {path: path.stat().st_mtime_ns for path in folder.glob("cc_00000[01]_*")}

    monkeypatch.delenv(KILL_HOOK_ENV)
    code, out = run_main(args, capsys)
    assert code == 0, out
    assert "reuses 2 finished group(s) of 5" in out and "resuming: reused" in out  # and group 2's first chunks
    assert finished == {path: path.stat().st_mtime_ns for path in finished}
    assert dataset_files(folder) == dataset_files(one_partition)
    assert read_manifest(folder / "cc_partition-00000-of-00001.json").complete
    assert not list(folder.glob("*.parts"))


def test_bad_partition_flags_are_refused(subset_corpus: Path, sentencepiece_model: Path, tmp_path: Path,  # noqa: F811
                                         capsys, monkeypatch, no_slurm):
    def refused(args: list[str]) -> str:
        with pytest.raises(SystemExit):
            preprocess_data.parse_args(args)
        return capsys.readouterr().err

    for flags, message in ((["--partition", "3/3"], "the index must be in 0..2"),
                           (["--partition", "1-3"], "--partition takes I/N"),
                           (["--input-files-per-output", "0"], "--input-files-per-output must be at least 1"),
                           (["--data-args-path", "x"], "belong to --merge-manifests")):
        assert message in refused(tool_args(subset_corpus, tmp_path / "cc", sentencepiece_model, *flags))
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert "SLURM_ARRAY_TASK_MIN" in refused(tool_args(subset_corpus, tmp_path / "cc", sentencepiece_model))
    assert "needs --data-args-path" in refused(["--merge-manifests", "m.json"])
    assert "drop --input" in refused(["--merge-manifests", "m.json", "--data-args-path", "b", "--input", "x"])


def test_former_flag_spellings_still_work(subset_corpus: Path, sentencepiece_model: Path, tmp_path: Path,  # noqa: F811
                                          no_slurm):
    config = preprocess_data.parse_args(["--input", str(subset_corpus), "--output-prefix", str(tmp_path / "cc"),
                                         "--tokenizer-model", str(sentencepiece_model), "--shards-per-file", "3",
                                         "--workers", "2"])
    assert (config.input_files_per_output, config.processes) == (3, 2)
    merge = preprocess_data.parse_args(["--merge-manifests", "m.json", "--data-args-path", "b",
                                        "--bucket-weights", "high=2"])
    assert merge.subset_weights == "high=2"


def as_format_1(manifest: str) -> str:
    """A manifest as format 1 wrote it, before input files and subsets were called so."""
    for new, old in (('"input_files_per_output"', '"shards_per_file"'), ('"input_files"', '"shards"'),
                     ('"subsets"', '"buckets"'), ('"subset"', '"bucket"'), (FORMAT, FORMAT_1)):
        assert new in manifest
        manifest = manifest.replace(new, old)
    return manifest


@pytest.mark.launch
def test_a_format_1_manifest_still_merges_and_resumes(one_partition: Path, subset_corpus: Path,
                                                      sentencepiece_model: Path, tmp_path: Path,  # noqa: F811
                                                      capsys, no_slurm):
    folder = tmp_path / "format_1"
    shutil.copytree(one_partition, folder)
    manifest = folder / "cc_partition-00000-of-00001.json"
    manifest.write_text(as_format_1(manifest.read_text()))
    assert read_manifest(manifest) == read_manifest(one_partition / manifest.name)
    with_kinds = json.loads(manifest.read_text())
    with_kinds["groups"][0]["stats"]["dropped"] = {"empty_shard": 1, "unreadable_shard": 2}
    (tmp_path / "kinds.json").write_text(json.dumps(with_kinds))
    assert read_manifest(tmp_path / "kinds.json").groups[0].stats.dropped == {"empty_file": 1, "unreadable_file": 2}

    code, out = run_main(["--merge-manifests", manifest, "--data-args-path", tmp_path / "old.data_args",
                          "--subset-weights", "high=2"], capsys)
    assert code == 0, out
    code, out = run_main(["--merge-manifests", one_partition / manifest.name, "--data-args-path",
                          tmp_path / "new.data_args", "--subset-weights", "high=2"], capsys)
    assert code == 0, out
    assert blend_lines(tmp_path / "old.data_args") == blend_lines(tmp_path / "new.data_args")

    # A rerun finds every group finished (the fingerprints did not change with the names) and rewrites the
    # manifest in today's format.
    written = {path: path.stat().st_mtime_ns for path in folder.glob("cc_*_text_document.*")}
    code, out = run_main(tool_args(subset_corpus, folder / "cc", sentencepiece_model), capsys)
    assert code == 0, out
    assert "reuses 5 finished group(s) of 5" in out
    assert written == {path: path.stat().st_mtime_ns for path in written}
    assert json.loads(manifest.read_text())["format"] == FORMAT
