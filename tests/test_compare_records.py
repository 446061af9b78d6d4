"""The method comparison's records (tools/compare/records.py) and its prepared data: a round trip where
later lines supersede, a record of other settings, data or configs refused, a corrupt line one clear
error, the first protocol's records not this protocol's, and the prepared data made once per content of
the corpus (its digest, the one records carry, of the files the trainer reads)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from compare_fixtures import DATA, HASHES, SETTINGS, alignment_record, run_record
from conftest import REPO_ROOT

from tools.compare import launch
from tools.compare.records import AlignmentRecord, BranchKey, RecordError, RecordFile, RunRecord, to_line


def test_records_round_trip_and_later_lines_supersede(tmp_path):
    runs = RecordFile(tmp_path / "runs.jsonl", RunRecord)
    first, again = run_record(), run_record(loss=4.0)
    for r in (first, run_record(seed=1), again):
        runs.append(r)
    assert runs.load("shakespeare", DATA, SETTINGS.protocol(), HASHES) == {first.key: again, run_record(seed=1).key:
                                                                      run_record(seed=1)}
    aligned = RecordFile(tmp_path / "alignment.jsonl", AlignmentRecord)
    aligned.append(alignment_record())
    loaded = aligned.load("shakespeare", DATA, SETTINGS.protocol(), HASHES)
    assert loaded == {BranchKey("muloco_k2", 1.0, 1, 20): alignment_record()}
    assert loaded[BranchKey("muloco_k2", 1.0, 1, 20)].matrix_cosines == {"a": 0.8, "b": pytest.approx(0.7)}


@pytest.mark.parametrize("change, message", [
    ({"protocol": {**SETTINGS.protocol(), "steps": 300}}, "steps 300 vs 60 now"),
    ({"protocol": {**SETTINGS.protocol(), "arch": "qwen3"}}, "arch qwen3 vs paper now"),
    ({"corpus": "stdlib"}, "corpus 'stdlib'"),
    ({"data_sha256": "e" * 64}, "prepared data eeeeeeeeeeee vs dddddddddddd now"),
    ({"config_sha256": "0" * 64}, "configs/compare/dp_muon.json has changed"),
])
def test_a_record_made_with_other_settings_is_refused(tmp_path, change, message):
    f = RecordFile(tmp_path / "runs.jsonl", RunRecord)
    f.append(run_record())
    f.append(run_record(seed=1, **change))
    with pytest.raises(RecordError, match=rf"runs.jsonl:2: recorded with other settings \(.*{message}"):
        f.load("shakespeare", DATA, SETTINGS.protocol(), HASHES)


def test_a_report_from_the_records_alone_refuses_lines_of_other_data(tmp_path):
    f = RecordFile(tmp_path / "runs.jsonl", RunRecord)
    f.append(run_record())
    f.append(run_record(seed=1, data_sha256="e" * 64))
    with pytest.raises(RecordError, match="runs.jsonl:2: .*prepared data eeeeeeeeeeee vs dddddddddddd now"):
        f.load("shakespeare", None, None, HASHES)


def test_prepared_data_is_made_once_per_content_of_the_corpus(tmp_path, monkeypatch):
    """The digest a record carries is of the files the trainer reads: the same corpus is prepared once and
    keeps its digest wherever it lies; a changed document, or a preparation cut short, is prepared
    again from nothing."""
    corpus = tmp_path / "corpus"
    for split in ("train", "valid"):
        (corpus / split).mkdir(parents=True)
        (corpus / split / "a.jsonl").write_text(f'{{"text": "{split}"}}\n')
    outputs = []

    def fake_step(command, cwd=REPO_ROOT):  # the tokenizer and the tokenized splits, each a function of its input
        source, out = (Path(command[command.index(flag) + 1]) for flag in ("--input", "--output-prefix"))
        outputs.append(out.name)
        text = "".join(p.read_text() for p in sorted(source.iterdir()))
        if "tokenizer.train" in command:  # SentencePiece keeps its output prefix, as given, in the model
            (cwd / f"{out}.model").write_text(text + str(out))
            return
        for suffix in ("_text_document.bin", "_text_document.idx"):
            Path(f"{out}{suffix}").write_text(text + suffix)

    monkeypatch.setattr(launch, "_check_call", fake_step)
    work = tmp_path / "work"
    first = launch.prepare_data(corpus, work)
    assert outputs == ["tok", "train", "valid"]
    assert launch.prepare_data(corpus, work) == first and len(outputs) == 3
    assert launch.prepare_data(corpus, tmp_path / "elsewhere").sha256 == first.sha256
    (corpus / "train" / "a.jsonl").write_text('{"text": "other"}\n')
    changed = launch.prepare_data(corpus, work)
    assert len(outputs) == 9 and changed.sha256 != first.sha256
    (work / "source.sha256").unlink()  # as if the preparation had been killed before its end
    (work / "partial.bin").write_text("")
    assert launch.prepare_data(corpus, work) == changed and len(outputs) == 12
    assert not (work / "partial.bin").exists()
    Path(changed.valid + ".idx").write_text("edited")  # the digest is of what is read, not of what was made
    assert launch.prepare_data(corpus, work).sha256 != changed.sha256 and len(outputs) == 12


def test_the_first_protocols_records_are_not_this_protocols(tmp_path):
    old = REPO_ROOT / "results" / "compare" / "protocol1" / "shakespeare" / "runs.jsonl"
    with pytest.raises(RecordError, match="runs.jsonl:1: not a RunRecord .*expected the fields"):
        RecordFile(old, RunRecord).load("shakespeare", DATA, SETTINGS.protocol(), HASHES)


@pytest.mark.parametrize("line, message", [
    ("{not json\n", "runs.jsonl:2: not a RunRecord"),
    (json.dumps({"method": "dp_muon"}) + "\n", "runs.jsonl:2: not a RunRecord .*expected the fields"),
    (to_line(run_record(seed=1))[:40], "runs.jsonl:2: incomplete last line"),
])
def test_a_corrupt_line_is_one_clear_error(tmp_path, line, message):
    path = tmp_path / "runs.jsonl"
    path.write_text(to_line(run_record()) + line)
    with pytest.raises(RecordError, match=message):
        RecordFile(path, RunRecord).load("shakespeare", DATA, SETTINGS.protocol(), HASHES)
