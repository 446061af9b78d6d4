"""Preprocessing holds a bounded amount of any input (dataprep/long_lines.py, dataprep/input_files.py): a record
longer than --max-document-bytes is one bad record naming file and line (or stops the run under --strict),
in every input format and however the input file is cut into chunks; compressed bombs inflate a piece at a time
and their giant lines stream past, within a memory limit far below their size."""
from __future__ import annotations

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

from dataprep.long_lines import LineLimit
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

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


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zstd"])
@pytest.mark.launch
def test_a_bomb_streams_within_a_memory_limit(tmp_path, suffix):
    bomb = tmp_path / f"bomb{suffix}"
    _write_bomb(bomb)
    reader = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        from dataprep.input_files import read_documents
        size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
        limit = size * 1024 + {HEADROOM_BYTES}
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        bad = []
        texts = [document.text for document in read_documents(Path({str(bomb)!r}), "text", bad.append, 1 << 20)]
        print((texts, [(record.line, record.kind) for record in bad]))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str((["first", "third"], [(2, "oversize_record")]))


def test_the_limit_is_a_setting_of_the_command_line():
    from tools.preprocess_data import parse_args

    config = parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "z"])
    assert config.max_document_bytes == 16 << 20
    with pytest.raises(SystemExit):
        parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-model", "z", "--max-document-bytes", "0"])
    assert json.dumps(config.max_document_bytes)  # recorded in the parts' identity as a plain number
