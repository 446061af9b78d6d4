"""Preprocessing holds a bounded amount of any input (dataprep/long_lines.py, dataprep/input_files.py): a record
longer than --max-document-bytes is one bad record naming file and line (or stops the run under --strict),
in every input format and however the input file is cut into chunks; compressed bombs inflate a piece at a time
and their giant lines stream past, within a memory limit far below their size; a compressed file (or parquet
column chunk) inflating past --max-inflate-ratio is cut there, one bad record naming it, while the progress line
shows the records and decompressed bytes read; a record nested 100,000 levels deep is one bad record."""
from __future__ import annotations

import functools
import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_preprocess import jsonl, run_main
from test_tokenizer import sentencepiece_model  # noqa: F401 - shared session fixture

from dataprep import input_files
from dataprep.input_files import read_documents
from dataprep.long_lines import LineLimit
from dataprep.progress import ProgressLine
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tools.preprocessing import run as preprocessing_run

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1000  # --max-document-bytes in the corpus tests
LONG = "x" * 3000


def _reference(data: bytes, max_bytes: int) -> tuple[bytes, list[int]]:
    """What LineLimit must give, from the whole input at once: long lines emptied, their numbers."""
    *lines, last = data.split(b"\n")
    long = [number for number, line in enumerate([*lines, last], start=1) if len(line) > max_bytes]
    kept = b"".join((b"" if len(line) > max_bytes else line) + b"\n" for line in lines)
    return kept + (b"\n" if len(last) > max_bytes else last), long


def test_line_limit_streams_as_the_whole_input_would_be_cut():
    rng = random.Random(0)
    for _ in range(400):
        max_bytes = rng.randint(0, 12)
        data = b"".join(rng.choice([b"a", b"\n", b"bc", b"\n\n"]) * rng.randint(0, 9) for _ in range(rng.randint(0, 12)))
        long: list[int] = []
        limit = LineLimit(max_bytes, long.append)
        kept, position = b"", 0
        while position < len(data):  # fed in random pieces, as reads and decompression hand them over
            step = rng.randint(1, 7)
            kept += limit.feed(data[position:position + step])
            position += step
        assert (kept + limit.finish(), long) == _reference(data, max_bytes), (max_bytes, data)


@pytest.fixture
def long_records(tmp_path: Path) -> Path:
    """Each format with an over-long record between good ones."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = jsonl("first", LONG, "third")  # line 2 is 3012 bytes
    (corpus / "a.jsonl").write_bytes(lines)
    (corpus / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (corpus / "c.jsonl.zstd").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": ["parquet one", LONG]}), corpus / "d.parquet")
    return corpus


@pytest.mark.parametrize("chunking", [[], ["--processes", "2", "--chunk-mb", "0.00002"]], ids=["per_file", "chunk_per_line"])
@pytest.mark.launch
def test_an_over_long_record_is_a_bad_record_with_file_and_line(long_records, sentencepiece_model, tmp_path, capsys,  # noqa: F811
                                                                 chunking):
    prefix = tmp_path / "out" / "long"
    code, out, err = run_main(["--input", long_records, "--output-prefix", prefix, "--tokenizer-model",
                               sentencepiece_model, "--max-document-bytes", LIMIT, *chunking], capsys)
    assert code == 0, err
    for name, line in (("a.jsonl", 2), ("b.jsonl.gz", 2), ("c.jsonl.zstd", 2), ("d.parquet", 2)):
        assert f"{long_records / name}:{line}: oversize_record: " in err
    assert "bad_records=4 (oversize_record=4)" in out
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert [tokenizer.decode(dataset[i].tolist()[:-1]) for i in range(len(dataset))] == [
        "first", "third", "first", "third", "first", "third", "parquet one"]


def test_strict_stops_at_an_over_long_record(long_records, sentencepiece_model, tmp_path, capsys):  # noqa: F811
    code, _, err = run_main(["--input", long_records / "b.jsonl.gz", "--output-prefix", tmp_path / "strict",
                             "--tokenizer-model", sentencepiece_model, "--max-document-bytes", LIMIT, "--strict"], capsys)
    assert code == 1
    assert err.strip().endswith(f"bad record (--strict): {long_records / 'b.jsonl.gz'}:2: oversize_record: line longer "
                                f"than {LIMIT} bytes (--max-document-bytes): dropped unread")


BOMB_LINE_BYTES = 256 << 20
HEADROOM_BYTES = 96 << 20  # address space granted above what the reader's imports take


def _write_bomb(path: Path) -> None:
    """`first`, then one line of 256 MiB, then `third`: a few hundred KB on disk."""
    with open(path, "wb") as raw:
        stream = (gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) if path.suffix == ".gz"
                  else zstandard.ZstdCompressor(level=1).stream_writer(raw))
        with stream:
            stream.write(b'{"text": "first"}\n{"text": "')
            block = b"a" * (1 << 20)
            for _ in range(BOMB_LINE_BYTES // len(block)):
                stream.write(block)
            stream.write(b'"}\n{"text": "third"}\n')


def _read_within_a_memory_limit(path: Path, max_inflate_ratio: float) -> str:
    """What read_documents gives for `path` ((texts, [(line, kind) of the bad records])), read in a process whose
    address space is limited to HEADROOM_BYTES beyond what its imports took."""
    reader = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        import pyarrow.parquet
        from dataprep.input_files import read_documents
        size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
        limit = size * 1024 + {HEADROOM_BYTES}
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        bad = []
        texts = [document.text for document in read_documents(Path({str(path)!r}), "text", bad.append, 1 << 20,
                                                              {max_inflate_ratio!r})]
        print((texts, [(record.line, record.kind) for record in bad]))
    """).replace("inf)", "float('inf'))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zstd"])
@pytest.mark.launch
def test_a_bomb_streams_within_a_memory_limit(tmp_path, suffix):
    bomb = tmp_path / f"bomb{suffix}"
    _write_bomb(bomb)
    # No inflate bound: the giant line itself must stream past.
    assert _read_within_a_memory_limit(bomb, float("inf")) == str((["first", "third"], [(2, "oversize_record")]))


@pytest.mark.launch
def test_a_parquet_bomb_row_is_dropped_unread_within_a_memory_limit(tmp_path):
    """A few KB on disk, a 64 MiB row: its row group is dropped by the file's metadata, never decompressed (which
    would take the row's size three times over: the page, the Arrow array, the Python text)."""
    bomb = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": ["first", "a" * (64 << 20), "third"]}), bomb, row_group_size=1,
                   compression="zstd")
    assert bomb.stat().st_size < 100_000
    assert _read_within_a_memory_limit(bomb, 1000.0) == str((["first", "third"], [(2, "inflate_ratio")]))


FLOOR = 1 << 20  # INFLATE_FLOOR_BYTES in the tests below: any file may inflate this far


@pytest.fixture
def small_floor(monkeypatch):
    monkeypatch.setattr(input_files, "INFLATE_FLOOR_BYTES", FLOOR)


def _inflating_jsonl(path: Path, filler_bytes: int) -> None:
    """`first`, `filler_bytes` of blank lines, `third`, zstd: a few KB on disk."""
    blank = b" " * 1023 + b"\n"
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as stream:
        stream.write(jsonl("first"))
        for _ in range(filler_bytes // (64 * len(blank))):
            stream.write(blank * 64)
        stream.write(jsonl("third"))


def test_a_file_inflating_past_the_ratio_is_cut_there_as_one_bad_record(tmp_path, small_floor):
    path = tmp_path / "blanks.jsonl.zstd"
    _inflating_jsonl(path, 2 * FLOOR)
    bad = []
    assert [document.text for document in read_documents(path, "text", bad.append)] == ["first"]
    [record] = bad
    assert (record.path, record.kind) == (str(path), "inflate_ratio")
    # It stopped at the floor, 1000 times its size being less: in the line after `first` and the whole blank lines.
    assert record.line == 1 + (FLOOR - len(jsonl("first"))) // 1024 + 1
    assert f"times its {path.stat().st_size} bytes on disk (--max-inflate-ratio): the rest of it is dropped" \
        in record.detail
    # Within the bound (or without one) the whole file is read.
    everything = [document.text for document in read_documents(path, "text", bad.append, max_inflate_ratio=1e9)]
    assert everything == ["first", "third"] and len(bad) == 1


def test_a_parquet_column_chunk_inflating_past_the_ratio_is_dropped_and_over_long_rows_are_never_made(tmp_path,
                                                                                                      small_floor):
    path = tmp_path / "rows.parquet"
    random_text = "".join(random.Random(0).choice("abcdefghij klmnopqrstuvwxyz") for _ in range(3000))
    repeated = "b" * (2 * FLOOR)
    pq.write_table(pa.table({"text": ["one", random_text, repeated, "four"]}), path, row_group_size=1,
                   compression="zstd")
    bad = []
    texts = [document.text for document in read_documents(path, "text", bad.append, max_bytes=LIMIT)]
    assert texts == ["one", "four"]
    assert [(record.line, record.kind) for record in bad] == [(2, "oversize_record"), (3, "inflate_ratio")]
    assert bad[0].detail == f"'text' is 3000 bytes, over --max-document-bytes {LIMIT}"
    assert bad[1].detail.startswith(f"row group 2: 'text' inflates past {FLOOR} bytes, 1000 times its ")
    assert bad[1].detail.endswith("(--max-inflate-ratio): its 1 row(s) from here are dropped")


def test_a_record_nested_100000_levels_deep_is_one_bad_record(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_bytes(jsonl("first") + b'{"text": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
                     + jsonl("third"))
    bad = []
    assert [document.text for document in read_documents(path, "text", bad.append)] == ["first", "third"]
    assert [(record.line, record.kind, record.detail) for record in bad] == [
        (2, "malformed_json", "nested deeper than Python's recursion limit")]


@pytest.mark.launch
def test_progress_shows_records_and_decompressed_bytes_while_a_file_inflates(
        tmp_path, sentencepiece_model, capsys, monkeypatch, small_floor):  # noqa: F811
    path = tmp_path / "corpus" / "blanks.jsonl.zstd"
    path.parent.mkdir()
    _inflating_jsonl(path, 2 * FLOOR)
    every_chunk = functools.partial(ProgressLine, interval_s=0, stream=sys.stderr)  # stderr as captured now
    monkeypatch.setattr(preprocessing_run, "ProgressLine", every_chunk)
    code, out, err = run_main(["--input", path.parent, "--output-prefix", tmp_path / "out", "--tokenizer-model",
                               sentencepiece_model, "--chunk-mb", "0.25"], capsys)
    assert code == 0, err
    assert f"bad record: {path}:" in err and ": inflate_ratio: the file inflates past" in err
    assert "bad_records=1 (inflate_ratio=1)" in out and "documents=1 " in out
    moving = [line for line in err.splitlines() if line.startswith("progress: input files 0/1")]
    records = [int(line.split("MB), ")[1].split(" records")[0]) for line in moving]
    assert len(set(records) - {0}) >= 2 and records == sorted(records)  # motion before the file is done
    assert "MB decompressed)" in moving[0]


def test_the_limits_are_settings_of_the_command_line():
    from tools.preprocess_data import parse_args

    config = parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "z"])
    assert config.max_document_bytes == 16 << 20 and config.max_inflate_ratio == 1000
    assert parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "z", "--max-inflate-ratio",
                       "50"]).max_inflate_ratio == 50
    for flag, value in (("--max-document-bytes", "0"), ("--max-inflate-ratio", "0.5"), ("--max-inflate-ratio", "nan")):
        with pytest.raises(SystemExit):
            parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "z", flag, value])
    assert json.dumps(config.max_document_bytes)  # recorded in the parts' identity as a plain number
