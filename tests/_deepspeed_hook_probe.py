"""Launched by tests/test_deepspeed_hook.py on 4 ranks: the outer loop attached to real DeepSpeed
engines by muloco/hook/, in several short trainings per launch (start-up dominates
on CPU). Each case writes OUT/<case>.rank<r>.pt: the model's weights after the run, the worker's
losses per step, the rank's checksum of its global weights after each sync, or the ConfigError a
bad setup gets."""
from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from types import SimpleNamespace
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from deepspeed_muon_precision import newton_schulz_in_fp32  # beside this script
from muloco.diloco.auth import write_new_key
from muloco import attach, data_parallel_workers
from muloco.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
ARGS = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's comes first
OUT = Path(ARGS[0])
H, STEPS = 3, 9
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.6, "nesterov": True}


def example():
    spec = importlib.util.spec_from_file_location("deepspeed_muloco", REPO / "examples" / "deepspeed_muloco.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = example()


def engine_for(workers, zero: int, inner: str, vocab: int = 128):
    args = Namespace(inner=inner, lr=None, micro_batch=2, zero_stage=zero, bf16=False)
    engine, *_ = deepspeed.initialize(model=EXAMPLE.llama(vocab, 16), config=EXAMPLE.ds_config(args), mpu=workers.mpu)
    return engine


def train(name: str, workers, zero: int, inner: str, muloco: dict | None, steps: int = STEPS,
          config_dir: Path = OUT) -> None:
    """`steps` inner steps on every rank's own token stream, with the outer loop attached when
    `muloco` is given; the rank's results to OUT."""
    engine = engine_for(workers, zero, inner)
    outer = (attach(engine, muloco, workers, last_step=steps, config_dir=config_dir, log=lambda record, step: None)
             if muloco else None)
    batches = EXAMPLE.markov_batches(128, 16, 2, seed=dist.get_rank())
    losses, checksums = [], {}
    for _ in range(steps):
        tokens = next(batches)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if outer is not None and outer.outer_step not in checksums:
            checksums[outer.outer_step] = outer.loop.state.checksum()
    result = {"losses": losses, "checksums": checksums,
              "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
              "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__}
    if outer is not None:
        outer.detach()
        result["worker_sha256"] = outer.global_weights_sha256()
    torch.save(result, OUT / f"{name}.rank{dist.get_rank()}.pt")
    engine.destroy()


def refused(name: str, setup) -> None:
    """`setup()` must raise one ConfigError on every rank; its message to OUT."""
    try:
        setup()
        message = None
    except ConfigError as err:
        message = str(err)
    torch.save({"error": message}, OUT / f"{name}.rank{dist.get_rank()}.pt")


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    OUT.mkdir(parents=True, exist_ok=True)
    two, one = data_parallel_workers(2), data_parallel_workers(1)
    none = {"workers": 2, "sync_interval": H, **OUTER, "compression": {"method": "none"}, "auth": "none"}
    for zero in (0, 1, 2):
        for inner in ("adamw", "muon"):
            with newton_schulz_in_fp32():  # as the reference's (tests/deepspeed_muon_precision.py)
                train(f"k2_zero{zero}_{inner}", two, zero, inner, none)
    # The identity: K=1 (D=4), outer lr 1, no momentum, against plain DeepSpeed training.
    train("k1_plain", one, 1, "adamw", None, steps=6)
    train("k1_identity", one, 1, "adamw", {**none, "workers": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
                                            "nesterov": False}, steps=6)
    four_bit = {**none, "compression": {"method": "statistical", "bits": 4, "error_feedback": True}}
    train("k2_4bit_ef_zero2", two, 2, "adamw", four_bit)
    train("k2_4bit_ef_zero0", two, 0, "muon", four_bit)
    # Reduce-scatter, two streaming fragments overlapped with one inner step, tagged with a job secret.
    if dist.get_rank() == 0:
        write_new_key(OUT / "job.key")
    dist.barrier()
    streaming = {**four_bit, "collective": "reduce_scatter", "streaming": {"fragments": 2, "overlap_steps": 1},
                 "auth": {"key_file": "job.key"}}
    train("k2_streaming_zero1", two, 1, "adamw", streaming, config_dir=OUT)

    def other_model():  # worker 1 builds a model with another vocabulary
        engine = engine_for(two, 1, "adamw", vocab=128 if two.topology.coords.worker == 0 else 96)
        attach(engine, none, two)

    refused("different_models", other_model)
    # An engine initialized without mpu=workers.mpu: its data parallelism spans the world.
    spanning = SimpleNamespace(zero_optimization_stage=lambda: 1, zero_offload_optimizer=lambda: None,
                               zero_offload_param=lambda: None, fp16_enabled=lambda: False,
                               data_parallel_group=dist.group.WORLD)
    refused("no_mpu", lambda: attach(spanning, none, two))

    def twice():
        engine = engine_for(two, 1, "adamw")
        attach(engine, none, two)
        attach(engine, none, two)

    refused("attached_twice", twice)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
