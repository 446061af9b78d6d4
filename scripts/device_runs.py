"""The trainer runs the device stages make and what they read back: synthetic data, the shipped configs as a stage
edits them, the trainer's flags, its metrics, throughput and MFU, memory against tools/plan.py's prediction, and the
workers' weights compared in a checkpoint."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from device_runner import REPO, StageFailed

PEAK_TFLOPS = 790.0  # dense bf16 peak measured on the H200 the check runs on
PLAN_UNDERESTIMATE_LIMIT = 0.15  # measured peak memory may exceed the plan's prediction by this much


class Mode(Protocol):
    """What the helpers here read of a device run's mode."""

    cpu: bool
    vocab: int


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
    from tools.plan import build_parser, inputs_from_args
    from tools.planning.plan import make_plan
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
