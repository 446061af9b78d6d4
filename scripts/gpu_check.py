"""The prepared device check (run by scripts/gpu_check.sh; see there for the setup and the exact run).

Stages, in order; each passes, fails with its traceback in the report, or says why it does not apply
here. A stage whose input another stage makes (b and c need a's checkpoint) is not run when that
stage failed; the others run regardless, so one attempt on the GPU reports as much as it can:
  a. one process, the default backend (NCCL), bf16, the 150m preset, K=1 MuLoCo (4-bit statistical
     + error feedback, H=10), 40 steps without deterministic kernels (what a user runs): the loss
     falls; tokens/s, MFU, and peak memory checked against tools/plan.py's prediction;
  b. the same run resumed from its step-20 checkpoint with deterministic kernels: steps 21-40 as in (a)
     (a stated bf16 tolerance on the GPU, identical on CPU);
  c. `python -m tools.convert_checkpoint --verify` on (a)'s checkpoint;
  d. two processes sharing the one GPU (every group on gloo, intra-worker groups of one rank),
     K=2 MuLoCo 4-bit + EF, H=10, 20 steps: the loss falls and both workers hold identical weights
     after each sync (read from the checkpoints saved right after the syncs);
  e. DP Muon and DP AdamW, 10 steps each, at the largest preset with shipped DP configs that the
     planner says fits, with those configs' lr and schedule, no deterministic kernels: tokens/s and MFU
     of each, Muon's step overhead over AdamW, peak memory against the plan; first Newton-Schulz
     time per shape class, Gram form over standard (benchmarks/newton_schulz_forms.py), at that
     preset's and 15B's shapes in the Muon config's dtype, and Muon runs with the form that is fastest
     for a layer of the preset;
  f. T=2 x P=2 x K=2 (8 processes on the one GPU) over gloo with CUDA tensors: the distributed Muon,
     1F1B pipelining and two outer syncs, the workers identical after each; first a probe of which
     collectives gloo runs on CUDA tensors (a missing one makes the stage "not supported here");
  g. one process, K=1, `outer_backend: nccl` with `outer_state_on_device` and streaming (F=2, tau=1).
With --cpu the same stages run on gloo in fp32 with the tiny preset on CPU tensors (so the script
cannot rot; g runs its outer groups on gloo, the nearest CPU has to NCCL).

Time: the whole check, the wheels' install included, ends within its budget (6 minutes on the GPU):
each stage's timeout is the smaller of its cap and what is left, a stage that would get less than
MIN_STAGE_S (device_runner.py) is not started, and the report (markdown and JSON) is rewritten after every stage, so a
kill from outside keeps what ran. Every process the check starts is in the check's session (in a
process group of its own, so a timeout kills what it started too) and dies with the check.

The data are synthetic token ids made here (a learnable Markov chain in Megatron's indexed format):
the GPU machine has no network and the check must not depend on files outside the repository.

Here: the stages (`Check`) and their table (`STAGES`); beside it, the runner (device_runner.py), the processes
(device_processes.py), the trainer runs' data, configs and figures (device_runs.py) and stage f's probe
(gloo_probe.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

from device_processes import launch
from device_runner import (
    REPO,
    NotSupportedHere,
    ReportFiles,
    Stage,
    StageFailed,
    add_run_arguments,
    report_head,
    run_script,
    stage_lines,
)
from device_runs import (
    PEAK_TFLOPS,
    common_flags,
    data_parallel_ds_config,
    memory_against_plan,
    muloco_ds_config,
    outer_records,
    predicted_memory_gib,
    shipped_config,
    throughput,
    train_records,
    workers_identical,
    write_markov_data,
)

BF16_LOSS_TOLERANCE = 1e-2  # relative, for a resume against a run without deterministic kernels


@dataclasses.dataclass(frozen=True)
class Mode:
    cpu: bool
    preset: str
    vocab: int
    micro: int
    global_batch: int
    budget_s: float  # the whole check, from gpu_check.sh's start
    dp_configs: tuple[tuple[str, str, str], ...]  # stage e: (preset, Muon config, AdamW config), largest first
    large_micro: int
    large_global_batch: int

    @property
    def name(self) -> str:
        return "cpu" if self.cpu else "gpu"


GPU = Mode(cpu=False, preset="150m", vocab=32000, micro=8, global_batch=32, budget_s=360.0,
           dp_configs=(("3.1b", "gpu_3.1b_muloco_k16.json", "gpu_3.1b_diloco_k16.json"),
                       ("150m", "gpu_150m_dp_muon.json", "gpu_150m_dp_adamw.json")),
           large_micro=2, large_global_batch=8)
CPU = Mode(cpu=True, preset="tiny", vocab=1000, micro=4, global_batch=4, budget_s=900.0,
           dp_configs=(("tiny", "cpu_tiny_muon.json", "cpu_tiny_adamw.json"),), large_micro=4, large_global_batch=4)


class Check:
    def __init__(self, mode: Mode, work: Path):
        self.mode, self.work = mode, work
        self.backend = ["--distributed-backend", "gloo"] if mode.cpu else []
        # CPU: one thread per process (the tiny model gains nothing from more, and they would contend).
        self.threads = 1 if mode.cpu else None
        self._deadline = 0.0  # the running stage's (time.monotonic()), set by start_stage

    def launch(self, ranks: int, flags: list[str], log: str) -> None:
        launch([str(REPO / "trainer" / "pretrain.py"), *flags], ranks, self.work / log, self.left(), self.threads)

    def data(self) -> str:
        from trainer.model.presets import PRESETS

        prefix = self.work / "data" / "markov"
        if not Path(str(prefix) + ".idx").exists():
            prefix.parent.mkdir(parents=True, exist_ok=True)
            seq = PRESETS[self.mode.preset].seq_length
            write_markov_data(prefix, self.mode.vocab, tokens=max(200_000, 45 * self.mode.global_batch * seq))
        return str(prefix)

    def stage_a(self) -> dict:
        m = self.mode
        ds = muloco_ds_config(self.work / "a.json", m, workers=1)
        run = self.work / "a"
        self.launch(1, [*common_flags(m, m.preset, self.data(), run, ds, 40), *self.backend,
                   "--micro-batch-size", str(m.micro), "--global-batch-size", str(m.global_batch),
                   "--save", str(self.work / "ckpt_a"), "--save-interval", "20"], "a.log")
        losses = [r["loss"] for r in train_records(run)]
        if not (len(losses) == 40 and all(map(math.isfinite, losses))):
            raise StageFailed(f"expected 40 finite logged losses, got {losses}")
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        if not last < first - 0.5:
            raise StageFailed(f"the loss did not fall: mean of steps 1-5 {first:.3f}, of steps 36-40 {last:.3f}")
        speed = throughput(run, m.preset, m)
        return {"preset": m.preset, "loss_steps_1_5": round(first, 4), "loss_steps_36_40": round(last, 4), **speed,
                **memory_against_plan(speed["max_memory_gib"],
                                      predicted_memory_gib(m.preset, ds, m, m.micro, m.global_batch))}

    def stage_b(self) -> dict:
        m = self.mode
        ckpt = self.work / "ckpt_b"
        shutil.copytree(self.work / "ckpt_a" / "iter_0000020", ckpt / "iter_0000020")
        (ckpt / "latest").write_text("20\n")
        run = self.work / "b"
        self.launch(1, [*common_flags(m, m.preset, self.data(), run, self.work / "a.json", 40), *self.backend,
                   "--deterministic-mode", "--micro-batch-size", str(m.micro), "--global-batch-size",
                   str(m.global_batch), "--load", str(ckpt)], "b.log")
        reference = {r["step"]: r["loss"] for r in train_records(self.work / "a")}
        resumed = {r["step"]: r["loss"] for r in train_records(run)}
        if sorted(resumed) != list(range(21, 41)):
            raise StageFailed(f"the resumed run logged steps {sorted(resumed)}, expected 21-40")
        diffs = [abs(resumed[s] - reference[s]) / abs(reference[s]) for s in range(21, 41)]
        identical = all(resumed[s] == reference[s] for s in range(21, 41))
        if not identical and (m.cpu or max(diffs) > BF16_LOSS_TOLERANCE):
            raise StageFailed(f"steps 21-40 differ from the uninterrupted run: max relative loss difference "
                              f"{max(diffs):.3g} (allowed: {'0 on CPU' if m.cpu else BF16_LOSS_TOLERANCE})")
        return {"identical": identical, "max_relative_loss_difference": max(diffs),
                "tolerance": 0.0 if m.cpu else BF16_LOSS_TOLERANCE}

    def stage_c(self) -> dict:
        log = self.work / "c.log"
        launch(["-m", "tools.convert_checkpoint", "--load", str(self.work / "ckpt_a"), "--save",
                str(self.work / "hf"), "--verify"], 1, log, self.left())
        return {"verify": [line for line in log.read_text().splitlines() if line.strip()][-3:]}

    def stage_d(self) -> dict:
        m = self.mode
        ds = muloco_ds_config(self.work / "d.json", m, workers=2)
        run, ckpt = self.work / "d", self.work / "ckpt_d"
        # Every group on gloo: NCCL cannot put two ranks of one communicator on one GPU.
        self.launch(2, [*common_flags(m, m.preset, self.data(), run, ds, 20), "--distributed-backend", "gloo",
                   "--micro-batch-size", str(m.micro), "--global-batch-size", str(2 * m.micro),
                   "--save", str(ckpt), "--save-interval", "10"], "d.log")
        losses = [r["loss"] for r in train_records(run)]
        if not (len(losses) == 20 and losses[-1] < losses[0] - 0.5):
            raise StageFailed(f"the loss did not fall over 20 steps: {losses}")
        # The checkpoint hook runs after the outer sync of the same step.
        worst = {step: workers_identical(ckpt, step, ranks_per_worker=1) for step in (10, 20)}
        return {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                "max_weight_difference_after_sync": worst}

    def stage_e(self) -> dict:
        from trainer.ds_config import load_ds_config

        m = self.mode
        preset, configs = self._largest_dp_preset()
        forms = self._newton_schulz_forms(preset, configs["muon"])
        results, speeds = {"preset": preset, "newton_schulz_forms": forms}, {}
        for optimizer, name in configs.items():
            ds = data_parallel_ds_config(self.work / f"e_{optimizer}.json", name,
                                         ns_form=forms["fastest_for_a_layer"] if optimizer == "muon" else None)
            run = self.work / f"e_{optimizer}"
            self.launch(1, [*common_flags(m, preset, self.data(), run, ds, 10), *self.backend,
                       "--micro-batch-size", str(m.large_micro), "--global-batch-size", str(m.large_global_batch)],
                        f"e_{optimizer}.log")
            speed = throughput(run, preset, m)
            lrs = {r["lr"] for r in train_records(run)}
            results[optimizer] = {"config": name, "peak_lr": load_ds_config(ds).optimizer.params.lr,
                                  **({"ns_form": forms["fastest_for_a_layer"]} if optimizer == "muon" else {}),
                                  "largest_lr_reached": max(lrs), **speed,
                                  **memory_against_plan(speed["max_memory_gib"], predicted_memory_gib(
                                      preset, ds, m, m.large_micro, m.large_global_batch))}
            speeds[optimizer] = speed["tokens_per_s"]
        # The Muon step's cost over AdamW's, as a share of the Muon step time.
        results["muon_step_overhead_vs_adamw"] = round(1 - speeds["muon"] / speeds["adamw"], 4)
        return results

    def _newton_schulz_forms(self, preset: str, muon_config: str) -> dict:
        """Newton-Schulz seconds of each form per shape class on this device, in the Muon config's dtype,
        at the preset's shapes (and 15B's on a GPU), and the form (standard, gram, or auto: per shape)
        that orthogonalizes one layer of the preset fastest: Q, K, V, O square, gate and up tall, down wide."""
        import torch

        from benchmarks.newton_schulz_forms import benchmark_shape, shape_classes
        from trainer.model.presets import PRESETS

        dtype = shipped_config(muon_config)["optimizer"]["params"].get("ns_dtype", "float32")
        device = torch.device("cpu" if self.mode.cpu else "cuda")
        rows = {(p, c): benchmark_shape(p, c, shape, dtype, 3, device)
                for p in dict.fromkeys([preset] if self.mode.cpu else [preset, "15b"])
                for c, shape in shape_classes(PRESETS[p]).items()}
        per_layer = {"square": 4, "tall": 2, "wide": 1}
        layer_s = {form: sum(n * rows[preset, c].seconds(form) for c, n in per_layer.items())
                   for form in ("standard", "gram", "auto")}
        return {"dtype": dtype,
                **{f"{p} {c} {r.shape[0]}x{r.shape[1]}": {"standard_s": r.standard_s, "gram_s": r.gram_s,
                                                        "gram_over_standard": r.gram_over_standard,
                                                        "relative_difference": r.relative_difference}
                   for (p, c), r in rows.items()},
                "layer_s": {form: round(t, 5) for form, t in layer_s.items()},
                "fastest_for_a_layer": min(layer_s, key=layer_s.get)}

    def _largest_dp_preset(self) -> tuple[str, dict[str, str]]:
        """The largest preset with shipped DP Muon and AdamW configs whose planned memory (the larger
        of the two, with the plan's 10% headroom) fits this device."""
        import torch

        m = self.mode
        if m.cpu:
            preset, muon, adamw = m.dp_configs[0]
            return preset, {"muon": muon, "adamw": adamw}
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        for preset, muon, adamw in m.dp_configs:
            need = max(predicted_memory_gib(preset, data_parallel_ds_config(self.work / f"plan_{n}", n), m,
                                            m.large_micro, m.large_global_batch) for n in (muon, adamw))
            if need * 1.1 <= device_gib:
                return preset, {"muon": muon, "adamw": adamw}
        raise StageFailed(f"no preset of {[c[0] for c in m.dp_configs]} fits {device_gib:.0f} GiB by the plan")

    def stage_f(self) -> dict:
        m = self.mode
        probe = self.work / "gloo_probe.json"
        try:
            launch([str(Path(__file__).resolve().parent / "gloo_probe.py"), str(probe)], 2, self.work / "f_probe.log",
                   min(60.0, self.left()), self.threads)
            ended = None
        except StageFailed as err:  # a probe that broke its peer ends the probe: what it recorded stands
            if not probe.exists():
                raise
            ended = err
        found = json.loads(probe.read_text())
        missing = {name: why for name, why in found["collectives"].items() if why != "ok"}
        if ended is not None:
            missing["(the probe ended early)"] = str(ended).splitlines()[-1][:300]
        # K=2 workers x P=2 x T=2: every rank of a worker holds a distinct shard; H=2, 4 steps (2 syncs).
        ds = muloco_ds_config(self.work / "f.json", m, workers=2, sync_interval=2)
        run, ckpt = self.work / "f", self.work / "ckpt_f"
        try:
            self.launch(8, [*common_flags(m, "tiny", self.data(), run, ds, 4), "--distributed-backend", "gloo",
                       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--save", str(ckpt), "--save-interval", "2"], "f.log")
        except StageFailed as err:
            if missing:
                raise NotSupportedHere(f"gloo on {found['device']} tensors lacks {missing}; the T=2 x P=2 run "
                                       f"then failed:\n{err}") from None
            raise
        losses = [r["loss"] for r in train_records(run)]
        if not (len(losses) == 4 and all(map(math.isfinite, losses))):
            raise StageFailed(f"expected 4 finite logged losses, got {losses}")
        worst = {step: workers_identical(ckpt, step, ranks_per_worker=4) for step in (2, 4)}
        return {"gloo_collectives_on_" + found["device"]: found["collectives"], "losses": [round(x, 4) for x in losses],
                "outer_syncs": len(outer_records(run)), "max_weight_difference_after_sync": worst}

    def stage_g(self) -> dict:
        m = self.mode
        backend = "gloo" if m.cpu else "nccl"
        ds = muloco_ds_config(self.work / "g.json", m, workers=1, outer_backend=backend, outer_state_on_device=True,
                              streaming={"fragments": 2, "overlap_steps": 1})
        run = self.work / "g"
        self.launch(1, [*common_flags(m, m.preset, self.data(), run, ds, 20), *self.backend,
                   "--micro-batch-size", str(m.micro), "--global-batch-size", str(m.global_batch)], "g.log")
        losses = [r["loss"] for r in train_records(run)]
        syncs = outer_records(run)
        if not (len(losses) == 20 and losses[-1] < losses[0] - 0.5):
            raise StageFailed(f"the loss did not fall over 20 steps: {losses}")
        if len(syncs) < 2 or any("skipped" in s for s in syncs):
            raise StageFailed(f"expected the fragments' outer syncs (F=2, H=10, 20 steps), got {syncs}")
        note = {"note": "no NCCL on CPU: the outer groups ran on gloo, the nearest"} if m.cpu else {}
        return {"outer_backend": backend, **note, "loss_first": round(losses[0], 4),
                "loss_last": round(losses[-1], 4), "outer_syncs": len(syncs),
                "sync_seconds": [round(s.get("sync_seconds", float("nan")), 3) for s in syncs]}

    def start_stage(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s

    def left(self) -> float:
        """What is left of the running stage's timeout (a stage of several runs shares it out)."""
        return max(1.0, self._deadline - time.monotonic())


# The stages as data, in order: each one's key, what it runs, its time cap per mode, and the stages it needs.
STAGES = [
    Stage("a", "150m (tiny on CPU), K=1 MuLoCo 4-bit+EF, H=10, 40 steps: loss, tokens/s, MFU, memory vs plan",
          Check.stage_a, {"gpu": 70, "cpu": 240}),
    Stage("b", "resume at step 20 (deterministic kernels): steps 21-40 as in (a)", Check.stage_b,
          {"gpu": 50, "cpu": 180}, needs=("a",)),
    Stage("c", "convert_checkpoint --verify", Check.stage_c, {"gpu": 45, "cpu": 180}, needs=("a",)),
    Stage("d", "2 processes, K=2 MuLoCo 4-bit+EF on gloo, 20 steps: identical weights after syncs", Check.stage_d,
          {"gpu": 50, "cpu": 180}),
    Stage("e", "Newton-Schulz forms timed; DP Muon (fastest form) and DP AdamW, 10 steps each, largest preset "
               "that fits, shipped lr: tokens/s, MFU, "
               "Muon overhead, memory vs plan", Check.stage_e, {"gpu": 150, "cpu": 240}),
    Stage("f", "T=2 x P=2 x K=2 (8 processes) over gloo: distributed Muon, 1F1B, 2 outer syncs", Check.stage_f,
          {"gpu": 60, "cpu": 300}),
    Stage("g", "K=1, outer_backend nccl, outer state on device, streaming F=2 tau=1", Check.stage_g,
          {"gpu": 40, "cpu": 180}),
]


def render(report: dict) -> str:
    return "\n".join([
        *report_head("Device check", report),
        f"MFU = model FLOPs (6 x matmul parameters + 12 x layers x seq x attention width, per token) x tokens/s "
        f"/ {PEAK_TFLOPS:.0f} TFLOP/s.", "", *stage_lines(report)]) + "\n"


CHECK_REPORT = ReportFiles("gpu_check", render)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, "gpu_check.sh", GPU, CPU)
    parser.add_argument("--stages", default=None, help="only these stages, e.g. 'adf' (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.stages or "") - {s.key for s in STAGES}
    if unknown:
        parser.error(f"--stages: no stage {', '.join(sorted(unknown))} (the stages are {''.join(s.key for s in STAGES)})")
    stages = [s for s in STAGES if args.stages is None or s.key in args.stages]
    return run_script(args, argv, "gpu_check.sh", CPU if args.cpu else GPU, Check, stages, CHECK_REPORT)


if __name__ == "__main__":
    sys.exit(main())
