"""Assembles one run from a resolved config: process groups, model, inner optimizer, DeepSpeed
engine, data, logging, the MuLoCo outer loop when configured, and the training loop."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from torch.optim.lr_scheduler import LambdaLR

from megatron_patches import DeepSpeedMpu, apply_cpu_shims_if_needed, initialize_megatron_groups
from trainer.checkpoint import Checkpointer
from trainer.config import RunConfig
from trainer.diloco.outer_loop import OuterLoop
from trainer.data import StreamPosition, build_datasets, tokenizer_info
from trainer.metrics import MetricsLogger
from trainer.model.builder import (build_model, canonical_names, count_parameters, initialize_weights,
                                   padded_vocab_size)
from trainer.optim.inner import InnerOptimizer
from trainer.optim.routing import route_parameters
from trainer.schedule import lr_multiplier
from trainer.topology import ParallelSizes, build_topology
from trainer.training import Trainer


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _global_parameter_count(model, topology) -> int:
    total, replicated = count_parameters(model)
    # Sharded parameters sum over TP and PP; replicated ones (norms) count once per stage.
    t = torch.tensor([total - replicated, replicated if mps.get_tensor_model_parallel_rank() == 0 else 0])
    dist.all_reduce(t, group=mps.get_model_parallel_group())
    return int(t.sum())


def run(config: RunConfig, trainer_class: type[Trainer] = Trainer) -> dict:
    """`trainer_class` lets tests and benchmarks observe a run assembled exactly as here."""
    from trainer.pretrain import COLLECTIVE_TIMEOUT

    apply_cpu_shims_if_needed()
    # An elastic worker's world is the worker itself; it reads the stream of worker --worker-id.
    sizes = ParallelSizes.from_world(dist.get_world_size(), 1 if config.elastic else config.batch.workers,
                                     config.pipeline_parallel, config.tensor_parallel)
    topology = build_topology(sizes, COLLECTIVE_TIMEOUT)
    if config.elastic:
        topology = replace(topology, coords=replace(topology.coords, worker=config.worker_id))
    initialize_megatron_groups(topology, COLLECTIVE_TIMEOUT)
    _seed_everything(config.seed)
    is_logger = topology.is_logging_rank
    if is_logger:
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.run_dir) / "config.json").write_text(config.to_json())
        print(topology.describe(), flush=True)

    tokenizer = tokenizer_info(config.data)
    vocab = padded_vocab_size(tokenizer.vocab_size, sizes.tensor)
    if config.bf16 and apply_cpu_shims_if_needed():
        raise ValueError("bf16 needs an accelerator; on CPU remove the ds_config's bf16 block (training runs in fp32)")
    model = build_model(config.model, vocab, bf16_autocast=config.bf16)
    initialize_weights(model, config.model, config.seed)
    n_params = _global_parameter_count(model, topology)
    canonical = canonical_names(model)
    routing = route_parameters(model.named_parameters(), use_muon=config.optimizer.name == "muon")
    if is_logger:
        print(f"model {config.model_preset}: {n_params:,} parameters (vocab {vocab})", flush=True)
        print(routing.report(), flush=True)

    optimizer = InnerOptimizer(routing, canonical, config.optimizer, config.schedule.clip_grad, config.model,
                               mps.get_tensor_model_parallel_group(), topology.inner_dp_group,
                               mps.get_model_parallel_group())
    scheduler = LambdaLR(optimizer, lambda step: lr_multiplier(step, config.schedule))
    ds_config = dict(config.ds_config, managed_gradient_accumulation=False, gradient_clipping=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, mpu=DeepSpeedMpu)

    samples_per_step = config.batch.global_batch
    eval_samples = config.eval_iters * config.batch.per_worker
    datasets = build_datasets(config.data, tokenizer, config.model.seq_length, config.seed,
                              train_samples=config.schedule.train_iters * samples_per_step,
                              valid_samples=max(eval_samples, 1),
                              cache_dir=str(Path(config.run_dir) / "data_cache"))
    identical = config.muloco is not None and config.muloco.identical_worker_data
    position = StreamPosition(topology.coords.worker, topology.coords.data, config.batch, identical)
    logger = MetricsLogger(config.run_dir, config.tensorboard_dir, config.schedule.train_iters, is_logger)
    trainer = trainer_class(config, topology, engine, datasets.train, datasets.valid, position, logger)
    if config.muloco is not None:
        loop_class = OuterLoop
        if config.elastic:
            from trainer.elastic.outer_loop import ElasticOuterLoop as loop_class
        outer = loop_class(config.muloco, list(model.named_parameters()), canonical, topology,
                          mps.get_tensor_model_parallel_rank(), config.model.num_layers,
                          log=lambda record, step: logger.log(record, step, prefix="outer"))
        outer.attach(engine)
        trainer.extra_state["muloco"] = outer
    if is_logger:
        print(f"global batch {config.batch.global_batch} sequences ({config.batch.per_worker} per worker x "
              f"{config.batch.workers} workers), {config.schedule.train_iters} steps", flush=True)
    Checkpointer(config, topology, trainer, canonical, tokenizer.vocab_size, vocab).attach()  # --load, --save
    if config.elastic:
        outer.join(trainer)  # the first quorum; a restarted worker loads the outer state from a live peer
    try:
        summary = trainer.train()
    finally:
        if config.elastic:
            outer.leave()
    logger.close()
    if is_logger:
        summary["parameters"] = n_params
        (Path(config.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done: run dir {config.run_dir} (config.json, metrics.jsonl, tensorboard/)", flush=True)
    return summary
