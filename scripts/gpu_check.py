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
MIN_STAGE_S is not started, and the report (markdown and JSON) is rewritten after every stage, so a
kill from outside keeps what ran. Every process the check starts is in the check's session (in a
process group of its own, so a timeout kills what it started too) and dies with the check.

The data are synthetic token ids made here (a learnable Markov chain in Megatron's indexed format):
the GPU machine has no network and the check must not depend on files outside the repository.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
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
from typing import Callable

REPO = Path(__file__).resolve().parents[1]

PEAK_TFLOPS = 790.0  # dense bf16 peak measured on the H200 the check runs on
BF16_LOSS_TOLERANCE = 1e-2  # relative, for a resume against a run without deterministic kernels
PLAN_UNDERESTIMATE_LIMIT = 0.15  # measured peak memory may exceed the plan's prediction by this much
STARTED_ENV = "MULOCO_CHECK_STARTED"  # epoch seconds when gpu_check.sh started (the install counts too)
MIN_STAGE_S = 20.0  # a stage given less than this is not started
REPORT_RESERVE_S = 5.0  # kept back from the stages for the last report


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


class StageFailed(Exception):
    pass


class NotSupportedHere(Exception):
    """The stage's path does not exist on this machine; the message says why."""


class CheckKilled(BaseException):
    """SIGTERM or SIGINT reached the check: its children go, the report says so."""

    def __init__(self, signum: int):
        super().__init__(f"the check was killed by signal {signal.Signals(signum).name}")
        self.signum = signum


# -- time budget ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Budget:
    total_s: float
    started: float  # time.time() at the start of the command
    clock: Callable[[], float] = time.time

    def left(self) -> float:
        return self.total_s - (self.clock() - self.started)

    def stage_timeout(self, cap_s: float) -> float:
        """Seconds the next stage may take: its cap, or what is left after the last report's reserve."""
        return max(0.0, min(cap_s, self.left() - REPORT_RESERVE_S))


# -- child processes --------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _child_setup(parent: int) -> None:
    """Runs in the child before exec: a process group of its own (killed whole on a timeout), and
    SIGKILL when the check dies, however it dies (a SIGKILL from outside included)."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the check died before the line above
        os._exit(1)


def run_processes(commands: list[tuple[list[str], dict]], log: Path, timeout_s: float) -> list[int | None]:
    """Start every (argv, env) at once, wait up to `timeout_s` for all; return their exit codes (None
    for one killed at the timeout). Whatever ends the wait (a timeout, CheckKilled), none survives."""
    procs, killed = [], set()
    with open(log, "w") as out:
        try:
            for argv, env in commands:
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                              preexec_fn=lambda parent=os.getpid(): _child_setup(parent)))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in procs:
                if proc.poll() is None:
                    killed.add(proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return [None if p.pid in killed else p.returncode for p in procs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environments(ranks: int, threads: int | None) -> list[dict]:
    """What the deepspeed launcher sets for `ranks` processes on one node."""
    port = str(free_port())
    envs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        envs.append(env)
    return envs


def launch(argv: list[str], ranks: int, log: Path, timeout_s: float, threads: int | None = None) -> None:
    """`argv` (after the interpreter) in `ranks` processes; StageFailed with the log's end unless all exit 0."""
    codes = run_processes([([sys.executable, *argv], env) for env in rank_environments(ranks, threads)],
                          log, timeout_s)
    if any(code != 0 for code in codes):
        raise StageFailed(f"{argv[0]} exited with {codes} (None: killed at the stage's timeout of "
                          f"{timeout_s:.0f} s); its output ends:\n" + log.read_text()[-6000:])


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "loss" in r]


def outer_records(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "outer_step" in r]


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return list(map(json.loads, filter(None, lines)))


def write_markov_data(prefix: Path, vocab: int, tokens: int) -> str:
    """A learnable stream: each token's successor is fixed, except with probability 0.1 (noise)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    successor = rng.integers(1, vocab, size=vocab)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16 if vocab < 65535 else np.int32)
    doc_len = 1000
    docs = max(1, tokens // doc_len)
    # Each document's draws in the order a document-by-document loop makes them; the chain then
    # steps every document at once (tens of millions of tokens in seconds).
    first, noise, random_tokens = np.empty(docs, dtype=np.int64), np.empty((docs, doc_len), dtype=bool), \
        np.empty((docs, doc_len), dtype=np.int64)
    for d in range(docs):
        first[d] = rng.integers(1, vocab)
        noise[d] = rng.random(doc_len) < 0.1
        random_tokens[d] = rng.integers(1, vocab, size=doc_len)
    chain = np.zeros((docs, doc_len + 1), dtype=np.int64)  # the last column: end of document (0)
    chain[:, 0] = first
    for i in range(1, doc_len):
        chain[:, i] = np.where(noise[:, i], random_tokens[:, i], successor[chain[:, i - 1]])
    for doc in chain:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def shipped_config(name: str) -> dict:
    """A shipped ds_config without its "layout" and "recipe" blocks: they describe the 8-GPU node it was
    planned for, not this one GPU (the planner would read the layout, the trainer check it)."""
    from muloco.core.typed_json import read_json_object

    ds = read_json_object(REPO / "ds_configs" / name)
    ds.pop("layout", None)
    ds.pop("recipe", None)
    return ds


def muloco_ds_config(path: Path, mode: Mode, workers: int, sync_interval: int = 10, **muloco) -> Path:
    """The shipped 150m MuLoCo K=1 config (tiny CPU config with --cpu), with 4-bit statistical
    compression + error feedback, H=`sync_interval`, K workers, the outer groups on gloo unless
    `muloco` says otherwise, the job secret in a key file beside it (authentication on, as users run
    it), and 5 warm-up steps (the stages train 20-40 steps)."""
    from muloco.diloco.auth import write_new_key

    key = path.parent / "job.key"
    if not key.exists():
        write_new_key(key)
    ds = shipped_config("cpu_tiny_muloco.json" if mode.cpu else "gpu_150m_muloco_k1.json")
    ds["muloco"].update({"workers": workers, "sync_interval": sync_interval, "outer_backend": "gloo",
                         "compression": {"method": "statistical", "bits": 4, "error_feedback": True},
                         "auth": {"key_file": key.name, "job_id": "gpu-check"}, **muloco})
    ds.setdefault("scheduler", {}).setdefault("params", {})["warmup_iters"] = 5
    return write_ds_config(path, ds)


def data_parallel_ds_config(path: Path, name: str, ns_form: str | None = None) -> Path:
    """A shipped config as data-parallel training (no muloco block), its lr and schedule untouched;
    with `ns_form`, Muon's Newton-Schulz in that form."""
    ds = shipped_config(name)
    ds.pop("muloco", None)
    if ns_form is not None:
        ds["optimizer"]["params"]["ns_form"] = ns_form
    return write_ds_config(path, ds)


def write_ds_config(path: Path, ds: dict) -> Path:
    """An edited config, checked by the trainer's loader first (so a bad edit fails here, by name)."""
    from trainer.ds_config import load_ds_config

    load_ds_config(ds)
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


def predicted_memory_gib(preset: str, ds_config: Path, mode: Mode, micro: int, global_batch: int) -> float:
    """tools/plan.py's device memory for this one-GPU run (T = P = D = 1)."""
    from tools.plan import build_parser, inputs_from_args, make_plan
    from trainer.model.presets import PRESETS

    args = build_parser().parse_args([
        "--model", preset, "--ds_config", str(ds_config), "--vocab-size", str(mode.vocab),
        "--seq-length", str(PRESETS[preset].seq_length), "--micro-batch-size", str(micro),
        "--global-batch-size", str(global_batch), "--gpu-memory-gib", "141"])
    return make_plan(inputs_from_args(args)).memory[0].device_total / 2**30


def memory_against_plan(measured_gib: float | None, predicted_gib: float) -> dict:
    """The figures for the report; StageFailed when the plan underestimates by more than the limit
    (a plan that says a run fits when it does not would send users to machines too small)."""
    figures = {"plan_predicted_memory_gib": round(predicted_gib, 2)}
    if measured_gib is None:
        return {**figures, "memory_vs_plan": "n/a (no device memory on CPU)"}
    ratio = measured_gib / predicted_gib
    figures.update(max_memory_gib=round(measured_gib, 2), memory_vs_plan=round(ratio, 3))
    if ratio > 1 + PLAN_UNDERESTIMATE_LIMIT:
        raise StageFailed(f"peak memory {measured_gib:.2f} GiB is {ratio:.2f}x the plan's {predicted_gib:.2f} GiB: "
                          f"tools/plan.py underestimates by more than {PLAN_UNDERESTIMATE_LIMIT:.0%}")
    return figures


def throughput(run_dir: Path, preset: str, mode: Mode) -> dict:
    """Median tokens/s over the logged steps after the first (start-up), MFU, peak memory."""
    records = train_records(run_dir)
    rates = sorted(r["tokens_per_s"] for r in records[1:]) or [records[0]["tokens_per_s"]]
    tokens_per_s = rates[len(rates) // 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    tflops = tokens_per_s * flops_per_token(preset, mode.vocab) / 1e12
    return {"tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 3),
            "mfu": "n/a (CPU)" if mode.cpu else round(tflops / PEAK_TFLOPS, 4),
            "max_memory_gib": summary.get("max_memory_gib"), "parameters": summary.get("parameters")}


def common_flags(mode: Mode, preset: str, data: str, run_dir: Path, ds_config: Path, steps: int) -> list[str]:
    return ["--ds_config", str(ds_config), "--model", preset, "--data-path", data, "--vocab-size", str(mode.vocab),
            "--run-dir", str(run_dir), "--train-iters", str(steps), "--log-interval", "1", "--eval-interval", "0",
            "--eval-iters", "1", "--seed", "1234"]


def workers_identical(ckpt: Path, step: int, ranks_per_worker: int) -> float:
    """Max |difference| between worker 0's and worker 1's shards at `step`; StageFailed unless all equal."""
    import torch

    from trainer.checkpoint.format import CheckpointReader

    reader = CheckpointReader(ckpt, step)
    worst = 0.0
    for rank in range(ranks_per_worker):
        w0, w1 = reader.rank_state(rank)["model"], reader.rank_state(rank + ranks_per_worker)["model"]
        worst = max([worst, *(float((w0[n].float() - w1[n].float()).abs().max()) for n in w0)])
        if worst != 0.0 or not all(torch.equal(w0[n], w1[n]) for n in w0):
            raise StageFailed(f"the workers' weights differ after the sync at step {step} (worker-local rank {rank}): "
                              f"max |difference| {worst}")
    return worst


# -- gloo on CUDA tensors ------------------------------------------------------------------------------

def gloo_probe(out: Path) -> None:
    """Run in 2 processes: each collective the trainer and Megatron issue, over gloo, on the compute
    device's tensors; rank 0 writes {collective: "ok" | what went wrong} after each one. Each probe
    runs on a gloo group of its own with a short timeout: a collective that gloo cannot run on these
    tensors may leave its pairs broken (on the H200, once, "writev ... Bad address"), which must
    not fail the next probe or the barrier between them (the default group, which no probe uses)."""
    import torch
    import torch.distributed as dist

    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, device = dist.get_rank(), torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peer = 1 - rank

    def all_reduce(group):
        t = torch.full((4,), rank + 1.0, device=device)
        dist.all_reduce(t, group=group)
        return t, torch.full((4,), 3.0)

    def broadcast(group):
        t = torch.full((4,), float(rank), device=device)
        dist.broadcast(t, src=1, group=group)
        return t, torch.ones(4)

    def all_gather_into_tensor(group):
        out = torch.empty(4, device=device)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=device), group=group)
        return out, torch.tensor([0.0, 0.0, 1.0, 1.0])

    def reduce_scatter_tensor(group):
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, torch.arange(4.0, device=device), group=group)
        return out, 2 * torch.arange(4.0)[2 * rank:2 * rank + 2]

    def all_to_all_single(group):
        out = torch.empty(2, device=device)
        dist.all_to_all_single(out, torch.tensor([10.0 * rank, 10.0 * rank + 1], device=device), group=group)
        return out, torch.tensor([float(rank), 10.0 + rank])

    def send_recv(group):  # Megatron's pipeline p2p (batch_isend_irecv over isend/irecv)
        got = torch.empty(3, device=device)
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank), device=device), peer, group=group),
               dist.P2POp(dist.irecv, got, peer, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got, torch.full((3,), float(peer))

    results = {}
    for probe in (all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, send_recv):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
        try:
            got, expected = probe(group)
            results[probe.__name__] = "ok" if torch.equal(got.cpu(), expected) else f"wrong result {got.tolist()}"
        except Exception as err:  # noqa: BLE001 - the point is to record what fails
            results[probe.__name__] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if rank == 0:  # after each probe: a probe that hangs its peer still leaves what ran before it
            out.write_text(json.dumps({"device": str(device), "collectives": results}))
        dist.barrier()
    dist.destroy_process_group()


# -- the stages ---------------------------------------------------------------------------------------

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
            launch([str(Path(__file__).resolve()), "--gloo-probe", str(probe)], 2, self.work / "f_probe.log",
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


@dataclasses.dataclass(frozen=True)
class Stage:
    key: str
    what: str
    method: str
    cap_s: dict  # the stage's longest timeout per mode
    needs: tuple[str, ...] = ()


STAGES = [
    Stage("a", "150m (tiny on CPU), K=1 MuLoCo 4-bit+EF, H=10, 40 steps: loss, tokens/s, MFU, memory vs plan",
          "stage_a", {"gpu": 70, "cpu": 240}),
    Stage("b", "resume at step 20 (deterministic kernels): steps 21-40 as in (a)", "stage_b",
          {"gpu": 50, "cpu": 180}, needs=("a",)),
    Stage("c", "convert_checkpoint --verify", "stage_c", {"gpu": 45, "cpu": 180}, needs=("a",)),
    Stage("d", "2 processes, K=2 MuLoCo 4-bit+EF on gloo, 20 steps: identical weights after syncs", "stage_d",
          {"gpu": 50, "cpu": 180}),
    Stage("e", "Newton-Schulz forms timed; DP Muon (fastest form) and DP AdamW, 10 steps each, largest preset "
               "that fits, shipped lr: tokens/s, MFU, "
               "Muon overhead, memory vs plan", "stage_e", {"gpu": 150, "cpu": 240}),
    Stage("f", "T=2 x P=2 x K=2 (8 processes) over gloo: distributed Muon, 1F1B, 2 outer syncs", "stage_f",
          {"gpu": 60, "cpu": 300}),
    Stage("g", "K=1, outer_backend nccl, outer state on device, streaming F=2 tau=1", "stage_g",
          {"gpu": 40, "cpu": 180}),
]


# -- the report -----------------------------------------------------------------------------------------

def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    for package in ("deepspeed", "megatron.core", "transformers"):
        try:
            info[package] = __import__(package, fromlist=["__version__"]).__version__
        except Exception as err:
            info[package] = f"missing ({err})"
    return info


def render(report: dict) -> str:
    return "\n".join([
        *report_head("Device check", report),
        f"MFU = model FLOPs (6 x matmul parameters + 12 x layers x seq x attention width, per token) x tokens/s "
        f"/ {PEAK_TFLOPS:.0f} TFLOP/s.", "", *stage_lines(report)]) + "\n"


def report_head(title: str, report: dict) -> list[str]:
    return [f"# {title} ({report['mode']})", "",
            f"`{report['command']}`, {report['started']}, {report['seconds']:.0f} s of a {report['budget_s']:.0f} s "
            f"budget (from the command's start). Result: **{report['result']}**.", "",
            "Environment: " + ", ".join(f"{k} {v}" for k, v in report["environment"].items()), ""]


def stage_lines(report: dict) -> list[str]:
    """The stages' table, then each stage's results and error."""
    lines = ["| stage | what | result | seconds | timeout |", "|---|---|---|---|---|"]
    for stage in report["stages"]:
        lines.append(f"| {stage['stage']} | {stage['what']} | {stage['status']} | {stage.get('seconds', 0):.0f} | "
                     f"{stage.get('timeout_s', 0):.0f} |")
    for stage in report["stages"]:
        lines += ["", f"## {stage['stage']}: {stage['what']}", ""]
        for key, value in stage.get("results", {}).items():
            lines.append(f"- {key}: {value}")
        if "error" in stage:
            lines += ["", "```", stage["error"].rstrip(), "```"]
    return lines


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    """A report's two files in the --out folder: NAME.json and NAME.md (`render` of the same dict)."""
    name: str
    render: Callable[[dict], str]

    def write(self, out: Path, report: dict) -> None:
        """Both files replaced whole (a kill mid-write leaves the previous report, never half of one)."""
        for name, text in ((f"{self.name}.json", json.dumps(report, indent=2, default=str)),
                           (f"{self.name}.md", self.render(report))):
            tmp = out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, out / name)


CHECK_REPORT = ReportFiles("gpu_check", render)


def run_stages(check, stages: list[Stage], budget: Budget, report: dict, out: Path,
               files: ReportFiles = CHECK_REPORT) -> None:
    failed: set[str] = set()
    for spec in stages:
        stage = {"stage": spec.key, "what": spec.what}
        report["stages"].append(stage)
        timeout_s = budget.stage_timeout(spec.cap_s[check.mode.name])
        blocked = [k for k in spec.needs if k in failed]
        if blocked:
            stage["status"] = f"not run: needs stage {', '.join(blocked)}"
            failed.add(spec.key)
        elif timeout_s < MIN_STAGE_S:
            stage["status"] = f"not run: {max(0.0, budget.left()):.0f} s of the time budget left"
            failed.add(spec.key)
        else:
            stage.update(status="running", timeout_s=timeout_s)
            files.write(out, {**report, "seconds": budget.total_s - budget.left()})
            print(f"[check] stage {spec.key} (timeout {timeout_s:.0f} s): {spec.what}", flush=True)
            t0 = time.monotonic()
            check.start_stage(timeout_s)
            try:
                stage["results"] = getattr(check, spec.method)()
                stage["status"] = "passed"
            except NotSupportedHere as err:
                stage["status"] = "not supported here"
                stage["error"] = str(err)
            except CheckKilled as err:
                stage.update(status=f"killed ({err})", seconds=time.monotonic() - t0)
                raise
            except Exception as err:
                stage["status"] = "FAILED"
                stage["error"] = str(err) if isinstance(err, StageFailed) else traceback.format_exc()
                failed.add(spec.key)
            stage["seconds"] = time.monotonic() - t0
        print(f"[check] stage {spec.key}: {stage['status']} ({stage.get('seconds', 0):.0f} s)", flush=True)
        files.write(out, {**report, "seconds": budget.total_s - budget.left()})
    unsupported = [s["stage"] for s in report["stages"] if s["status"] == "not supported here"]
    if failed:
        report["result"] = f"FAILED or not run: stages {', '.join(sorted(failed))}"
    else:
        report["result"] = "passed" + (f" (not supported here: {', '.join(unsupported)})" if unsupported else "")


def _raise_killed(signum, frame):
    raise CheckKilled(signum)


def run_check(check, stages: list[Stage], budget: Budget, out: Path, command: str, files: ReportFiles) -> int:
    """`stages` of `check` within `budget`, the report rewritten in `out` after each and at the end
    (a SIGTERM or SIGINT included); the exit code: 0 when every stage passed."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_killed)
    report = {"mode": check.mode.name, "command": command, "budget_s": budget.total_s,
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(budget.started)),
              "environment": {}, "stages": [], "result": "running"}
    code = 1
    try:
        report["environment"] = environment()
        run_stages(check, stages, budget, report, out, files)
        code = 0 if report["result"].startswith("passed") else 1
    except CheckKilled as err:
        report["result"] = f"killed ({err})"
        code = 128 + err.signum
    finally:
        report["seconds"] = budget.total_s - budget.left()
        files.write(out, report)
    print(f"[check] {report['result']} in {report['seconds']:.0f} s: report {out / (files.name + '.md')} "
          f"(+ {files.name}.json)", flush=True)
    return code


def add_run_arguments(parser: argparse.ArgumentParser, script: str, gpu: Mode, cpu: Mode) -> None:
    """The options every device script takes (this one and gpu_evidence.py)."""
    parser.add_argument("--cpu", action="store_true", help="gloo, fp32, tiny preset; report to a temporary folder")
    parser.add_argument("--out", default=None, help="report folder (default: results/ on GPU, a temp folder on CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run from {script}'s start "
                             f"(default: {gpu.budget_s:.0f} on GPU, {cpu.budget_s:.0f} on CPU)")


def run_script(args: argparse.Namespace, argv: list[str] | None, script: str, mode, make_check, stages: list[Stage],
               files: ReportFiles) -> int:
    """`stages` of `make_check(mode, work)` as `args` (add_run_arguments) ask: the budget counted from the
    shell script's start, the report in --out (results/ on GPU, a temporary folder on CPU), a scratch
    folder `work` removed at the end."""
    budget = Budget(args.budget_s or mode.budget_s, float(os.environ.get(STARTED_ENV) or time.time()))
    name = Path(script).stem
    out = Path(args.out or (tempfile.mkdtemp(prefix=f"muloco_cpu_{name}_") if mode.cpu else REPO / "results"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"muloco_{name}_work_"))
    command = " ".join([f"bash scripts/{script}", *(argv if argv is not None else sys.argv[1:])])
    try:
        return run_check(make_check(mode, work), stages, budget, out, command, files)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, "gpu_check.sh", GPU, CPU)
    parser.add_argument("--stages", default=None, help="only these stages, e.g. 'adf' (default: all)")
    parser.add_argument("--gloo-probe", type=Path, default=None, help=argparse.SUPPRESS)  # stage f's worker
    args = parser.parse_args(argv)
    if args.gloo_probe:
        gloo_probe(args.gloo_probe)
        return 0
    unknown = set(args.stages or "") - {s.key for s in STAGES}
    if unknown:
        parser.error(f"--stages: no stage {', '.join(sorted(unknown))} (the stages are {''.join(s.key for s in STAGES)})")
    stages = [s for s in STAGES if args.stages is None or s.key in args.stages]
    return run_script(args, argv, "gpu_check.sh", CPU if args.cpu else GPU, Check, stages, CHECK_REPORT)


if __name__ == "__main__":
    sys.exit(main())
