"""The prepared device check (run by scripts/gpu_check.sh; see there for the setup).

Stages, in order; the first failure stops the check and its traceback goes into the report:
  a. one process, the default backend (NCCL), bf16, the 150m preset, K=1 MuLoCo (4-bit statistical
     + error feedback, H=10), 40 steps: the loss falls; tokens/s, MFU and peak memory against
     tools/plan.py's prediction;
  b. the same run resumed from its step-20 checkpoint: steps 21-40 identical to (a) (deterministic
     kernels; a stated bf16 tolerance where a kernel has no deterministic variant);
  c. `python -m tools.convert_checkpoint --verify` on (a)'s checkpoint;
  d. two processes sharing the one GPU (every group on gloo, intra-worker groups of one rank),
     K=2 MuLoCo 4-bit + EF, H=10, 20 steps: the loss falls and both workers hold identical weights
     after each sync (read from the checkpoints saved right after the syncs);
  e. the 3.1b preset for 10 steps (1.76b if it does not fit): throughput, MFU and memory.
With --cpu the same stages run on gloo in fp32 with the tiny preset (so the script cannot rot).

The data are synthetic token ids made here (a learnable Markov chain in Megatron's indexed format):
the GPU machine has no network and the check must not depend on files outside the repository.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK_TFLOPS = 790.0  # dense bf16 peak measured on the H200 the check runs on
BF16_LOSS_TOLERANCE = 1e-2  # relative, for a resume where some kernel has no deterministic variant


@dataclasses.dataclass(frozen=True)
class Mode:
    cpu: bool
    preset: str
    large_presets: tuple[str, ...]  # stage e: the first that fits
    vocab: int
    micro: int
    global_batch: int
    large_micro: int
    large_global_batch: int

    @property
    def name(self) -> str:
        return "cpu" if self.cpu else "gpu"


GPU = Mode(cpu=False, preset="150m", large_presets=("3.1b", "1.76b"), vocab=32000, micro=8, global_batch=32,
           large_micro=2, large_global_batch=16)
CPU = Mode(cpu=True, preset="tiny", large_presets=("tiny",), vocab=1000, micro=4, global_batch=4,
           large_micro=4, large_global_batch=4)


class StageFailed(Exception):
    pass


# -- helpers ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, flags: list[str], log: Path, timeout_s: int, threads: int | None = None) -> None:
    """trainer/pretrain.py in `ranks` processes (what the deepspeed launcher would start on one node)."""
    port = str(free_port())
    procs = []
    with open(log, "w") as out:
        for rank in range(ranks):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                       LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            procs.append(subprocess.Popen([sys.executable, str(REPO / "trainer" / "pretrain.py"), *flags], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise StageFailed(f"pretrain.py exited with {codes} (timeout {timeout_s} s); its output ends:\n"
                          + log.read_text()[-6000:])


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]


def write_markov_data(prefix: Path, vocab: int, tokens: int) -> str:
    """A learnable stream: each token's successor is fixed, except with probability 0.1 (noise)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    successor = rng.integers(1, vocab, size=vocab)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16 if vocab < 65535 else np.int32)
    doc_len = 1000
    for _ in range(max(1, tokens // doc_len)):
        doc = np.empty(doc_len + 1, dtype=np.int64)
        doc[0] = rng.integers(1, vocab)
        noise = rng.random(doc_len) < 0.1
        random_tokens = rng.integers(1, vocab, size=doc_len)
        for i in range(1, doc_len):
            doc[i] = random_tokens[i] if noise[i] else successor[doc[i - 1]]
        doc[doc_len] = 0  # end of document
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def muloco_ds_config(path: Path, mode: Mode, workers: int) -> Path:
    """The shipped 150m MuLoCo K=1 config (tiny CPU config with --cpu), with 4-bit statistical
    compression + error feedback, H=10, K workers and the outer groups on gloo. Its "layout" and
    "recipe" blocks go: they describe the 8-GPU node it was planned for, not this one GPU, and the
    same config also serves stage e's larger presets."""
    source = "cpu_tiny_muloco.json" if mode.cpu else "gpu_150m_muloco_k1.json"
    ds = json.loads((REPO / "ds_configs" / source).read_text())
    ds.pop("layout", None)
    ds.pop("recipe", None)
    ds["muloco"].update(workers=workers, sync_interval=10, outer_backend="gloo",
                        compression={"method": "statistical", "bits": 4, "error_feedback": True})
    ds.setdefault("scheduler", {}).setdefault("params", {})["warmup_iters"] = 5
    path.write_text(json.dumps(ds, indent=2))
    return path


def flops_per_token(preset: str, vocab: int) -> float:
    """Training FLOPs per token, Megatron's convention: 6 x (matmul parameters, head included) plus
    attention scores and values, causal attention counted in full."""
    from trainer.model.presets import PRESETS

    s = PRESETS[preset]
    attention = s.num_attention_heads * s.kv_channels
    per_layer = 2 * s.hidden_size * attention + 2 * s.hidden_size * s.query_groups * s.kv_channels \
        + 3 * s.hidden_size * s.ffn_hidden_size
    matmul_params = s.num_layers * per_layer + s.hidden_size * vocab
    return 6 * matmul_params + 12 * s.num_layers * s.seq_length * attention


def predicted_memory_gib(preset: str, ds_config: Path, mode: Mode, micro: int, global_batch: int) -> float | str:
    try:
        from tools.plan import build_parser, inputs_from_args, make_plan
        from trainer.model.presets import PRESETS

        args = build_parser().parse_args([
            "--model", preset, "--ds-config", str(ds_config), "--vocab-size", str(mode.vocab),
            "--seq-length", str(PRESETS[preset].seq_length), "--micro-batch", str(micro),
            "--global-batch", str(global_batch), "--gpu-memory-gib", "141"])
        return make_plan(inputs_from_args(args)).memory[0].device_total / 2**30
    except Exception as err:  # a figure for the report, not a pass condition
        return f"n/a ({type(err).__name__}: {err})"


def throughput(run_dir: Path, preset: str, mode: Mode) -> dict:
    """Median tokens/s over the logged steps after the first (start-up), MFU, peak memory."""
    records = train_records(run_dir)
    rates = sorted(r["tokens_per_s"] for r in records[1:]) or [records[0]["tokens_per_s"]]
    tokens_per_s = rates[len(rates) // 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    tflops = tokens_per_s * flops_per_token(preset, mode.vocab) / 1e12
    return {"tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 3),
            "mfu": "n/a (CPU)" if mode.cpu else round(tflops / PEAK_TFLOPS, 4),
            "max_memory_gib": summary.get("max_memory_gib", "n/a (CPU)"), "parameters": summary.get("parameters")}


def common_flags(mode: Mode, preset: str, data: str, run_dir: Path, ds_config: Path, steps: int) -> list[str]:
    return ["--ds_config", str(ds_config), "--model", preset, "--data-path", data, "--vocab-size", str(mode.vocab),
            "--run-dir", str(run_dir), "--train-iters", str(steps), "--log-interval", "1", "--eval-interval", "0",
            "--eval-iters", "1", "--seed", "1234"]


# -- the stages ---------------------------------------------------------------------------------------

class Check:
    def __init__(self, mode: Mode, work: Path):
        self.mode, self.work = mode, work
        self.backend = ["--distributed-backend", "gloo"] if mode.cpu else []
        # CPU: one thread per process (the tiny model gains nothing from more, and they would contend).
        self.threads = 1 if mode.cpu else None

    def launch(self, ranks: int, flags: list[str], log: str, timeout_s: int) -> None:
        launch(ranks, flags, self.work / log, timeout_s, self.threads)

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
        self.launch(1, [*common_flags(m, m.preset, self.data(), run, ds, 40), *self.backend, "--deterministic-mode",
                   "--micro-batch-size", str(m.micro), "--global-batch-size", str(m.global_batch),
                   "--save", str(self.work / "ckpt_a"), "--save-interval", "20"], "a.log", 240)
        losses = [r["loss"] for r in train_records(run)]
        if not (len(losses) == 40 and all(map(math.isfinite, losses))):
            raise StageFailed(f"expected 40 finite logged losses, got {losses}")
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        if not last < first - 0.5:
            raise StageFailed(f"the loss did not fall: mean of steps 1-5 {first:.3f}, of steps 36-40 {last:.3f}")
        return {"preset": m.preset, "loss_steps_1_5": round(first, 4), "loss_steps_36_40": round(last, 4),
                **throughput(run, m.preset, m),
                "plan_predicted_memory_gib": predicted_memory_gib(m.preset, ds, m, m.micro, m.global_batch)}

    def stage_b(self) -> dict:
        m = self.mode
        ckpt = self.work / "ckpt_b"
        shutil.copytree(self.work / "ckpt_a" / "iter_0000020", ckpt / "iter_0000020")
        (ckpt / "latest").write_text("20\n")
        run = self.work / "b"
        self.launch(1, [*common_flags(m, m.preset, self.data(), run, self.work / "a.json", 40), *self.backend,
                   "--deterministic-mode", "--micro-batch-size", str(m.micro), "--global-batch-size",
                   str(m.global_batch), "--load", str(ckpt)], "b.log", 180)
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
        with open(log, "w") as out:
            code = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "--load",
                                   str(self.work / "ckpt_a"), "--save", str(self.work / "hf"), "--verify"],
                                  cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=240).returncode
        if code:
            raise StageFailed(f"convert_checkpoint --verify exited with {code}:\n{log.read_text()[-6000:]}")
        return {"verify": [line for line in log.read_text().splitlines() if line.strip()][-3:]}

    def stage_d(self) -> dict:
        import torch

        from trainer.checkpoint.format import CheckpointReader

        m = self.mode
        ds = muloco_ds_config(self.work / "d.json", m, workers=2)
        run, ckpt = self.work / "d", self.work / "ckpt_d"
        # Every group on gloo: NCCL cannot put two ranks of one communicator on one GPU.
        self.launch(2, [*common_flags(m, m.preset, self.data(), run, ds, 20), "--distributed-backend", "gloo",
                   "--micro-batch-size", str(m.micro), "--global-batch-size", str(2 * m.micro),
                   "--save", str(ckpt), "--save-interval", "10"], "d.log", 300)
        losses = [r["loss"] for r in train_records(run)]
        if not (len(losses) == 20 and losses[-1] < losses[0] - 0.5):
            raise StageFailed(f"the loss did not fall over 20 steps: {losses}")
        worst = {}
        for step in (10, 20):  # the checkpoint hook runs after the outer sync of the same step
            reader = CheckpointReader(ckpt, step)
            w0, w1 = reader.rank_state(0)["model"], reader.rank_state(1)["model"]
            worst[step] = max(float((w0[n].float() - w1[n].float()).abs().max()) for n in w0)
            if worst[step] != 0.0 or not all(torch.equal(w0[n], w1[n]) for n in w0):
                raise StageFailed(f"the workers' weights differ after the sync at step {step}: "
                                  f"max |difference| {worst[step]}")
        return {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                "max_weight_difference_after_sync": worst}

    def stage_e(self) -> dict:
        m = self.mode
        ds = muloco_ds_config(self.work / "e.json", m, workers=1)
        for preset in m.large_presets:
            run = self.work / f"e_{preset}"
            try:
                self.launch(1, [*common_flags(m, preset, self.data(), run, ds, 10), *self.backend,
                           "--micro-batch-size", str(m.large_micro), "--global-batch-size",
                           str(m.large_global_batch)], f"e_{preset}.log", 240)
            except StageFailed as err:
                if "out of memory" in str(err).lower() and preset != m.large_presets[-1]:
                    continue
                raise
            return {"preset": preset, **throughput(run, preset, m),
                    "plan_predicted_memory_gib": predicted_memory_gib(preset, ds, m, m.large_micro,
                                                                      m.large_global_batch)}
        raise StageFailed("no preset fit")


STAGES = [("a", "150m (tiny on CPU), K=1 MuLoCo 4-bit+EF, H=10, 40 steps: loss, tokens/s, MFU, memory", "stage_a"),
          ("b", "resume at step 20: steps 21-40 identical", "stage_b"),
          ("c", "convert_checkpoint --verify", "stage_c"),
          ("d", "2 processes, K=2 MuLoCo 4-bit+EF on gloo, 20 steps: identical weights after syncs", "stage_d"),
          ("e", "3.1b (1.76b if it does not fit; tiny on CPU), 10 steps: throughput, MFU, memory", "stage_e")]


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    for package in ("deepspeed", "megatron.core"):
        try:
            info[package] = __import__(package, fromlist=["__version__"]).__version__
        except Exception as err:
            info[package] = f"missing ({err})"
    return info


def render(report: dict) -> str:
    lines = [f"# Device check ({report['mode']})", "",
             f"`bash scripts/gpu_check.sh{' --cpu' if report['mode'] == 'cpu' else ''}`, "
             f"{report['started']}, {report['seconds']:.0f} s in all. Result: **{report['result']}**.", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in report["environment"].items()), "",
             f"MFU = model FLOPs (6 x matmul parameters + 12 x layers x seq x attention width, per token) x tokens/s "
             f"/ {PEAK_TFLOPS:.0f} TFLOP/s.", "", "| stage | what | result | seconds |", "|---|---|---|---|"]
    for stage in report["stages"]:
        lines.append(f"| {stage['stage']} | {stage['what']} | {stage['status']} | {stage.get('seconds', 0):.0f} |")
    for stage in report["stages"]:
        lines += ["", f"## {stage['stage']}: {stage['what']}", ""]
        for key, value in stage.get("results", {}).items():
            lines.append(f"- {key}: {value}")
        if "error" in stage:
            lines += ["", "```", stage["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo, fp32, tiny preset; report to a temporary folder")
    parser.add_argument("--out", default=None, help="report folder (default: results/ on GPU, a temp folder on CPU)")
    args = parser.parse_args()
    mode = CPU if args.cpu else GPU
    out = Path(args.out or (tempfile.mkdtemp(prefix="muloco_cpu_check_") if mode.cpu else REPO / "results"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="muloco_check_work_"))
    started, start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.monotonic()
    report = {"mode": mode.name, "started": started, "environment": environment(), "stages": [], "result": "passed"}
    check = Check(mode, work)
    for key, what, method in STAGES:
        stage = {"stage": key, "what": what, "status": "running"}
        report["stages"].append(stage)
        print(f"[check] stage {key}: {what}", flush=True)
        t0 = time.monotonic()
        try:
            stage["results"] = getattr(check, method)()
            stage["status"] = "passed"
        except Exception as err:
            stage["status"] = "FAILED"
            stage["error"] = str(err) if isinstance(err, StageFailed) else traceback.format_exc()
            report["result"] = f"FAILED at stage {key}"
        stage["seconds"] = time.monotonic() - t0
        print(f"[check] stage {key}: {stage['status']} in {stage['seconds']:.0f} s", flush=True)
        if stage["status"] != "passed":
            break
    report["seconds"] = time.monotonic() - start
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(render(report))
    shutil.rmtree(work, ignore_errors=True)
    print(f"[check] {report['result']}: report {out / 'gpu_check.md'} (+ gpu_check.json)", flush=True)
    return 0 if report["result"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
