"""The method comparison's machinery without launches: the records (round trip, refusals, corrupt
lines), the selection on the selection seed (inner then outer grids, extensions, edges, compressed
variants inheriting), the test seeds (never the selection seed; more where a claim is undecided), the
verdict rules (paired superiority and non-inferiority, on synthetic records and on the first
protocol's claim (a) records), the alignment's per-matrix cosine and stats, the whole protocol's
scheduling with fake launches, and a report from synthetic records."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tools.compare import alignment, launch, sweep
from tools.compare.claims import claims, undecided
from tools.compare.methods import METHOD_ORDER, UNCOMPRESSED
from tools.compare.protocol import (Launch, Method, RunSpec, Settings, extension_lr, seed_launch, selection,
                                    selection_launch)
from tools.compare.records import AlignmentRecord, BranchKey, RecordError, RecordFile, RunRecord, to_line
from tools.compare.report import BEGIN, END, SUMMARY_BEGIN, SUMMARY_END, combined_verdict, write_corpus, \
    write_readme, write_verdict_summary
from tools.compare.stats import alignment_stats, alignment_summaries, loss_stats, losses, selected
from tools.compare.verdicts import (FAILS, HOLDS, INCONCLUSIVE, NOT_RUN, PENDING, Stat, all_of, less, non_inferior,
                                    smaller_increase, smaller_relative_gap, t_quantile)
from trainer.model.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
SETTINGS = Settings(steps=60, sync_interval=10, warmup=5)
HASHES = {m: Method.load(m).config_sha256 for m in METHOD_ORDER}
DATA = "d" * 64  # the prepared data's digest


def run_record(method="dp_muon", lr=0.02, outer=None, seed=0, loss=5.0, **changes) -> RunRecord:
    return replace(RunRecord("shakespeare", DATA, method, lr, outer, seed, SETTINGS.protocol(), HASHES[method], loss,
                             [[10, loss + 1], [60, loss]], [[10, 1e6], [60, 2e6]], None, 12.5, "abc"), **changes)


def alignment_record(method="muloco_k2", x=1.0, seed=1, step=20, cosine=0.8, **changes) -> AlignmentRecord:
    return replace(AlignmentRecord("shakespeare", DATA, method, x, seed, step, 0.02 * x, f"dp_muon_lr0.02_s{seed}",
                                   SETTINGS.protocol(), HASHES[method], cosine, 1.1, {"a": cosine, "b": cosine - 0.1},
                                   30.0, "abc"), **changes)


# -- records ---------------------------------------------------------------------------------------

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

    def fake_step(command, cwd=REPO):  # the tokenizer and the tokenized splits, each a function of its input
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
    old = REPO / "results" / "compare" / "protocol1" / "shakespeare" / "runs.jsonl"
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


# -- selection and test seeds ----------------------------------------------------------------------

def test_extension_steps_beyond_the_edge_geometrically_at_most_three_times():
    grid = (0.01, 0.02, 0.04)
    assert extension_lr({0.01: 5.0, 0.02: 4.0, 0.04: 4.5}, grid, 2.0) is None  # bracketed
    assert extension_lr({0.01: 5.0, 0.02: 4.5, 0.04: 4.0}, grid, 2.0) == 0.08
    assert extension_lr({0.01: 4.0, 0.02: 4.5, 0.04: 5.0}, grid, 2.0) == 0.005
    assert extension_lr({0.5: 4.0, 0.7: 4.5, 1.0: 5.0}, (0.5, 0.7, 1.0), 2 ** 0.5) == 0.35
    assert extension_lr({0.5: 5.0, 0.7: 4.5, 1.0: 4.0}, (0.5, 0.7, 1.0), 2 ** 0.5) == 1.4
    walk = {0.01: 5.0, 0.02: 4.5, 0.04: 4.0, 0.08: 3.9, 0.16: 3.8, 0.32: 3.7}
    assert extension_lr(walk, grid, 2.0) is None  # three extensions spent


def _walk(method: Method, loss_of, settings=SETTINGS) -> tuple[list, dict]:
    losses, order = {}, []
    while (job := selection_launch(method, settings, losses)) is not None:
        order.append((job.spec.inner_lr, job.spec.outer_lr, job.spec.seed))
        losses[job.spec] = loss_of(job.spec.inner_lr, job.spec.outer_lr)
    return order, losses


def test_selection_tunes_the_inner_then_the_outer_lr_on_the_selection_seed_alone():
    method = Method.load("muloco_k2")  # the paper's K>1 outer point 1.0 is the top of the outer grid

    def loss_of(lr, outer):  # inner best at 0.04 (after one extension), outer best at 1.4 (one extension)
        return {0.01: 5.0, 0.02: 4.8, 0.04: 4.6, 0.08: 4.7}[lr] + {0.5: 0.3, 0.7: 0.2, 1.0: 0.1, 1.4: 0.0,
                                                                   2.0: 0.05}[outer]
    order, losses = _walk(method, loss_of)
    assert order == [(0.01, 1.0, 0), (0.02, 1.0, 0), (0.04, 1.0, 0), (0.08, 1.0, 0),
                     (0.04, 0.5, 0), (0.04, 0.7, 0), (0.04, 1.4, 0), (0.04, 2.0, 0)]
    chosen = selection(method, SETTINGS, losses)
    assert chosen.spec == RunSpec("muloco_k2", 0.04, 1.4, 0)
    assert not chosen.inner_at_edge and not chosen.outer_at_edge
    # Test seeds: the selected setting on each, never the selection seed; a DP baseline keeps its states.
    assert seed_launch(method, SETTINGS, losses, (1, 2, 3)) == Launch(RunSpec("muloco_k2", 0.04, 1.4, 1))
    assert seed_launch(method, SETTINGS, losses, (1, 2, 3), start_state_seeds=(1,)).start_states
    assert seed_launch(method, SETTINGS, {}, (1, 2, 3)) is None  # selection not done


def test_an_lr_still_at_the_edge_after_the_extensions_is_marked():
    method = Method.load("diloco_k1")
    order, losses = _walk(method, lambda lr, outer: 1 / lr + outer)  # ever larger lrs, ever smaller outer lrs
    chosen = selection(method, SETTINGS, losses)
    assert chosen.inner_at_edge and chosen.outer_at_edge
    assert chosen.spec.inner_lr == 0.32 and chosen.spec.outer_lr == 0.18
    assert len(order) == 3 + 3 + 2 + 3  # inner grid and 3 extensions, 2 more outer points and 3 extensions


def test_dp_has_no_outer_tuning_and_a_compressed_variant_inherits_its_setting():
    dp = Method.load("dp_muon")
    order, _ = _walk(dp, lambda lr, outer: abs(math.log(lr / 0.02)))
    assert order == [(0.01, None, 0), (0.02, None, 0), (0.04, None, 0)]
    variant, base = Method.load("muloco_k4_stat4"), Method.load("muloco_k4")
    assert selection_launch(variant, SETTINGS, {}) is None
    _, losses = _walk(base, lambda lr, outer: abs(math.log(lr / 0.02)) + abs(outer - 0.7))
    chosen = selection(variant, SETTINGS, losses)
    assert chosen.spec == RunSpec("muloco_k4_stat4", 0.02, 0.7, 0)
    assert seed_launch(variant, SETTINGS, losses, (1,)).spec == RunSpec("muloco_k4_stat4", 0.02, 0.7, 1)


def test_the_selection_seed_is_no_test_seed():
    with pytest.raises(ValueError, match="selection seed 0 cannot also be a test seed"):
        Settings(test_seeds=(0, 1, 2))


# -- verdicts --------------------------------------------------------------------------------------

def s(*values: float, seeds=None) -> Stat:
    return Stat(dict(zip(seeds or range(1, len(values) + 1), values)))


def shifted(stat: Stat, by: float, noise=(0.0, 0.0, 0.0)) -> Stat:
    return Stat({seed: v + by + e for (seed, v), e in zip(sorted(stat.by_seed.items()), noise)})


def test_superiority_pairs_seeds():
    base = s(3.0, 3.3, 3.1)  # the seed moves every method alike, by far more than the differences tested
    assert less(base, shifted(base, 0.05, (0.01, -0.01, 0.0)), "q").verdict == HOLDS
    assert less(shifted(base, 0.05, (0.01, -0.01, 0.0)), base, "q").verdict == FAILS
    assert less(base, shifted(base, 0.01, (0.02, -0.02, 0.0)), "q").verdict == INCONCLUSIVE
    assert less(s(3.0, 3.0), s(3.1, 3.1), "q").verdict == INCONCLUSIVE  # too few seeds
    assert less(s(3.0, 3.0, 3.0), s(3.1, 3.1, 3.1, seeds=(1, 2, 6)), "q").n == 2
    assert less(None, base, "q").verdict == INCONCLUSIVE
    test = less(base, shifted(base, 0.05, (0.01, -0.01, 0.0)), "b − a")
    assert test.mean == pytest.approx(0.05) and test.low == pytest.approx(0.05 - 4.303 * 0.01 / math.sqrt(3), abs=1e-9)
    assert str(test).startswith("b − a = +0.0500 [+0.0252, +0.0748] (n=3; holds if > +0.0000)")


def test_non_inferiority_holds_below_the_margin_fails_above_it():
    base = s(4.0, 4.3, 4.1)  # margin 0.5% of ~4.13: 0.0207
    assert non_inferior(shifted(base, -0.01, (0.001, -0.001, 0.0)), base, "q").verdict == HOLDS
    assert non_inferior(shifted(base, 0.005, (0.001, -0.001, 0.0)), base, "q").verdict == HOLDS  # worse, within
    assert non_inferior(shifted(base, 0.05, (0.001, -0.001, 0.0)), base, "q").verdict == FAILS
    assert non_inferior(shifted(base, 0.02, (0.02, -0.02, 0.0)), base, "q").verdict == INCONCLUSIVE
    test = non_inferior(shifted(base, 0.02, (0.02, -0.02, 0.0)), base, "q", margin=0.01)
    assert test.bound == pytest.approx(0.01 * base.mean) and not test.above


def test_the_first_protocols_claim_a_is_inconclusive_under_non_inferiority():
    """The committed records of claim (a): MuLoCo K=1 worse than DP Muon on every seed of both corpora,
    +0.022 [-0.011, 0.055] on shakespeare; the first protocol's rule called it 'holds'."""
    for corpus, mean in (("shakespeare", 0.0218), ("stdlib_docs", 0.0259)):
        lines = (REPO / "results" / "compare" / "protocol1" / corpus / "runs.jsonl").read_text().splitlines()
        runs = [json.loads(line) for line in lines]

        def best(method: str) -> Stat:  # the setting run on every seed is the one seed 0 chose
            settings: dict[tuple, dict[int, float]] = {}
            for r in runs:
                if r["method"] == method:
                    settings.setdefault((r["inner_lr"], r["outer_lr"]), {})[r["seed"]] = r["final_val_loss"]
            return Stat(max(settings.values(), key=len))

        test = non_inferior(best("muloco_k1"), best("dp_muon"), "MuLoCo K=1 − DP Muon")
        assert test.n == 3 and test.mean == pytest.approx(mean, abs=1e-4)
        assert test.low < test.bound < test.high
        assert test.verdict == INCONCLUSIVE


def test_trend_tests_and_combinations():
    base = s(3.0, 3.3, 3.1)
    assert smaller_increase(base, shifted(base, 0.05, (0.01, 0, -0.01)), base, shifted(base, 0.3), "q").verdict == HOLDS
    assert smaller_increase(base, shifted(base, 0.3), base, shifted(base, 0.05, (0.01, 0, -0.01)), "q").verdict == FAILS
    # MuLoCo 2% above DP Muon, DiLoCo 6% above DP AdamW: closer to its baseline, relatively.
    dp_muon, dp_adamw = base, shifted(base, 0.2)
    muloco = Stat({k: v * 1.02 for k, v in dp_muon.by_seed.items()})
    diloco = Stat({k: v * 1.06 + e for (k, v), e in zip(dp_adamw.by_seed.items(), (0.01, -0.01, 0))})
    assert smaller_relative_gap(muloco, dp_muon, diloco, dp_adamw, "q").verdict == HOLDS
    assert smaller_relative_gap(diloco, dp_adamw, muloco, dp_muon, "q").verdict == FAILS
    assert all_of([HOLDS, HOLDS]) == HOLDS and all_of([HOLDS, INCONCLUSIVE]) == INCONCLUSIVE
    assert all_of([HOLDS, FAILS, INCONCLUSIVE]) == FAILS
    assert combined_verdict([HOLDS, HOLDS]) == HOLDS and combined_verdict([HOLDS, INCONCLUSIVE]) == INCONCLUSIVE
    assert combined_verdict([HOLDS, FAILS]) == "mixed"
    assert combined_verdict([HOLDS, NOT_RUN]) == HOLDS and combined_verdict([NOT_RUN]) == NOT_RUN
    assert combined_verdict([PENDING, NOT_RUN]) == PENDING and combined_verdict([HOLDS, PENDING]) == "holds so far"
    assert combined_verdict([FAILS, PENDING, INCONCLUSIVE]) == "does not hold so far"


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


# -- synthetic records of a whole corpus ------------------------------------------------------------

LR_BEST = {"adamw": 3e-3, "muon": 0.02}
# Final val loss at the best lrs by method, before a seed's shift.
BASE = {"dp_adamw": 4.40, "dp_muon": 4.10, "muloco_k1": 4.12, "diloco_k1": 4.45, "muloco_k2": 4.30,
        "diloco_k2": 4.80, "muloco_k4": 4.40, "diloco_k4": 4.85, "muloco_k8": 4.55, "diloco_k8": 5.10,
        "muloco_k4_stat4": 4.401, "diloco_k4_stat4": 4.84, "muloco_k4_stat2ef": 4.44, "muloco_k4_lin2ef": 4.45,
        "muloco_k8_stat4": 4.551, "diloco_k8_stat4": 5.09, "muloco_k8_stat2ef": 4.58, "muloco_k8_lin2ef": 4.62,
        "muloco_k8_stat2ef_tensor": 4.585, "muloco_k8_lin2ef_tensor": 4.70, "muloco_k8_stat2ef_emb2": 4.59,
        "muloco_k8_sparseloco": 4.65}
SEED_SHIFT = {0: 0.0, 1: 0.1, 2: -0.05, 3: 0.2, 4: 0.05, 5: -0.1}
NOISE = {1: 0.004, 2: -0.003, 3: 0.0, 4: 0.002, 5: -0.001}  # per-seed jitter, so intervals have width
MULOCO_K1_NOISE = {0: 0.0, 1: 0.01, 2: -0.01, 3: 0.03, 4: 0.0, 5: 0.02}  # (a) as the first protocol saw it


def fake_loss(spec: RunSpec) -> float:
    method = Method.load(spec.method)
    lr_penalty = abs(math.log(spec.inner_lr / LR_BEST[method.optimizer]))
    outer_penalty = 0.0 if spec.outer_lr is None else abs(spec.outer_lr - (method.outer[0])) * 0.1
    jitter = NOISE.get(spec.seed, 0.0) * (1 + METHOD_ORDER.index(spec.method) % 3)
    if spec.method == "muloco_k1":  # seed 0 favours it a lot; the others put it 0.5% above DP Muon, noisily
        jitter += -0.5 if spec.seed == 0 else MULOCO_K1_NOISE[spec.seed]
    return BASE[spec.method] + lr_penalty + outer_penalty + SEED_SHIFT[spec.seed] + jitter


def fake_cosine(key: BranchKey) -> float:
    k = Method.load(key.method).workers
    return (0.9 if key.method.startswith("muloco") else 0.8) - 0.05 * math.log2(k) - 0.01 * key.lr_multiplier \
        + NOISE[key.seed]


def test_the_whole_protocol_with_fake_launches(tmp_path, monkeypatch):
    """Phases and rounds: selection, 3 test seeds, alignment from the DP states (rerunning a DP run whose
    states are gone), and 2 more seeds exactly for the claims undecided on the first 3."""
    settings = Settings(steps=60, sync_interval=10, warmup=5)
    methods = [Method.load(m) for m in METHOD_ORDER]
    launched: list[tuple[str, object]] = []
    states: set[str] = set()

    def execute_run(method, job, ctx):
        launched.append(("run", job))
        if job.start_states:
            states.add(job.spec.name)
        return run_record(job.spec.method, job.spec.inner_lr, job.spec.outer_lr, job.spec.seed, fake_loss(job.spec),
                          protocol=settings.protocol(), bytes_curve=[[60, 2e6 * method.workers]])

    def execute_branch(method, chosen, key, ctx, dp_run):
        launched.append(("branch", key))
        assert dp_run in states and chosen.spec.method == key.method
        return alignment_record(key.method, key.lr_multiplier, key.seed, key.start_step, fake_cosine(key),
                                protocol=settings.protocol(), start_run=dp_run)

    monkeypatch.setattr(sweep, "execute_run", execute_run)
    monkeypatch.setattr(sweep, "execute_branch", execute_branch)
    monkeypatch.setattr(alignment, "has_start_states", lambda root, steps: root.parent.name in states)
    monkeypatch.setattr(sweep.shutil, "rmtree", lambda path, ignore_errors=False: states.discard(path.parent.name))
    ctx = sweep.Context("shakespeare", settings, None, tmp_path, RecordFile(tmp_path / "r.jsonl", RunRecord),
                        RecordFile(tmp_path / "a.jsonl", AlignmentRecord))
    progress = sweep.Progress({}, {})
    assert sweep.run_protocol(methods, ctx, progress, sweep.Budget(jobs=2)) == []

    runs = progress.runs
    chosen = selected(methods, settings, runs)
    assert chosen["muloco_k1"].spec == RunSpec("muloco_k1", 0.02, 0.7, 0)
    assert chosen["diloco_k4"].spec.inner_lr == 3e-3 and chosen["diloco_k4"].spec.outer_lr == 1.0
    seeds = {m: sorted(r.seed for r in runs.values() if r.method == m and r.seed > 0) for m in METHOD_ORDER}
    stats = loss_stats(chosen, runs, settings.test_seeds)
    summaries = alignment_summaries(progress.alignments, alignment.start_steps(settings), settings.test_seeds)
    on_three = {c.key: c for c in claims(stats, alignment_stats(summaries), METHOD_ORDER)}
    more = {n for c in undecided(list(on_three.values())) for n in c.needs}
    assert on_three["a"].verdict == INCONCLUSIVE and on_three["b"].verdict == HOLDS
    # The codec at the paper's settings: fake 4-bit and 2-bit statistical within 1%, linear worse per row and per
    # tensor, SparseLoCo 0.10 (2.2%) worse; every matrix at 2 bits 0.04 worse, close to the margin: 2 more seeds.
    assert [on_three[k].verdict for k in ("d1'", "d2'", "d3'", "g1", "g2")] == [HOLDS] * 3 + [INCONCLUSIVE, FAILS]
    assert {"muloco_k8_stat2ef_emb2", "muloco_k8"} <= more
    for m in METHOD_ORDER:
        assert seeds[m] == ([1, 2, 3, 4, 5] if m in more else [1, 2, 3]), m
    assert {"muloco_k1", "dp_muon", "dp_adamw"} <= more
    # Seed 0 made MuLoCo K=1 0.5 better than DP Muon; the verdict never sees it.
    assert all(seed > 0 for seed in loss_stats(chosen, runs)["muloco_k1"].by_seed)
    # Alignment: every K > 1 method at 3 start steps on the 3 test seeds, the 0.5x / 2x controls on the first;
    # every DP state removed after.
    branches = [key for kind, key in launched if kind == "branch"]
    assert len(branches) == len(set(branches)) == 6 * 3 * (3 + 2)
    assert {k.seed for k in branches if k.lr_multiplier != 1.0} == {1}
    assert {k.start_step for k in branches} == set(alignment.start_steps(settings)) == {10, 30, 50}
    assert states == set()
    assert on_three["e"].verdict == HOLDS
    # A rerun launches nothing; with the DP states gone and a branch missing, the DP run is repeated first.
    launched.clear()
    assert sweep.run_protocol(methods, ctx, progress, sweep.Budget(jobs=2)) == [] and launched == []
    missing = BranchKey("muloco_k2", 1.0, 2, 30)
    del progress.alignments[missing]
    sweep.run_protocol(methods, ctx, progress, sweep.Budget(jobs=1))
    assert [kind for kind, _ in launched] == ["run", "branch"] and launched[1][1] == missing
    assert launched[0][1] == Launch(replace(chosen["dp_muon"].spec, seed=2), start_states=True)


def test_budget_stops_after_max_runs_and_deadline():
    budget = sweep.Budget(jobs=2, max_runs=2)
    allowed = []
    for _ in range(3):
        with budget.slot() as ok:
            allowed.append(ok)
    assert allowed == [True, True, False]
    with sweep.Budget(jobs=1, deadline_s=0).slot() as ok:
        assert not ok


# -- alignment -------------------------------------------------------------------------------------

def test_start_steps_are_multiples_of_h_inside_the_run():
    assert alignment.start_steps(Settings()) == (60, 150, 240)
    assert alignment.start_steps(Settings(steps=20, sync_interval=10, warmup=2)) == (10,)
    assert alignment.start_steps(Settings(steps=10, sync_interval=10, warmup=2)) == ()


def test_per_matrix_cosines_split_the_fused_weights_as_muon_does():
    """Reference: the cosine of each logical matrix computed by hand from the slices."""
    shape = replace(PRESETS["tiny"], num_query_groups=None, arch="paper")
    h, d, f = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size
    g = torch.Generator().manual_seed(0)
    a = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(3 * 4 * d, h, generator=g),
         "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(2 * f, h, generator=g),
         "embedding.word_embeddings.weight": torch.randn(64, h, generator=g),
         "decoder.final_layernorm.weight": torch.randn(h, generator=g)}
    b = {n: t.clone() for n, t in a.items()}
    qkv = b["decoder.layers.0.self_attention.linear_qkv.weight"].view(4, 3 * d, h)
    qkv[:, :d] *= -1  # every query head reversed: q's cosine -1, k and v's 1
    b["decoder.layers.0.mlp.linear_fc1.weight"][f:] = torch.randn(f, h, generator=g)  # up replaced
    result = alignment.compare(a, b, shape)
    up_a, up_b = a["decoder.layers.0.mlp.linear_fc1.weight"][f:], b["decoder.layers.0.mlp.linear_fc1.weight"][f:]
    assert result.matrix_cosines == pytest.approx({
        "decoder.layers.0.self_attention.linear_qkv.weight:q": -1.0,
        "decoder.layers.0.self_attention.linear_qkv.weight:k": 1.0,
        "decoder.layers.0.self_attention.linear_qkv.weight:v": 1.0,
        "decoder.layers.0.mlp.linear_fc1.weight:gate": 1.0,
        "decoder.layers.0.mlp.linear_fc1.weight:up": float(torch.nn.functional.cosine_similarity(
            up_a.reshape(-1).double(), up_b.reshape(-1).double(), dim=0))})
    flat_a = torch.cat([a[n].reshape(-1) for n in sorted(a)]).double()
    flat_b = torch.cat([b[n].reshape(-1) for n in sorted(a)]).double()
    assert result.cosine == pytest.approx(float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0)))
    assert result.norm_ratio == pytest.approx(float(flat_a.norm() / flat_b.norm()))


def test_alignment_stats_count_a_seed_once_every_start_step_is_measured():
    records = {r.key: r for r in [alignment_record(seed=1, step=10, cosine=0.8), alignment_record(seed=1, step=30,
                                  cosine=0.6), alignment_record(seed=2, step=10, cosine=0.9)]}
    (summary,) = alignment_summaries(records, (10, 30)).values()
    assert summary.cosine.by_seed == {1: pytest.approx(0.7)}  # seed 2 lacks step 30
    assert summary.by_start == {10: pytest.approx(0.85), 30: pytest.approx(0.6)}
    assert summary.matrix_mean == pytest.approx((0.75 + 0.55 + 0.85) / 3)
    assert alignment_stats(alignment_summaries(records, (10, 30)), multiplier=2.0) == {}


# -- report ----------------------------------------------------------------------------------------

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
