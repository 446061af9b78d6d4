"""The method comparison's report (tools/compare/report.py): from synthetic records of a whole corpus
(verdicts, tables, plots, the results README and the project README's summary), while the selection is
still under way (runs so far, claims pending), and from the records alone (`--report-only`)."""
from __future__ import annotations

import json
from dataclasses import replace

from compare_fixtures import SETTINGS, alignment_record, fake_cosine, fake_loss, run_record

from tools.compare.methods import METHOD_ORDER, UNCOMPRESSED
from tools.compare.protocol import Method, Settings, selection, selection_launch
from tools.compare.records import BranchKey, RecordFile, RunRecord
from tools.compare.report import (
    BEGIN,
    END,
    SUMMARY_BEGIN,
    SUMMARY_END,
    write_corpus,
    write_readme,
    write_verdict_summary,
)
from tools.compare.stats import losses
from tools.compare.verdicts import HOLDS, NOT_RUN, PENDING


def test_a_report_while_the_selection_is_under_way_shows_its_runs_and_pending_claims(tmp_path):
    """Seed-0 runs only, no method's setting chosen yet: the report lists each method's runs so far,
    and every claim of the corpus's methods is pending (not 'not run', and no verdict)."""
    methods = [Method.load(m) for m in ("dp_muon", "muloco_k2")]
    runs = {r.key: r for r in (run_record("dp_muon", 0.01, loss=4.2), run_record("dp_muon", 0.02, loss=4.1),
                               run_record("muloco_k2", 0.01, 1.0, loss=4.4))}
    settings = replace(SETTINGS, methods=("dp_muon", "muloco_k2"))
    report = write_corpus("shakespeare", methods, settings, runs, {}, tmp_path / "shakespeare", [])
    assert "No runs recorded yet" not in report.markdown
    assert "Selection still under way on seed 0" in report.markdown
    assert "| dp_muon | 1 | 0.01: 4.2000, 0.02: 4.1000 |" in report.markdown
    assert "| muloco_k2 | 2 | 0.01/1: 4.4000 |" in report.markdown
    assert not list((tmp_path / "shakespeare").glob("*.png"))  # nothing to plot yet
    verdicts = {c.key: c.verdict for c in report.claims}
    assert verdicts["a"] == NOT_RUN  # this corpus runs no MuLoCo K=1 or DP AdamW
    empty = write_corpus("shakespeare", methods, settings, {}, {}, tmp_path / "empty", [])
    assert "No runs recorded yet." in empty.markdown and "Selection still under way" not in empty.markdown
    every = [Method.load(m) for m in METHOD_ORDER]
    full = write_corpus("shakespeare", every, replace(SETTINGS, methods=tuple(METHOD_ORDER)), runs, {},
                        tmp_path / "every", [])
    assert {c.verdict for c in full.claims} == {PENDING}


def test_a_report_from_the_records_alone_has_the_corpuss_methods_and_seeds(tmp_path):
    """--report-only while the selection is under way: the report is the one the sweep writes (every
    method of the corpus, the default test seeds), not one of the methods that happen to have runs."""
    from tools.compare_methods import main

    (tmp_path / "shakespeare").mkdir()
    runs = RecordFile(tmp_path / "shakespeare" / "runs.jsonl", RunRecord)
    for r in (run_record("dp_muon", 0.01, loss=4.2), run_record("muloco_k2", 0.01, 1.0, loss=4.4)):
        runs.append(r)
    assert main(["--report-only", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "shakespeare" / "settings.json").read_text())
    assert written["methods"] == list(METHOD_ORDER) and written["runs"] == 2
    assert (written["test_seeds"], written["more_test_seeds"]) == ([1, 2, 3], [4, 5])
    (d1,) = [line for line in (tmp_path / "README.md").read_text().splitlines()
             if line.startswith("| (d1) ") and line.count("|") > 6]
    assert d1.endswith("| - | pending | pending | - |"), d1


def test_report_from_synthetic_records(tmp_path):
    settings = Settings(steps=60, sync_interval=10, warmup=5)
    names = UNCOMPRESSED
    methods = [Method.load(m) for m in names]
    runs = {}
    for m in methods:
        while (job := selection_launch(m, settings, losses(runs))) is not None:
            runs[job.spec] = run_record(m.name, job.spec.inner_lr, job.spec.outer_lr, 0, fake_loss(job.spec))
        chosen = selection(m, settings, losses(runs))
        for seed in (1, 2, 3):
            spec = replace(chosen.spec, seed=seed)
            runs[spec] = run_record(m.name, spec.inner_lr, spec.outer_lr, seed, fake_loss(spec))
    aligned = {}
    for name in ("muloco_k2", "diloco_k2"):
        for x in (0.5, 1.0, 2.0):
            for seed in (1, 2, 3):
                for step in (10, 30, 50):
                    key = BranchKey(name, x, seed, step)
                    aligned[key] = alignment_record(name, x, seed, step, fake_cosine(key))
    report = write_corpus("shakespeare", methods, replace(settings, methods=names), runs, aligned,
                          tmp_path / "shakespeare", [])
    verdicts = {c.key: c.verdict for c in report.claims}
    assert verdicts["b"] == HOLDS and verdicts["d1"] == NOT_RUN  # no compressed variant
    assert verdicts["e"] == PENDING  # measured at K=2 only: K=4 and 8 are run, their alignment is not
    rows = (tmp_path / "shakespeare" / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("corpus,method,workers,inner,compression,inner_lr,inner_lr_at_edge,outer_lr")
    assert len(rows) == 1 + len(methods)
    assert len((tmp_path / "shakespeare" / "alignment.csv").read_text().splitlines()) == 1 + 6
    for plot in ("val_loss_vs_K.png", "val_loss_vs_bytes.png", "alignment_vs_K.png"):
        assert (tmp_path / "shakespeare" / plot).stat().st_size > 0
    (tmp_path / "protocol1").mkdir()
    (tmp_path / "protocol1" / "verdicts.json").write_text(json.dumps(
        {"b": {"claim": "MuLoCo beats DiLoCo at every K", "verdict": "holds"},
         "c": {"claim": "MuLoCo degrades less from K=1 to K=4 than DiLoCo", "verdict": "inconclusive"}}))
    (tmp_path / "README.md").write_text(f"# intro\n\n{BEGIN}\nSTALE\n{END}\n\n## after\n")
    write_readme(tmp_path, [report])
    text = (tmp_path / "README.md").read_text()
    assert "STALE" not in text and text.startswith("# intro") and text.rstrip().endswith("## after")
    assert "| muloco_k2 | 0.02 (1x) | " in text and "Verdict rule" in text
    assert "DiLoCo − MuLoCo at K=1 = +" in text  # the numbers behind the verdict
    project = tmp_path / "project_README.md"
    project.write_text(f"# project\n\n{SUMMARY_BEGIN}\nSTALE\n{SUMMARY_END}\n\n## after\n")
    write_verdict_summary(project, tmp_path, [report], details="results/compare/README.md")
    text = project.read_text()
    assert "STALE" not in text and text.rstrip().endswith("## after")
    assert "[first protocol](results/compare/protocol1/README.md)" in text
    assert "| (b) MuLoCo beats DiLoCo at every K | 150M: K=1 MuLoCo 3.120 vs DiLoCo 3.142; K=16 MuLoCo 3.222 vs " \
           "DiLoCo 3.326 | holds | holds | holds |" in text
    assert "| inconclusive (MuLoCo degrades less from K=1 to K=4 than DiLoCo) |" in text  # claimed for K=4 then
    assert "| (d1) 4-bit statistical is effectively lossless (within 1%) |" in text and "| not run | not run | - |" in text
