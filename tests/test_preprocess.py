"""tools/preprocess_data.py: Megatron-readable output, bad input handling, chunked output identical to one
pass, resume after a kill, the .meta.json, Megatron's flag spellings; tools/build_demo_corpus.py: its input
files feed the preprocessor."""
import gzip
import importlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_tokenizer import sentencepiece_model  # noqa: F401 - shared session fixture

from dataprep.chunks import Chunk
from dataprep.dataset_meta import read_dataset_meta
from dataprep.input_files import read_documents, resolve_inputs
from dataprep.progress import ProgressLine
from tokenizer.identity import tokenizer_identity
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tools import preprocess_data
from tools.build_demo_corpus import DemoCorpusConfig, build_demo_corpus, module_document
from tools.preprocessing import dispatch
from tools.preprocessing.config import PreprocessConfig
from tools.preprocessing.run import run_preprocess
from tools.preprocessing.tokenize_worker import KILL_HOOK_ENV, StrictModeError


def jsonl(*texts: str) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


def non_empty_documents(inputs: Path) -> list[str]:
    paths = resolve_inputs([str(inputs)])
    return [doc.text for path in paths for doc in read_documents(path, "text", print) if doc.text]


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    code = preprocess_data.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def shakespeare_dataset(shakespeare: Path, sentencepiece_model: Path, tmp_path_factory) -> str:  # noqa: F811
    """The sample corpus preprocessed by the real CLI with two processes."""
    prefix = tmp_path_factory.mktemp("shakespeare_dataset") / "shakespeare"
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(shakespeare / "train"),
         "--output-prefix", str(prefix), "--tokenizer-model", str(sentencepiece_model), "--processes", "2"],
        cwd=Path(preprocess_data.__file__).parents[1], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "done: input_files=8 chunks=8" in result.stdout
    assert not Path(f"{prefix}_text_document.parts").exists()  # cleaned up after the merge
    return f"{prefix}_text_document"


@pytest.mark.launch
def test_shakespeare_readable_by_megatron(shakespeare_dataset: str, shakespeare: Path, sentencepiece_model: Path):  # noqa: F811
    dataset = IndexedDataset(shakespeare_dataset)
    texts = non_empty_documents(shakespeare / "train")
    assert len(dataset) == len(texts) == len(dataset.document_indices) - 1
    assert dataset.index.dtype == np.uint16
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    for index in (0, 1, len(texts) // 2, len(texts) - 1):
        expected = tokenizer.encode(texts[index]) + [tokenizer.eod_id]
        assert dataset[index].tolist() == expected


@pytest.fixture
def messy_corpus(tmp_path: Path) -> Path:
    """One input file per kind of bad input, each with good neighbours, plus good gzip and parquet files."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a_mixed.jsonl").write_bytes(
        jsonl("good one")
        + b'{"text": "unterminated\n'              # line 2: malformed JSON
        + b'{"content": "wrong key"}\n'            # line 3: missing key
        + b'{"text": 42}\n'                        # line 4: not a string
        + b'{"text": "bad byte \xff here"}\n'      # line 5: invalid UTF-8
        + jsonl("", "good two")                    # line 6: empty document, line 7: good
        + b'{"text": "lone \\ud800 surrogate"}\n'   # line 8: a lone surrogate no tokenizer can encode
    )
    (corpus / "b_empty.jsonl.zst").write_bytes(b"")
    whole = zstandard.ZstdCompressor().compress(jsonl(*(f"doc {i} " * 500 for i in range(200))))
    (corpus / "c_truncated.jsonl.zstd").write_bytes(whole[: len(whole) // 2])
    (corpus / "d_good.jsonl.gz").write_bytes(gzip.compress(jsonl("gzip doc")))
    pq.write_table(pa.table({"text": ["parquet doc", None], "id": [1, 2]}), corpus / "e_good.parquet")
    return corpus


@pytest.mark.parametrize("chunking", [[], ["--processes", "2", "--chunk-mb", "0.00002"]],
                         ids=["per_file", "chunk_per_line"])
@pytest.mark.launch
def test_bad_records_are_counted_and_good_neighbours_kept(
    messy_corpus: Path, sentencepiece_model: Path, tmp_path: Path, capsys, chunking  # noqa: F811
):
    prefix = tmp_path / "out" / "messy"
    code, out, err = run_main(
        ["--input", messy_corpus, "--output-prefix", prefix, "--tokenizer-model", sentencepiece_model, *chunking], capsys
    )
    assert code == 0, err
    mixed, truncated = messy_corpus / "a_mixed.jsonl", messy_corpus / "c_truncated.jsonl.zstd"
    # Line numbers are the input file's, however it was cut into chunks.
    for report in (f"{mixed}:2: malformed_json", f"{mixed}:3: missing_key", f"{mixed}:4: non_string_text",
                   f"{mixed}:5: invalid_utf8", f"{mixed}:8: lone_surrogate",
                   f"{messy_corpus / 'b_empty.jsonl.zst'}:0: empty_file",
                   f"{truncated}:", "truncated", f"{messy_corpus / 'e_good.parquet'}:2: missing_key"):
        assert report in err
    assert "empty_documents=1" in out and "bad_records=8" in out and "lone_surrogate=1" in out

    dataset = IndexedDataset(f"{prefix}_text_document")
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    texts = [tokenizer.decode(dataset[i].tolist()[:-1]) for i in range(len(dataset))]
    kept_from_truncated = [text for text in texts if text.startswith("doc ")]
    assert texts[:2] == ["good one", "good two"] and texts[-2:] == ["gzip doc", "parquet doc"]
    assert 0 < len(kept_from_truncated) < 200
    assert kept_from_truncated == [f"doc {i} " * 500 for i in range(len(kept_from_truncated))]


@pytest.mark.parametrize("chunking", [[], ["--chunk-mb", "0.00002"]], ids=["per_file", "chunk_per_line"])
@pytest.mark.launch
def test_strict_fails_on_first_bad_record(messy_corpus: Path, sentencepiece_model: Path, tmp_path: Path, capsys,  # noqa: F811
                                          chunking):
    prefix = tmp_path / "strict"
    code, _, err = run_main(["--input", messy_corpus / "a_mixed.jsonl", "--output-prefix", prefix,
                             "--tokenizer-model", sentencepiece_model, "--strict", *chunking], capsys)
    assert code != 0
    assert f"{messy_corpus / 'a_mixed.jsonl'}:2: malformed_json" in err
    assert not Path(f"{prefix}_text_document.bin").exists()


def _strict_chunk_failing_late_when_first(chunk, payload, prefix):
    """A pool task (forked, so it can live here) for which every chunk holds a bad record on its first
    line, and the first chunk is the slowest to find it."""
    if chunk.index == 0:
        time.sleep(1.0)
    raise StrictModeError(f"bad record (--strict): {chunk.path}:{chunk.records_before + 1}: kind")


@pytest.mark.parametrize("planner_fails", [False, True], ids=["in_a_chunk", "in_the_planner"])
@pytest.mark.launch
def test_strict_reports_the_first_bad_record_in_input_order_when_chunks_finish_out_of_order(monkeypatch,
                                                                                          planner_fails):
    """Chunk 1's bad record is found first, chunk 0's a second later: the error is chunk 0's, also when
    the planner meets a bad record of its own (after every chunk handed out) meanwhile."""
    monkeypatch.setattr(dispatch, "init_process", lambda config, progress_queue: None)
    monkeypatch.setattr(dispatch, "tokenize_chunk", _strict_chunk_failing_late_when_first)
    chunks = [Chunk(0, i, Path("a.jsonl"), i, i + 1, i) for i in range(3)]
    progress = ProgressLine("test", 1, 3, stream=io.StringIO())
    with pytest.raises(StrictModeError, match=r"a.jsonl:1: kind"):
        with dispatch.ChunkDispatcher(SimpleNamespace(processes=3), np.uint16, lambda c, s: None,
                                      progress) as chunks_out:
            for chunk in chunks:
                chunks_out.submit(chunk, None, "fingerprint", "prefix")
            if planner_fails:
                time.sleep(0.3)  # chunks 1 and 2 have failed by now
                raise StrictModeError("bad record (--strict): b.jsonl:0: empty_file")
            chunks_out.finish()


def test_input_matching_nothing_is_an_error(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    pattern = str(tmp_path / "nowhere" / "*.jsonl.zstd")
    code, _, err = run_main(["--input", pattern, "--output-prefix", tmp_path / "x",
                             "--tokenizer-model", sentencepiece_model], capsys)
    assert code != 0 and pattern in err


@pytest.mark.launch
def test_changed_json_key_invalidates_parts(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"text": "alpha", "body": "beta gamma"}) + "\n")
    args = ["--input", both, "--output-prefix", tmp_path / "keyed", "--tokenizer-model", sentencepiece_model,
            "--keep-parts"]
    assert run_main(args, capsys)[0] == 0
    code, _, err = run_main(args + ["--json-key", "body"], capsys)
    assert code == 0 and "resuming" not in err
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    dataset = IndexedDataset(str(tmp_path / "keyed_text_document"))  # must outlive its mmap'ed items
    assert dataset[0].tolist()[:-1] == tokenizer.encode("beta gamma")


@pytest.mark.launch
def test_demo_corpus_feeds_preprocessing(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    counts = build_demo_corpus(DemoCorpusConfig(tmp_path / "demo", max_mb=0.3, train_files=2))
    assert counts["train"] > 10 and counts["valid"] > 0
    assert len(list((tmp_path / "demo" / "train").glob("*.jsonl.zstd"))) == 2
    code, out, err = run_main(["--input", tmp_path / "demo" / "train", "--output-prefix", tmp_path / "demo_tok",
                               "--tokenizer-model", sentencepiece_model, "--processes", "2"], capsys)
    assert code == 0, err
    assert "bad_records=0" in out
    assert len(IndexedDataset(str(tmp_path / "demo_tok_text_document"))) == counts["train"]


def test_demo_corpus_shows_defaults_as_written_not_this_processs_values(tmp_path: Path, monkeypatch):
    (tmp_path / "defaults_demo.py").write_text(
        "import os\nimport sys\n\n\ndef read(env=os.environ, python=sys.executable, *, size=2 ** 10):\n"
        "    \"\"\"Reads.\"\"\"\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DEMO_CORPUS_SECRET", "hunter2")
    document = module_document(importlib.import_module("defaults_demo"))
    assert "function read(env=os.environ, python=sys.executable, *, size=2 ** 10)\n\nReads." in document
    assert "hunter2" not in document and sys.executable not in document


def test_demo_corpus_is_byte_identical_under_another_environment(tmp_path: Path, monkeypatch):
    """The corpus's records are keyed by its content: another machine (its environment variables, working
    directory) must build the same bytes, and no variable's value may leak into the text."""
    build_demo_corpus(DemoCorpusConfig(tmp_path / "here", max_mb=1.0, train_files=1))
    monkeypatch.setenv("DEMO_CORPUS_SECRET", "hunter2")
    monkeypatch.chdir(tmp_path)
    build_demo_corpus(DemoCorpusConfig(tmp_path / "there", max_mb=1.0, train_files=1))
    files = sorted(p.relative_to(tmp_path / "here") for p in (tmp_path / "here").rglob("*.zstd"))
    assert len(files) == 2
    for file in files:
        content = (tmp_path / "here" / file).read_bytes()
        assert content == (tmp_path / "there" / file).read_bytes(), file
        assert b"hunter2" not in zstandard.ZstdDecompressor().decompress(content, max_output_size=1 << 26)


# ---------------------------------------------------------------------------------------------
# Chunks: processes share one input file; the output does not depend on how files are cut or who tokenizes.


@pytest.fixture(scope="module")
def mixed_corpus(shakespeare: Path, tmp_path_factory) -> Path:
    """The same real text as one uncompressed JSONL, one zstd JSONL, and a parquet file of many row groups."""
    corpus = tmp_path_factory.mktemp("mixed_corpus")
    files = sorted((shakespeare / "train").glob("*.jsonl.zstd"))
    plain = b"".join(zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()) for path in files[:2])
    (corpus / "big.jsonl").write_bytes(plain)
    (corpus / "big.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain))
    rows = non_empty_documents(files[2])
    pq.write_table(pa.table({"text": rows}), corpus / "rows.parquet", row_group_size=16)
    return corpus


@pytest.fixture(scope="module")
def one_chunk_per_file(mixed_corpus: Path, sentencepiece_model: Path, tmp_path_factory) -> str:  # noqa: F811
    """The reference: one process, each input file read in one pass."""
    prefix = tmp_path_factory.mktemp("reference") / "ref"
    config = PreprocessConfig(inputs=(str(mixed_corpus),), output_prefix=str(prefix),
                              tokenizer_model=sentencepiece_model, chunk_bytes=10**12)
    summary = run_preprocess(config)
    assert summary.chunks == summary.input_files == 3
    return config.dataset_prefix


def same_files(a: str, b: str) -> bool:
    return all(Path(a + suffix).read_bytes() == Path(b + suffix).read_bytes() for suffix in (".bin", ".idx", ".meta.json"))


@pytest.mark.launch
def test_chunked_with_two_processes_is_byte_identical_to_one_pass(
    mixed_corpus: Path, one_chunk_per_file: str, sentencepiece_model: Path, tmp_path: Path, capsys  # noqa: F811
):
    code, out, err = run_main(["--input", mixed_corpus, "--output-prefix", tmp_path / "chunked", "--tokenizer-model",
                               sentencepiece_model, "--processes", "2", "--chunk-mb", "0.1"], capsys)
    assert code == 0, err
    chunks = int(out.split("chunks=")[1].split()[0])
    assert chunks > 20  # ~1.2 MB of JSONL twice over, cut into 0.1 MB chunks, plus the parquet's row groups
    assert same_files(str(tmp_path / "chunked_text_document"), one_chunk_per_file)
    # ... and the one-pass output is the plain per-document encoding, in file order.
    dataset = IndexedDataset(one_chunk_per_file)
    texts = non_empty_documents(mixed_corpus / "big.jsonl")
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    assert len(dataset) == 2 * len(texts) + len(non_empty_documents(mixed_corpus / "rows.parquet"))
    for index in (0, len(texts) - 1, len(texts), len(dataset) - 1):
        expected = texts[index % len(texts)] if index < 2 * len(texts) else non_empty_documents(mixed_corpus / "rows.parquet")[-1]
        assert dataset[index].tolist() == tokenizer.encode(expected) + [tokenizer.eod_id]


@pytest.mark.launch
def test_resume_after_kill_redoes_only_unfinished_chunks(
    mixed_corpus: Path, one_chunk_per_file: str, sentencepiece_model: Path, tmp_path: Path, capsys, monkeypatch  # noqa: F811
):
    prefix = tmp_path / "resumed"
    args = ["--input", mixed_corpus, "--output-prefix", prefix, "--tokenizer-model", sentencepiece_model,
            "--processes", "1", "--chunk-mb", "0.2", "--keep-parts"]
    parts = Path(f"{prefix}_text_document.parts")

    # The inputs sort as big.jsonl (0), big.jsonl.zst (1), rows.parquet (2): die in the third chunk of the zstd file.
    monkeypatch.setenv(KILL_HOOK_ENV, "1:2:10")
    code, _, err = run_main(args, capsys)
    assert code != 0 and "tokenizing process died" in err
    for suffix in (".bin", ".idx", ".meta.json"):
        assert not Path(f"{prefix}_text_document{suffix}").exists()
    assert (parts / "input-00000.json").exists()  # the plain file: planned and finished
    finished_zstd = sorted(path.name for path in parts.glob("input-00001-chunk-*.json"))
    assert finished_zstd == ["input-00001-chunk-00000.json", "input-00001-chunk-00001.json"]
    done_before = sorted(parts.glob("input-00000*")) + sorted(parts.glob("input-00001-chunk-0000[01].*"))
    mtimes = {path: os.stat(path).st_mtime_ns for path in done_before}
    first_file_chunks = len(list(parts.glob("input-00000-chunk-*.json")))
    # The first file's parts as a run before the rename named them ("shard-"): they are reused all the same.
    for path in parts.glob("input-00000*"):
        path.rename(parts / path.name.replace("input-", "shard-"))

    monkeypatch.delenv(KILL_HOOK_ENV)
    code, _, err = run_main(args, capsys)
    assert code == 0, err
    assert f"resuming: reused {first_file_chunks + 2} finished chunks" in err
    assert mtimes == {path: os.stat(path).st_mtime_ns for path in mtimes}
    assert same_files(f"{prefix}_text_document", one_chunk_per_file)


# The tool in a fresh interpreter (this one holds Megatron, which forked processes would inherit), each tokenizing
# process recording what it has imported once its chunk is tokenized.
RECORDING_IMPORTS = """
import json, os, sys
from pathlib import Path
from tools import preprocess_data
from tools.preprocessing import dispatch

tokenize = dispatch.tokenize_chunk

def tokenize_and_record(chunk, payload, prefix):
    result = tokenize(chunk, payload, prefix)
    imported = {name.split(".")[0] for name in sys.modules} & {"megatron", "torch", "transformers", "deepspeed"}
    Path(os.environ["IMPORTS_DIR"], f"{chunk.file_index}-{chunk.index}.json").write_text(json.dumps(sorted(imported)))
    return result

dispatch.tokenize_chunk = tokenize_and_record
sys.exit(preprocess_data.main(sys.argv[1:]))
"""


@pytest.mark.launch
def test_tokenizing_processes_import_no_megatron_and_a_fresh_killed_run_keeps_its_finished_chunks(
    mixed_corpus: Path, one_chunk_per_file: str, sentencepiece_model: Path, tmp_path: Path, capsys  # noqa: F811
):
    """Megatron's .idx code is the parent's, imported beside the first chunks; the chunks that finish meanwhile are
    published all the same when a process dies, and the rerun reuses them."""
    prefix, imports = tmp_path / "fresh", tmp_path / "imports"
    imports.mkdir()
    args = ["--input", mixed_corpus, "--output-prefix", prefix, "--tokenizer-model", sentencepiece_model,
            "--processes", "1", "--chunk-mb", "0.2"]
    env = {**os.environ, "PYTHONPATH": str(Path(preprocess_data.__file__).parents[1]), "IMPORTS_DIR": str(imports),
           KILL_HOOK_ENV: "1:2:10"}  # die in the third chunk of the second input file
    result = subprocess.run([sys.executable, "-c", RECORDING_IMPORTS, *map(str, args)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1 and "tokenizing process died" in result.stderr, result.stderr[-3000:]
    recorded = {path.stem: json.loads(path.read_text()) for path in imports.glob("*.json")}
    assert {"0-0", "1-0", "1-1"} <= set(recorded) and "1-2" not in recorded
    assert all(imported == [] for imported in recorded.values()), recorded

    code, _, err = run_main(args, capsys)
    assert code == 0, err
    assert f"resuming: reused {len(recorded)} finished chunks" in err
    assert same_files(f"{prefix}_text_document", one_chunk_per_file)


# ---------------------------------------------------------------------------------------------
# Unreadable input files, empty results, and the metadata the trainer checks.


@pytest.mark.launch
def test_unreadable_input_files_are_reported_and_skipped(sentencepiece_model: Path, tmp_path: Path,  # noqa: F811
                                                         capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a_good.jsonl").write_bytes(jsonl("kept"))
    pq.write_table(pa.table({"body": ["no text column"]}), corpus / "b_no_text.parquet")
    (corpus / "c_fake.parquet").write_bytes(b'{"text": "this is JSON, not parquet"}\n')
    (corpus / "d_fake.jsonl.gz").write_bytes(b"not gzip at all\n")
    code, out, err = run_main(["--input", corpus, "--output-prefix", tmp_path / "out",
                               "--tokenizer-model", sentencepiece_model, "--processes", "2"], capsys)
    assert code == 0, err
    lines = err.splitlines()
    for name, kind in (("b_no_text.parquet", "missing_column: no 'text' column"),
                       ("c_fake.parquet", "unreadable_file"), ("d_fake.jsonl.gz", "unreadable_file")):
        reports = [line for line in lines if str(corpus / name) in line]
        assert len(reports) == 1 and f"{corpus / name}:0: {kind}" in reports[0], reports
    assert "Traceback" not in err and "documents=1 " in out
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))  # must outlive its mmap'ed items
    assert SentencePieceTokenizer(sentencepiece_model).decode(dataset[0].tolist()[:-1]) == "kept"


def test_zero_documents_is_an_error(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    pq.write_table(pa.table({"body": ["no text column"]}), tmp_path / "no_text.parquet")
    code, _, err = run_main(["--input", tmp_path / "no_text.parquet", "--output-prefix", tmp_path / "out",
                             "--tokenizer-model", sentencepiece_model], capsys)
    assert code != 0
    assert f"{tmp_path / 'no_text.parquet'}:0: missing_column: no 'text' column (columns: body)" in err
    assert "error: no document written" in err
    assert not Path(f"{tmp_path / 'out'}_text_document.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_text.parquet"], "the run left its temporaries"


def test_a_utf8_byte_order_mark_is_not_a_malformed_record(tmp_path: Path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + jsonl("first", "second"))
    bad = []
    assert [doc.text for doc in read_documents(path, "text", bad.append)] == ["first", "second"]
    assert bad == []


@pytest.mark.launch
def test_meta_json_records_the_largest_token_id(shakespeare_dataset: str, sentencepiece_model: Path):  # noqa: F811
    meta = json.loads(Path(f"{shakespeare_dataset}.meta.json").read_text())
    tokens = np.fromfile(f"{shakespeare_dataset}.bin", dtype=np.uint16)
    assert meta == {
        "max_token_id": int(tokens.max()),
        "vocab_size": SentencePieceTokenizer(sentencepiece_model).vocab_size,
        "tokenizer_sha256": tokenizer_identity(SentencePieceTokenizer(sentencepiece_model)),
        "documents": len(IndexedDataset(shakespeare_dataset)),
        "tokens": len(tokens),
    }
    assert read_dataset_meta(shakespeare_dataset).max_token_id == meta["max_token_id"]


@pytest.mark.launch
def test_megatron_flag_spellings(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"text": "alpha", "body": "beta gamma"}) + "\n")
    common = ["--input", both, "--tokenizer-model", sentencepiece_model]
    tokenizer = SentencePieceTokenizer(sentencepiece_model)

    code, _, err = run_main(common + ["--output-prefix", tmp_path / "megatron", "--json-keys", "body", "--append-eod",
                                      "--tokenizer-type", "SentencePieceTokenizer", "--workers", "2"], capsys)
    assert code == 0, err
    megatron = IndexedDataset(str(tmp_path / "megatron_text_document"))
    assert megatron[0].tolist() == tokenizer.encode("beta gamma") + [tokenizer.eod_id]
    code, _, err = run_main(common + ["--output-prefix", tmp_path / "no_eod", "--no-append-eod"], capsys)
    assert code == 0, err
    no_eod = IndexedDataset(str(tmp_path / "no_eod_text_document"))
    assert no_eod[0].tolist() == tokenizer.encode("alpha")

    code, _, err = run_main(common + ["--output-prefix", tmp_path / "x", "--tokenizer-type", "HuggingFaceTokenizer"], capsys)
    assert code != 0 and "is a SentencePieceTokenizer model, not a HuggingFaceTokenizer" in err
    with pytest.raises(SystemExit):
        preprocess_data.parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "m",
                                    "--json-keys", "text", "title"])
    # Megatron's --workers is --processes (the word "worker" names a DiLoCo replica here).
    assert preprocess_data.parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "m",
                                       "--workers", "3"]).processes == 3
