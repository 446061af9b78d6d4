"""The method comparison's machinery without launches: the run record (round trip, skipping what is
done, refusing other settings, corrupt lines), the sweep's order and the lr grid's extension, the
sitting's launch budget, the verdict rule, and a report from synthetic records."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tools.compare.protocol import Launch, Method, RunSpec, Settings, best_spec, extension_lr, next_launch
from tools.compare.records import Alignment, RecordError, RecordFile, RunRecord
from tools.compare.report import (BEGIN, END, SUMMARY_BEGIN, SUMMARY_END, claims, combined_verdict, summarize,
                                  write_corpus, write_readme, write_verdict_summary)
from tools.compare.sweep import Budget
from tools.compare.verdicts import (FAILS, HOLDS, INCONCLUSIVE, NOT_RUN, Stat, all_of, at_most, less, smaller_increase,
                                    t_quantile, within)

SETTINGS = Settings(steps=20, sync_interval=10, seeds=(0, 1, 2))
HASHES = {m: Method.load(m).config_sha256 for m in ("dp_muon", "muloco_k2", "diloco_k2", "muloco_k1", "diloco_k1")}


def record(method="dp_muon", lr=0.02, outer=None, seed=0, loss=5.0, alignment=None, **changes) -> RunRecord:
    return replace(RunRecord("shakespeare", method, lr, outer, seed, SETTINGS.protocol(), HASHES[method], loss,
                             [[10, loss + 1], [20, loss]], [[10, 1e6], [20, 2e6]], None, alignment, 12.5, "abc"),
                   **changes)


def test_record_round_trip_and_later_lines_supersede(tmp_path):
    f = RecordFile(tmp_path / "shakespeare" / "runs.jsonl")
    first = record(method="muloco_k2", outer=1.0)
    aligned = replace(first, alignment=Alignment([2], [0.8], [1.1]))
    for r in (first, record(seed=1), aligned):
        f.append(r)
    loaded = f.load("shakespeare", SETTINGS.protocol(), HASHES)
    assert loaded == {first.spec: aligned, record(seed=1).spec: record(seed=1)}
    assert loaded[first.spec].alignment.mean == 0.8 and loaded[first.spec].bytes_per_worker == 2e6


@pytest.mark.parametrize("change, message", [
    ({"protocol": {**SETTINGS.protocol(), "steps": 60}}, "steps 60 vs 20 now"),
    ({"corpus": "stdlib"}, "corpus 'stdlib'"),
    ({"config_sha256": "0" * 64}, "configs/compare/dp_muon.json has changed"),
])
def test_a_record_made_with_other_settings_is_refused(tmp_path, change, message):
    f = RecordFile(tmp_path / "runs.jsonl")
    f.append(record())
    f.append(record(seed=1, **change))
    with pytest.raises(RecordError, match=rf"runs.jsonl:2: recorded with other settings \(.*{message}"):
        f.load("shakespeare", SETTINGS.protocol(), HASHES)


def test_a_report_from_the_record_alone_takes_its_protocol(tmp_path):
    f = RecordFile(tmp_path / "runs.jsonl")
    f.append(record())
    assert len(f.load("shakespeare", None, HASHES)) == 1


@pytest.mark.parametrize("line, message", [
    ("{not json\n", "runs.jsonl:2: not a run record"),
    (json.dumps({"method": "dp_muon"}) + "\n", "runs.jsonl:2: not a run record .*expected the fields"),
    (record(seed=1).to_line()[:40], "runs.jsonl:2: incomplete last line"),
])
def test_a_corrupt_line_is_one_clear_error(tmp_path, line, message):
    path = tmp_path / "runs.jsonl"
    path.write_text(record().to_line() + line)
    with pytest.raises(RecordError, match=message):
        RecordFile(path).load("shakespeare", SETTINGS.protocol(), HASHES)


def test_extension_steps_beyond_the_edge_geometrically_at_most_three_times():
    grid = (0.01, 0.02, 0.04)
    assert extension_lr({0.01: 5.0, 0.02: 4.0, 0.04: 4.5}, grid, 2.0) is None  # bracketed
    assert extension_lr({0.01: 5.0, 0.02: 4.5, 0.04: 4.0}, grid, 2.0) == 0.08
    assert extension_lr({0.01: 4.0, 0.02: 4.5, 0.04: 5.0}, grid, 2.0) == 0.005
    assert extension_lr({0.001: 5.0, 0.003: 4.0, 0.01: 3.0}, (0.001, 0.003, 0.01), 10 ** 0.5) == 0.032
    walk = {0.01: 5.0, 0.02: 4.5, 0.04: 4.0, 0.08: 3.9, 0.16: 3.8, 0.32: 3.7}
    assert extension_lr(walk, grid, 2.0) is None  # three extensions spent


def test_sweep_order_grid_extension_outer_neighbour_seeds_and_alignment():
    method = Method.load("muloco_k2")
    settings = Settings(steps=20, sync_interval=10, seeds=(0, 1))
    losses, aligned, order = {}, set(), []
    loss_of = {0.01: 5.0, 0.02: 4.8, 0.04: 4.6, 0.08: 4.7}  # best at the top edge, then bracketed
    while (job := next_launch(method, settings, losses, aligned)) is not None:
        order.append((job.spec.inner_lr, job.spec.outer_lr, job.spec.seed, job.alignment))
        losses[job.spec] = loss_of[job.spec.inner_lr] + (0.1 if job.spec.outer_lr == 0.8 else 0.0)
        if job.alignment:
            aligned.add(job.spec)
    assert order == [(0.01, 1.0, 0, False), (0.02, 1.0, 0, False), (0.04, 1.0, 0, False), (0.08, 1.0, 0, False),
                     (0.04, 0.8, 0, False), (0.04, 1.0, 0, True), (0.04, 1.0, 1, True)]
    assert best_spec(method, settings, losses) == RunSpec("muloco_k2", 0.04, 1.0, 0)


def test_dp_sweep_has_no_outer_neighbour_or_alignment():
    method = Method.load("dp_muon")
    losses = {RunSpec("dp_muon", lr, None, 0): loss for lr, loss in ((0.01, 5.0), (0.02, 4.0), (0.04, 4.5))}
    assert next_launch(method, SETTINGS, losses, set()) == Launch(RunSpec("dp_muon", 0.02, None, 1), False)
    losses.update({RunSpec("dp_muon", 0.02, None, s): 4.0 for s in (1, 2)})
    assert next_launch(method, SETTINGS, losses, set()) is None


def test_budget_stops_after_max_runs_and_deadline():
    budget = Budget(jobs=2, max_runs=2)
    allowed = []
    for _ in range(3):
        with budget.slot() as ok:
            allowed.append(ok)
    assert allowed == [True, True, False]
    with Budget(jobs=1, deadline_s=0).slot() as ok:
        assert not ok


def s(*values: float, seeds=None) -> Stat:
    return Stat(dict(zip(seeds or range(len(values)), values)))


def shifted(stat: Stat, by: float, noise=(0.0, 0.0, 0.0)) -> Stat:
    return Stat({seed: v + by + e for (seed, v), e in zip(sorted(stat.by_seed.items()), noise)})


def test_verdict_rule_pairs_seeds():
    base = s(3.0, 3.3, 3.1)  # the seed moves every method alike, by far more than the differences tested
    assert less(base, shifted(base, 0.05, (0.01, -0.01, 0.0))) == HOLDS
    assert less(shifted(base, 0.05, (0.01, -0.01, 0.0)), base) == FAILS
    assert less(base, shifted(base, 0.01, (0.02, -0.02, 0.0))) == INCONCLUSIVE  # interval 0.01 ± 4.3 * 0.0115
    assert less(s(3.0, 3.0), s(3.1, 3.1)) == INCONCLUSIVE  # too few seeds
    assert less(s(3.0, 3.0, 3.0), s(3.1, 3.1, 3.1, seeds=(0, 1, 5))) == INCONCLUSIVE  # two seeds in common
    assert less(None, base) == INCONCLUSIVE
    assert at_most(base, shifted(base, -0.001, (0.01, -0.01, 0.0))) == HOLDS
    assert at_most(shifted(base, 0.1, (0.01, -0.01, 0.0)), base) == FAILS
    assert at_most(s(3.0, 3.0), s(3.1, 3.1)) == INCONCLUSIVE
    assert within(shifted(base, 0.01, (0.001, -0.001, 0.0)), base) == HOLDS  # 0.3% worse, well inside 1%
    assert within(shifted(base, 0.2, (0.001, -0.001, 0.0)), base) == FAILS
    assert within(shifted(base, 0.03, (0.03, -0.03, 0.0)), base) == INCONCLUSIVE
    assert smaller_increase(base, shifted(base, 0.05, (0.01, 0, -0.01)), base, shifted(base, 0.3)) == HOLDS
    assert smaller_increase(base, shifted(base, 0.3), base, shifted(base, 0.05, (0.01, 0, -0.01))) == FAILS
    assert all_of([HOLDS, HOLDS]) == HOLDS and all_of([HOLDS, INCONCLUSIVE]) == INCONCLUSIVE
    assert all_of([HOLDS, FAILS, INCONCLUSIVE]) == FAILS
    assert combined_verdict([HOLDS, HOLDS]) == HOLDS and combined_verdict([HOLDS, INCONCLUSIVE]) == INCONCLUSIVE
    assert combined_verdict([HOLDS, FAILS]) == "mixed"
    assert combined_verdict([HOLDS, NOT_RUN]) == HOLDS and combined_verdict([NOT_RUN]) == NOT_RUN


@pytest.mark.parametrize("df", [1, 2, 4, 9, 30])
def test_t_quantiles_are_the_975th_percentile_of_students_t(df):
    """Reference: P(T <= q) from Student's t density, integrated here by Simpson's rule."""
    q = t_quantile(df)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    n = 20000
    h = q / n
    integral = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(i * h) for i in range(n + 1))
    assert 0.5 + integral == pytest.approx(0.975, abs=2e-4)
    assert t_quantile(1000) == 1.960


def _records() -> dict:
    rows = [("dp_muon", None, 4.0), ("muloco_k1", 0.7, 3.95), ("diloco_k1", 0.7, 4.2), ("muloco_k2", 1.0, 4.1),
            ("diloco_k2", 1.0, 4.5)]
    out = {}
    for method, outer, loss in rows:
        for seed in range(3):
            a = Alignment([2], [0.9 if method == "muloco_k2" else 0.7], [1.0]) if method.endswith("k2") else None
            r = record(method, 0.02, outer, seed, loss + 0.01 * seed, a)
            out[r.spec] = r
        worse = record(method, 0.01, outer, 0, loss + 1)
        out[worse.spec] = worse
    return out


def test_report_from_synthetic_records(tmp_path):
    records = _records()
    methods = [Method.load(m) for m in ("dp_muon", "muloco_k1", "diloco_k1", "muloco_k2", "diloco_k2")]
    summary = summarize(methods[3], SETTINGS, records)
    assert (summary.inner_lr, summary.val_loss.n, summary.alignment.mean) == (0.02, 3, pytest.approx(0.9))
    assert summary.lr_at_edge  # 0.02 is the largest lr tried
    verdicts = {c.key: c.verdict for c in claims({m.name: summarize(m, SETTINGS, records) for m in methods})}
    assert verdicts["e"] == HOLDS  # on K=2, the only K both methods ran: 0.9 vs 0.7 on every seed
    assert verdicts["a"] == verdicts["d1"] == NOT_RUN  # DP AdamW, the compressed methods not run
    report = write_corpus("shakespeare", methods, SETTINGS, records, tmp_path / "shakespeare", [])
    rows = (tmp_path / "shakespeare" / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("corpus,method,workers,inner,compression,inner_lr,outer,val_loss_mean,val_loss_std,seeds")
    assert len(rows) == 1 + len(methods)
    assert json.loads((tmp_path / "shakespeare" / "settings.json").read_text())["steps"] == 20
    for plot in ("val_loss_vs_K.png", "val_loss_vs_bytes.png", "alignment_vs_K.png"):
        assert (tmp_path / "shakespeare" / plot).stat().st_size > 0
    readme = tmp_path / "README.md"
    readme.write_text(f"# intro\n\n{BEGIN}\nSTALE\n{END}\n\n## after\n")
    write_readme(readme, [report])
    text = readme.read_text()
    assert "STALE" not in text and text.startswith("# intro") and text.rstrip().endswith("## after")
    assert "| (b) MuLoCo beats DiLoCo at every K |" in text and "Verdict rule" in text
    project = tmp_path / "project_README.md"
    project.write_text(f"# project\n\n{SUMMARY_BEGIN}\nSTALE\n{SUMMARY_END}\n\n## after\n")
    write_verdict_summary(project, [report], details="results/compare/README.md")
    text = project.read_text()
    assert "STALE" not in text and text.rstrip().endswith("## after") and "(20 on shakespeare;" in text
    assert "| (a) MuLoCo K=1 ≤ DP Muon < DP AdamW | 150M: MuLoCo K=1 3.120, DP Muon 3.124, DP AdamW 3.158 | not run | " \
        "not run |" in text


def test_a_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ValueError, match="warm-up 20 must be between 0 and the 10 steps"):
        Settings(steps=10, sync_interval=5)
    assert Settings(steps=10, sync_interval=5, warmup=2).protocol()["warmup"] == 2
