"""tools/preprocess_data.py: Megatron-readable output, bad input handling, resume after a kill;
tools/build_demo_corpus.py: its shards feed the preprocessor."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_tokenizer import sentencepiece_model  # noqa: F401 - shared session fixture

from dataprep.shards import read_documents, resolve_inputs
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tools import preprocess_data
from tools.build_demo_corpus import DemoCorpusConfig, build_demo_corpus


def jsonl(*texts: str) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


def non_empty_documents(shard_dir: Path) -> list[str]:
    shards = resolve_inputs([str(shard_dir)])
    return [doc.text for shard in shards for doc in read_documents(shard, "text", print) if doc.text]


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    code = preprocess_data.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def shakespeare_dataset(shakespeare: Path, sentencepiece_model: Path, tmp_path_factory) -> str:  # noqa: F811
    """The sample corpus preprocessed by the real CLI with two workers."""
    prefix = tmp_path_factory.mktemp("shakespeare_dataset") / "shakespeare"
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(shakespeare / "train"),
         "--output-prefix", str(prefix), "--tokenizer-model", str(sentencepiece_model), "--workers", "2"],
        cwd=Path(preprocess_data.__file__).parents[1], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "done: shards=8" in result.stdout
    assert not Path(f"{prefix}_text_document.parts").exists()  # cleaned up after the merge
    return f"{prefix}_text_document"


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
    """One shard per kind of bad input, each with good neighbours, plus good gzip and parquet shards."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a_mixed.jsonl").write_bytes(
        jsonl("good one")
        + b'{"text": "unterminated\n'              # line 2: malformed JSON
        + b'{"content": "wrong key"}\n'            # line 3: missing key
        + b'{"text": 42}\n'                        # line 4: not a string
        + b'{"text": "bad byte \xff here"}\n'      # line 5: invalid UTF-8
        + jsonl("", "good two")                    # line 6: empty document, line 7: good
    )
    (corpus / "b_empty.jsonl.zst").write_bytes(b"")
    whole = zstandard.ZstdCompressor().compress(jsonl(*(f"doc {i} " * 50 for i in range(2000))))
    (corpus / "c_truncated.jsonl.zstd").write_bytes(whole[: len(whole) // 2])
    (corpus / "d_good.jsonl.gz").write_bytes(gzip.compress(jsonl("gzip doc")))
    pq.write_table(pa.table({"text": ["parquet doc", None], "id": [1, 2]}), corpus / "e_good.parquet")
    return corpus


def test_bad_records_are_counted_and_good_neighbours_kept(
    messy_corpus: Path, sentencepiece_model: Path, tmp_path: Path, capsys  # noqa: F811
):
    prefix = tmp_path / "out" / "messy"
    code, out, err = run_main(
        ["--input", messy_corpus, "--output-prefix", prefix, "--tokenizer-model", sentencepiece_model], capsys
    )
    assert code == 0, err
    mixed, truncated = messy_corpus / "a_mixed.jsonl", messy_corpus / "c_truncated.jsonl.zstd"
    for report in (f"{mixed}:2: malformed_json", f"{mixed}:3: missing_key", f"{mixed}:4: non_string_text",
                   f"{mixed}:5: invalid_utf8", f"{messy_corpus / 'b_empty.jsonl.zst'}:0: empty_shard",
                   f"{truncated}:", "truncated", f"{messy_corpus / 'e_good.parquet'}:2: missing_key"):
        assert report in err
    assert "empty_documents=1" in out and "bad_records=7" in out

    dataset = IndexedDataset(f"{prefix}_text_document")
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    texts = [tokenizer.decode(dataset[i].tolist()[:-1]) for i in range(len(dataset))]
    kept_from_truncated = [text for text in texts if text.startswith("doc ")]
    assert texts[:2] == ["good one", "good two"] and texts[-2:] == ["gzip doc", "parquet doc"]
    assert 0 < len(kept_from_truncated) < 2000
    assert kept_from_truncated == [f"doc {i} " * 50 for i in range(len(kept_from_truncated))]


def test_strict_fails_on_first_bad_record(messy_corpus: Path, sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    prefix = tmp_path / "strict"
    code, _, err = run_main(["--input", messy_corpus / "a_mixed.jsonl", "--output-prefix", prefix,
                             "--tokenizer-model", sentencepiece_model, "--strict"], capsys)
    assert code != 0
    assert f"{messy_corpus / 'a_mixed.jsonl'}:2: malformed_json" in err
    assert not Path(f"{prefix}_text_document.bin").exists()


def test_input_matching_nothing_is_an_error(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    pattern = str(tmp_path / "nowhere" / "*.jsonl.zstd")
    code, _, err = run_main(["--input", pattern, "--output-prefix", tmp_path / "x",
                             "--tokenizer-model", sentencepiece_model], capsys)
    assert code != 0 and pattern in err


def test_resume_after_kill_redoes_only_unfinished_shards(
    shakespeare: Path, shakespeare_dataset: str, sentencepiece_model: Path, tmp_path: Path, capsys, monkeypatch  # noqa: F811
):
    prefix = tmp_path / "resumed"
    args = ["--input", shakespeare / "train", "--output-prefix", prefix,
            "--tokenizer-model", sentencepiece_model, "--workers", "1", "--keep-parts"]
    parts = Path(f"{prefix}_text_document.parts")

    monkeypatch.setenv(preprocess_data.KILL_HOOK_ENV, "3:10")  # SIGKILL the worker inside shard 3
    code, _, err = run_main(args, capsys)
    assert code != 0 and "worker process died" in err
    assert not Path(f"{prefix}_text_document.bin").exists()
    assert not Path(f"{prefix}_text_document.idx").exists()
    finished = sorted(parts.glob("shard-*.json"))
    assert [path.name for path in finished] == ["shard-00000.json", "shard-00001.json", "shard-00002.json"]
    mtimes = {path: os.stat(path).st_mtime_ns for path in parts.glob("shard-0000[012].*")}

    monkeypatch.delenv(preprocess_data.KILL_HOOK_ENV)
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "resuming: 3 of 8 shards already done" in err and "(reused 3)" in out
    assert mtimes == {path: os.stat(path).st_mtime_ns for path in mtimes}
    for suffix in (".bin", ".idx"):
        assert Path(f"{prefix}_text_document{suffix}").read_bytes() == Path(shakespeare_dataset + suffix).read_bytes()


def test_changed_json_key_invalidates_parts(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    shard = tmp_path / "both.jsonl"
    shard.write_text(json.dumps({"text": "alpha", "body": "beta gamma"}) + "\n")
    args = ["--input", shard, "--output-prefix", tmp_path / "keyed", "--tokenizer-model", sentencepiece_model,
            "--keep-parts"]
    assert run_main(args, capsys)[0] == 0
    code, _, err = run_main(args + ["--json-key", "body"], capsys)
    assert code == 0 and "resuming" not in err
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    dataset = IndexedDataset(str(tmp_path / "keyed_text_document"))  # must outlive its mmap'ed items
    assert dataset[0].tolist()[:-1] == tokenizer.encode("beta gamma")


def test_demo_corpus_feeds_preprocessing(sentencepiece_model: Path, tmp_path: Path, capsys):  # noqa: F811
    counts = build_demo_corpus(DemoCorpusConfig(tmp_path / "demo", max_mb=0.3, train_shards=2))
    assert counts["train"] > 10 and counts["valid"] > 0
    assert len(list((tmp_path / "demo" / "train").glob("*.jsonl.zstd"))) == 2
    code, out, err = run_main(["--input", tmp_path / "demo" / "train", "--output-prefix", tmp_path / "demo_tok",
                               "--tokenizer-model", sentencepiece_model, "--workers", "2"], capsys)
    assert code == 0, err
    assert "bad_records=0" in out
    assert len(IndexedDataset(str(tmp_path / "demo_tok_text_document"))) == counts["train"]
