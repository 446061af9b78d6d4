"""The GPU run that decides claim (e), "Muon's pseudogradients are more directionally correct as K
grows", at the paper's 150M scale (run by scripts/gpu_evidence.sh; see there for the exact run).

Stages, in order, each one process of the real trainer (scripts/gpu_check.py's conventions: a process
group of its own, killed at the stage's timeout; the report, gpu_evidence.md and gpu_evidence.json,
rewritten in --out after every stage):
  a. DiLoCo: a data-parallel AdamW warm start on the global batch B, then from its state the K=1
     reference and the K=8 workers' branches of H=30 inner steps (AdamW inner): the cosine of the
     workers' averaged pseudogradient with the reference's, over the whole model and per hidden matrix
     (tools/compare/alignment.py's measure);
  b. MuLoCo: the same from a data-parallel Muon warm start of as many steps as (a)'s (Muon inner), and
     MuLoCo minus DiLoCo per hidden matrix and over the whole model.
The K=8 workers cannot be 8 NCCL ranks on the one GPU: they run one after another in one process, each
from the same start state on its own B/K slice of the same global batches, and their 8 pseudogradients
are averaged (tools/compare/simulated_workers.py); that is also what fits the time. A warm start runs
as many steps as its stage's time leaves after the branches' predicted time, timed on its own steps on
this machine, with a margin measured there too (the spread of its step times: wide on a shared CPU,
narrow on the GPU); its first step needs no margin, so a stage whose branches fit its timeout is never
stopped. Where (b)'s time allows fewer warm steps than (a)'s, the report says the two branched at
different steps.

GPU: the 150m preset with the paper's architecture and its Llama-3 vocabulary (150M parameters), bf16,
B = 64 sequences of 2048 tokens (a K=8 worker's batch: 8 sequences, 16,384 tokens), the shipped
ds_configs/gpu_150m_dp_{adamw,muon}.json (their lrs, weight decay and schedule length; a warm-up of
40 steps, not 500, so the branches run near the peak lr). --cpu: the same stages on gloo in fp32 with the tiny
preset (paper architecture) on CPU, B = 16 sequences of 128, the tiny CPU configs, so the script cannot
rot. The data are the device runs' synthetic Markov tokens (device_runs.py) (the GPU machine has no network).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

from device_processes import launch
from device_runner import REPO, ReportFiles, Stage, add_run_arguments, report_head, run_script, stage_lines
from device_runs import PEAK_TFLOPS, data_parallel_ds_config, flops_per_token, write_markov_data

WORKERS = 8  # K
SYNC_INTERVAL = 30  # H
CHILD_EXIT_RESERVE_S = 10.0  # of a stage's timeout, for the trainer's teardown after its branches


@dataclasses.dataclass(frozen=True)
class Mode:
    cpu: bool
    preset: str
    vocab: int
    global_batch: int  # B, sequences
    micro: int  # a K=8 worker's whole batch in one micro-batch: B / K
    max_warm_steps: int
    warmup: int
    schedule_steps: int | None  # the lr schedule's length; None: the config's own
    configs: dict  # inner optimizer -> shipped ds_config
    budget_s: float

    @property
    def name(self) -> str:
        return "cpu" if self.cpu else "gpu"


GPU = Mode(cpu=False, preset="150m", vocab=128_256, global_batch=64, micro=8, max_warm_steps=120, warmup=40,
           schedule_steps=None, configs={"adamw": "gpu_150m_dp_adamw.json", "muon": "gpu_150m_dp_muon.json"},
           budget_s=360.0)
CPU = Mode(cpu=True, preset="tiny", vocab=1000, global_batch=16, micro=2, max_warm_steps=30, warmup=10,
           schedule_steps=300, configs={"adamw": "cpu_tiny_adamw.json", "muon": "cpu_tiny_muon.json"}, budget_s=600.0)


class Evidence:
    """The stages (run by device_runner.run_stages)."""

    def __init__(self, mode: Mode, work: Path):
        self.mode, self.work = mode, work
        self.threads = 1 if mode.cpu else None
        self.results: dict[str, dict] = {}  # inner optimizer -> its measurement
        self._deadline = 0.0

    def start_stage(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s

    def left(self) -> float:
        return max(1.0, self._deadline - time.monotonic())

    def data(self) -> str:
        prefix = self.work / "data" / "markov"
        if not Path(str(prefix) + ".idx").exists():
            prefix.parent.mkdir(parents=True, exist_ok=True)
            m = self.mode
            samples = (m.max_warm_steps + SYNC_INTERVAL) * m.global_batch
            write_markov_data(prefix, m.vocab, tokens=max(200_000, samples * (_seq_length(m.preset) + 1)))
        return str(prefix)

    def stage_a(self) -> dict:
        return self._measure("adamw")

    def stage_b(self) -> dict:
        results = self._measure("muon")
        if "adamw" in self.results:
            results["muloco_minus_diloco"] = difference(self.results["muon"]["alignment"],
                                                        self.results["adamw"]["alignment"])
            steps = {name: self.results[name]["warm_start"]["steps"] for name in ("adamw", "muon")}
            if steps["muon"] != steps["adamw"]:
                results["muloco_minus_diloco"]["note"] = (
                    f"not at the same step: MuLoCo branched after {steps['muon']} warm-start steps, DiLoCo after "
                    f"{steps['adamw']} (the stage's time left no more)")
        return results

    def branches(self, optimizer: str, run: Path, plan) -> dict:
        """One trainer process: `optimizer`'s warm start and branches by `plan`; its summary."""
        from trainer.ds_config import load_ds_config

        m = self.mode
        ds = data_parallel_ds_config(self.work / f"{optimizer}.json", m.configs[optimizer])
        schedule_steps = m.schedule_steps or load_ds_config(json.loads(ds.read_text())).scheduler.params.train_iters
        flags = ["--ds_config", str(ds), "--model", m.preset, "--arch", "paper", "--num-query-groups",
                 str(_heads(m.preset)), "--data-path", self.data(), "--vocab-size", str(m.vocab), "--run-dir", str(run),
                 "--train-iters", str(schedule_steps), "--lr-warmup-iters", str(m.warmup),
                 "--micro-batch-size", str(m.micro), "--global-batch-size", str(m.global_batch),
                 "--eval-interval", "0", "--eval-iters", "1", "--seed", "1234",
                 *(["--distributed-backend", "gloo"] if m.cpu else [])]
        spec = self.work / f"{optimizer}_spec.json"
        spec.write_text(json.dumps({"flags": flags, "plan": dataclasses.asdict(plan)}))
        launch([str(Path(__file__).resolve()), "--branches", str(spec)], 1, self.work / f"{optimizer}.log",
                         self.left(), self.threads)
        return json.loads((run / "summary.json").read_text())

    def _measure(self, optimizer: str) -> dict:
        from tools.compare.simulated_workers import BranchPlan
        from muloco.core.typed_json import read_json_object
        from trainer.ds_config import load_ds_config

        m, name = self.mode, self.mode.configs[optimizer]
        run = self.work / optimizer
        # The second warm start as long as the first, so both methods branch at the same step.
        warm_steps = next(iter(r["warm_start"]["steps"] for r in self.results.values()), m.max_warm_steps)
        plan = BranchPlan(WORKERS, SYNC_INTERVAL, warm_steps, deadline=time.time() + self.left() - CHILD_EXIT_RESERVE_S)
        summary = self.branches(optimizer, run, plan)
        warm = summary["warm_start"]
        tokens_per_s = warm["steps"] * m.global_batch * _seq_length(m.preset) / warm["seconds"]
        tflops = tokens_per_s * flops_per_token(m.preset, m.vocab) / 1e12
        config = read_json_object(REPO / "ds_configs" / name)
        alignment = summary["alignment"]
        self.results[optimizer] = {
            "config": name, "peak_lr": load_ds_config(config).optimizer.params.lr,
            "lr_source": config.get("recipe", {}).get("not_from_the_paper", {}).get("optimizer.params.lr",
                                                                                  "the tiny CPU config's"),
            "parameters": summary.get("parameters"), "max_memory_gib": summary.get("max_memory_gib"),
            "warm_start": {**warm, "tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 3),
                           "mfu": "n/a (CPU)" if m.cpu else round(tflops / PEAK_TFLOPS, 4)},
            "branches": summary["branches"],
            "alignment": {"cosine": alignment["cosine"], "norm_ratio": alignment["norm_ratio"],
                          "hidden_matrix_mean_cosine": statistics.fmean(alignment["matrix_cosines"].values()),
                          "matrix_cosines": alignment["matrix_cosines"]}}
        return self.results[optimizer]


def _heads(preset: str) -> int:
    """One query group per head: the paper's attention (no GQA), as the CPU comparison runs it."""
    from trainer.model.presets import PRESETS

    return PRESETS[preset].num_attention_heads


def _seq_length(preset: str) -> int:
    from trainer.model.presets import PRESETS

    return PRESETS[preset].seq_length


def difference(muloco: dict, diloco: dict) -> dict:
    """MuLoCo minus DiLoCo: whole model, the hidden matrices' mean and each matrix; the verdict on (e)."""
    per_matrix = {k: muloco["matrix_cosines"][k] - diloco["matrix_cosines"][k] for k in diloco["matrix_cosines"]}
    mean = statistics.fmean(per_matrix.values())
    higher = sum(d > 0 for d in per_matrix.values())
    if mean > 0 and higher > len(per_matrix) / 2:
        verdict = "holds here"
    elif mean < 0 and higher < len(per_matrix) / 2:
        verdict = "does not hold here"
    else:
        verdict = "mixed"
    return {"whole_model": muloco["cosine"] - diloco["cosine"], "hidden_matrix_mean": mean,
            "matrices_where_muloco_is_higher": f"{higher} of {len(per_matrix)}", "verdict": verdict,
            "per_matrix": per_matrix}


# Muon's step costs more than AdamW's: (b) gets more of the 6 minutes for a warm start as long as (a)'s.
STAGES = [
    Stage("a", f"DiLoCo: DP AdamW warm start, then K=1 and K={WORKERS} branches of H={SYNC_INTERVAL} (AdamW inner): "
               f"alignment cosines", Evidence.stage_a, {"gpu": 160, "cpu": 280}),
    Stage("b", f"MuLoCo: DP Muon warm start as long as (a)'s, then K=1 and K={WORKERS} branches of H={SYNC_INTERVAL} "
               f"(Muon inner): alignment cosines, MuLoCo minus DiLoCo", Evidence.stage_b, {"gpu": 180, "cpu": 280}),
]


# -- the report -----------------------------------------------------------------------------------------

def render(report: dict) -> str:
    m = CPU if report["mode"] == "cpu" else GPU
    lines = [*report_head("Evidence for claim (e): pseudogradient alignment at K=8", report),
             f"Model {m.preset} (paper architecture, vocabulary {m.vocab}), {'fp32' if m.cpu else 'bf16'}, global "
             f"batch B = {m.global_batch} sequences of {_seq_length(m.preset)} tokens; K = {WORKERS} workers of "
             f"B/K = {m.micro} sequences ({m.micro * _seq_length(m.preset):,} tokens) each, H = {SYNC_INTERVAL}. "
             f"The K workers ran one after another in one process from the same start state, each on its slice "
             f"of the same global batches, and their pseudogradients were averaged (one device cannot hold "
             f"{WORKERS} ranks of one NCCL communicator); the K=1 reference ran the same H steps on the whole "
             f"batch. Cosine: of the averaged K={WORKERS} pseudogradient with the K=1 one (higher: more "
             f"directionally correct). One start state, one seed, synthetic Markov data.", ""]
    stages = {s["stage"]: s for s in report["stages"]}
    b = stages.get("b", {}).get("results", {})
    if "muloco_minus_diloco" in b:
        a, diff = stages["a"]["results"], b["muloco_minus_diloco"]
        lines += [f"**Claim (e) {diff['verdict']}**: MuLoCo minus DiLoCo, mean over the hidden matrices "
                  f"{diff['hidden_matrix_mean']:+.4f} (MuLoCo higher on {diff['matrices_where_muloco_is_higher']}); "
                  f"whole model {diff['whole_model']:+.4f} (dominated by the embedding and head, AdamW's in both)"
                  + (f"; {diff['note']}." if "note" in diff else "."),
                  "", "| cosine with K=1 | DiLoCo (AdamW inner) | MuLoCo (Muon inner) | MuLoCo - DiLoCo |",
                  "|---|---|---|---|",
                  f"| whole model | {a['alignment']['cosine']:.4f} | {b['alignment']['cosine']:.4f} | "
                  f"{diff['whole_model']:+.4f} |",
                  f"| hidden matrices, mean | {a['alignment']['hidden_matrix_mean_cosine']:.4f} | "
                  f"{b['alignment']['hidden_matrix_mean_cosine']:.4f} | {diff['hidden_matrix_mean']:+.4f} |"]
        lines += [f"| {name} | {a['alignment']['matrix_cosines'][name]:.4f} | {b['alignment']['matrix_cosines'][name]:.4f} "
                  f"| {d:+.4f} |" for name, d in diff["per_matrix"].items()]
        lines.append("")
    # The per-matrix numbers are in the table above and in the JSON report.
    brief = {**report, "stages": [{**s, "results": _without_matrices(s["results"])} if "results" in s else s
                                  for s in report["stages"]]}
    return "\n".join([*lines, *stage_lines(brief)]) + "\n"


def _without_matrices(results: dict) -> dict:
    brief = {**results}
    if "alignment" in brief:
        brief["alignment"] = {k: v for k, v in brief["alignment"].items() if k != "matrix_cosines"}
    if "muloco_minus_diloco" in brief:
        brief["muloco_minus_diloco"] = {k: v for k, v in brief["muloco_minus_diloco"].items() if k != "per_matrix"}
    return brief


EVIDENCE_REPORT = ReportFiles("gpu_evidence", render)


# -- one stage's trainer process ----------------------------------------------------------------------------

def simulated_branches(spec_path: Path) -> None:
    """The trainer, run as pretrain.py runs it, with the warm start and the branches as its loop."""
    from tools.compare.simulated_workers import BranchPlan, SimulatedWorkersTrainer
    from trainer.pretrain import main as pretrain

    spec = json.loads(spec_path.read_text())
    pretrain(spec["flags"], functools.partial(SimulatedWorkersTrainer, plan=BranchPlan(**spec["plan"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, "gpu_evidence.sh", GPU, CPU)
    parser.add_argument("--branches", type=Path, default=None, help=argparse.SUPPRESS)  # a stage's trainer process
    args = parser.parse_args(argv)
    if args.branches:
        simulated_branches(args.branches)
        return 0
    return run_script(args, argv, "gpu_evidence.sh", CPU if args.cpu else GPU, Evidence, STAGES, EVIDENCE_REPORT)


if __name__ == "__main__":
    sys.exit(main())
