"""Launched by tests/test_deepspeed_hook_parallel.py on 4 ranks: the outer loop on the engines that
train models no rank holds whole (ZeRO-3, tensor and pipeline parallelism), several short trainings
per launch (start-up dominates on CPU). Each case writes OUT/<case>.rank<r>.pt: the rank's synced
weights after the run (whole parameters as this rank holds them, or its ZeRO-3 partition), the rank's
checksum of its global weights after each sync, or the ConfigError a setup gets.

    python -m torch.distributed.run --nproc_per_node 4 tests/_deepspeed_parallel_hook_probe.py OUT [CASE ...]
"""
from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from muloco import attach, data_parallel_workers
from muloco.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
ARGS = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
OUT, ONLY = Path(ARGS[0]), set(ARGS[1:])
H, STEPS = 3, 9
NONE = {"workers": 2, "sync_interval": H, "outer_lr": 0.7, "outer_momentum": 0.6, "nesterov": True,
        "compression": {"method": "none"}, "auth": "none"}
FOUR_BIT = {**NONE, "compression": {"method": "statistical", "bits": 4, "error_feedback": True}}


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LLAMA, GPT = example("deepspeed_muloco"), example("megatron_muloco")
GPT_SHAPE = Namespace(vocab=128, seq_length=16, hidden=64, layers=2, micro_batch=2, micro_batches=2, lr=1e-3)


def save(case: str, result: dict) -> None:
    torch.save(result, OUT / f"{case}.rank{dist.get_rank()}.pt")


def run(case: str, engine, workers, muloco: dict, step) -> None:
    """STEPS inner steps (`step()` one of them), the outer loop attached; the rank's results to OUT."""
    outer = attach(engine, muloco, workers, last_step=STEPS, log=lambda record, step: None)
    checksums = {}
    for _ in range(STEPS):
        step()
        if outer.outer_step not in checksums:
            checksums[outer.outer_step] = outer.loop.state.checksum()
    outer.detach()
    synced = {t.name: t.tensor.detach().clone() for t in outer.loop.tensors}
    save(case, {"checksums": checksums, "synced": synced, "coords": workers.topology.coords,
                "outer_steps": outer.outer_step})
    engine.destroy()


def llama_case(case: str, zero: dict, muloco: dict) -> None:
    """K=2 x D=2 of the example's Llama under `zero` (a zero_optimization block)."""
    if ONLY and case not in ONLY:
        return
    workers = data_parallel_workers(2)
    config = {**LLAMA.ds_config(Namespace(inner="adamw", lr=None, micro_batch=2, zero_stage=0, bf16=False)),
              "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=LLAMA.llama(128, 16), config=config, mpu=workers.mpu)
    batches = LLAMA.markov_batches(128, 16, 2, seed=dist.get_rank())

    def step():
        tokens = next(batches)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()

    run(case, engine, workers, muloco, step)


def megatron_case(case: str, tensor: int, pipeline: int, zero: int, muloco: dict) -> None:
    """K=2 workers of examples/megatron_muloco.py's GPT at T x P (D=1) under ZeRO `zero`; the rank's
    parameters, by global name with their tensor-parallel split, to OUT too."""
    if ONLY and case not in ONLY:
        return
    from megatron.core import parallel_state as mps

    GPT.initialize_model_parallel(tensor, pipeline)
    workers = data_parallel_workers(2, mps)
    model = GPT.gpt(GPT_SHAPE.vocab, GPT_SHAPE.seq_length, GPT_SHAPE.hidden, GPT_SHAPE.layers)
    names = GPT.global_names(model)
    args = Namespace(**vars(GPT_SHAPE), zero_stage=zero)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=GPT.ds_config(args),
                                      mpu=workers.mpu)
    c = workers.topology.coords
    batches = GPT.markov_batches(GPT_SHAPE.vocab, GPT_SHAPE.seq_length, GPT_SHAPE.micro_batch, seed=c.worker)
    run(case, engine, workers, muloco, lambda: GPT.train_step(engine, batches, args))
    result = torch.load(OUT / f"{case}.rank{dist.get_rank()}.pt", weights_only=False)
    result["shape"] = tuple(sorted(vars(GPT_SHAPE).items()))  # the reference's
    result["parameters"] = {names[n]: (p.detach().clone(), GPT._split_dim(p)) for n, p in model.named_parameters()}
    save(case, result)
    mps.destroy_model_parallel()


def pipeline_engine_case(case: str, workers: int) -> None:
    """A user's PipelineModule (two stages) under deepspeed.initialize, the outer loop attached to
    its engine: refused with one line on every rank (then the process ends cleanly)."""
    if ONLY and case not in ONLY:
        return
    from deepspeed.pipe import LayerSpec, PipelineModule

    split = data_parallel_workers(workers)
    layers = [LayerSpec(torch.nn.Linear, 8, 8), LayerSpec(torch.nn.ReLU), LayerSpec(torch.nn.Linear, 8, 8)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    try:
        attach(engine, {**NONE, "workers": workers}, split)
        message = None
    except ConfigError as err:
        message = str(err)
    save(case, {"error": message})
    engine.destroy()


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    OUT.mkdir(parents=True, exist_ok=True)
    # ZeRO-3 with the norms kept whole between steps and the matrices partitioned (the persistence
    # threshold between them), and with both offloaded to the host; ZeRO-1 with its optimizer there.
    zero3 = {"stage": 3, "stage3_param_persistence_threshold": 100}
    llama_case("zero3", zero3, NONE)
    llama_case("zero3_offload_4bit", {**zero3, "offload_optimizer": {"device": "cpu"},
                                      "offload_param": {"device": "cpu"}}, FOUR_BIT)
    llama_case("zero1_offload_4bit", {"stage": 1, "offload_optimizer": {"device": "cpu"}}, FOUR_BIT)
    megatron_case("tensor2", 2, 1, 1, NONE)
    megatron_case("tensor2_4bit", 2, 1, 0, FOUR_BIT)
    megatron_case("pipeline2", 1, 2, 0, NONE)
    pipeline_engine_case("pipeline_engine_k2", 2)
    pipeline_engine_case("pipeline_engine_k1", 1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
