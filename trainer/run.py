"""Assembles one run from a resolved config: compute device, process groups, model, inner optimizer,
DeepSpeed engine, data, logging, the MuLoCo outer loop when configured, and the training loop."""
from __future__ import annotations

import json
import os
import random
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from torch.optim.lr_scheduler import LambdaLR

from megatron_patches import apply_cpu_shims_if_needed, initialize_megatron_groups
from muloco.assembly import assemble_outer_loop
from muloco.core import comm
from trainer.checkpoint.checkpointer import Checkpointer, start_from_weights
from trainer.config import RunConfig
from trainer.data import StreamPosition, build_datasets, index_cache_dir, startup_timeout_s, tokenizer_info
from trainer.engine import Engine
from trainer.metrics import MetricsLogger
from trainer.model.builder import (build_model, canonical_names, count_parameters, initialize_weights,
                                   padded_vocab_size)
from trainer.optim.inner import InnerOptimizer
from trainer.outer_host import attached_to_trainer, megatron_tensors
from trainer.optim.routing import route_parameters
from trainer.preemption import Preemption
from trainer.progress_board import ProgressBoard
from trainer.schedule import lr_multiplier
from muloco.core.topology import ParallelSizes, build_topology
from trainer.training import Trainer
from trainer.watchdog import Watchdog


def _seed_everything(seed: int) -> None:
    """After the compute device is chosen: Megatron's tracker seeds the current accelerator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _global_parameter_count(model) -> int:
    total, replicated = count_parameters(model)
    # Sharded parameters sum over TP and PP; replicated ones (norms) count once per stage.
    group = mps.get_model_parallel_group()
    t = torch.tensor([total - replicated, replicated if mps.get_tensor_model_parallel_rank() == 0 else 0],
                     device=comm.group_device(group))
    comm.all_reduce(t, group=group)
    return int(t.sum())


def run(config: RunConfig, trainer_class: type[Trainer] = Trainer) -> dict:
    """`trainer_class` lets tests and benchmarks observe a run assembled exactly as here."""
    device = comm.init_compute_device(int(os.environ.get("LOCAL_RANK", "0")))
    apply_cpu_shims_if_needed()
    # An elastic worker's world is the worker itself; it reads the stream of worker --worker-id.
    sizes = ParallelSizes.from_world(dist.get_world_size(), 1 if config.elastic else config.batch.workers,
                                     config.pipeline_parallel, config.tensor_parallel)
    topology = build_topology(sizes, comm.COLLECTIVE_TIMEOUT)
    if config.elastic:
        topology = replace(topology, coords=replace(topology.coords, worker=config.worker_id))
    c = topology.coords
    watchdog = Watchdog(config.hang_timeout_s, f"rank {topology.rank} (worker {c.worker}, data {c.data}, "
                                               f"pipeline {c.pipeline}, tensor {c.tensor})",
                        board=ProgressBoard.of_launched_job() if config.hang_timeout_s else None)
    if config.startup_timeout_s is None:
        config = replace(config, startup_timeout_s=startup_timeout_s(config.data))
    with watchdog.watching("start-up", config.startup_timeout_s):
        return _assemble_and_train(config, trainer_class, device, sizes, topology, watchdog)


def _assemble_and_train(config: RunConfig, trainer_class: type[Trainer], device: torch.device,
                        sizes: ParallelSizes, topology, watchdog: Watchdog) -> dict:
    initialize_megatron_groups(topology, comm.COLLECTIVE_TIMEOUT)
    _seed_everything(config.seed)
    if config.deterministic:
        # warn_only: a kernel without a deterministic variant still runs (the GPU check states the tolerance).
        torch.use_deterministic_algorithms(True, warn_only=True)
    is_logger = topology.is_logging_rank
    if is_logger:
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.run_dir) / "config.json").write_text(config.to_json())
        print(topology.describe(), flush=True)
        if warning := config.schedule.warmup_warning():
            print(warning, flush=True)
        if config.recipe_table:
            print(config.recipe_table, flush=True)

    tokenizer = tokenizer_info(config.data)
    vocab_size = config.model_vocab_size or tokenizer.vocab_size  # the model's rows, before padding
    vocab = padded_vocab_size(vocab_size, sizes.tensor)
    model = build_model(config.model, vocab, bf16_autocast=config.bf16)
    initialize_weights(model, config.model, config.seed)
    # --finetune or a weights-only checkpoint: the loaded weights replace the initial ones before the
    # optimizer and the outer loop (whose global copy starts from them) exist.
    started_from = start_from_weights(config, model, vocab) if config.load else None
    model.to(device)  # before the optimizers see the parameters: their state is made beside them
    n_params = _global_parameter_count(model)
    canonical = canonical_names(model)
    routing = route_parameters(model.named_parameters(), use_muon=config.optimizer.type == "muon")
    if is_logger:
        print(f"model {config.model_preset}: {n_params:,} parameters (vocab {vocab})", flush=True)
        print(routing.report(), flush=True)

    optimizer = InnerOptimizer(routing, canonical, config.optimizer, config.clip_grad, config.model,
                               mps.get_tensor_model_parallel_group(), topology.inner_dp_group,
                               mps.get_model_parallel_group())
    scheduler = LambdaLR(optimizer, lambda step: lr_multiplier(step, config.schedule))
    engine = Engine(model, optimizer, scheduler, config)

    samples_per_step = config.batch.global_batch
    eval_samples = config.eval_iters * config.batch.per_worker
    datasets = build_datasets(config.data, tokenizer, config.model.seq_length, config.seed,
                              train_samples=config.schedule.train_iters * samples_per_step,
                              valid_samples=max(eval_samples, 1),
                              cache_dir=str(index_cache_dir(config.run_dir)),
                              document_masking=config.model.document_masking)
    identical = config.muloco is not None and config.muloco.identical_worker_data
    position = StreamPosition(topology.coords.worker, topology.coords.data, config.batch, identical)
    logger = MetricsLogger(config.run_dir, config.tensorboard_dir, config.schedule.train_iters, is_logger)
    trainer = trainer_class(config, topology, engine, datasets.train, datasets.valid, position, logger)
    checkpointer = Checkpointer(config, topology, trainer, canonical, vocab_size, vocab)
    loads_state = bool(config.load) and started_from is None  # a resume or a --load-worker start
    starts_from_worker = loads_state and config.load_worker is not None

    def resume() -> None:
        watchdog.enter("resume", config.startup_timeout_s)
        checkpointer.resume(config.load)

    if starts_from_worker:  # before the outer loop exists: a new one starts from the loaded weights
        resume()
    outer = None
    if config.muloco is not None:
        tensors = megatron_tensors(list(model.named_parameters()), canonical, mps.get_tensor_model_parallel_rank(),
                                   config.model.num_layers, config.muloco.streaming.fragments)
        outer = assemble_outer_loop(config.muloco, tensors, topology,
                                    lambda record, step: logger.log(record, step, prefix="outer"),
                                    key_file=Path(config.auth_key_file) if config.auth_key_file is not None else None,
                                    step=trainer.step, worker_id=config.worker_id)
        trainer.extra_state["muloco"] = outer
    if is_logger:
        print(f"global batch {config.batch.global_batch} sequences ({config.batch.per_worker} per worker x "
              f"{config.batch.workers} workers), {config.schedule.train_iters} steps", flush=True)
    if loads_state and not starts_from_worker:
        resume()
    elif started_from is not None and is_logger:
        print(f"started from {started_from}", flush=True)
    logger.start(trainer.step)
    watchdog.enter("training", config.hang_timeout_s)
    # Hooks run in this order after each step: the outer sync, a save, preemption (which may save and
    # stop), and last the watchdog's pet, so a slow sync or save counts as progress only once done.
    with ExitStack() as hooks:
        hooks.callback(logger.close)  # last out, on every path: TensorBoard's writer thread is joined
        if outer is not None:
            hooks.enter_context(attached_to_trainer(outer, trainer))
        if config.save:
            hooks.enter_context(checkpointer.attached_to(trainer))
        hooks.enter_context(Preemption(config, checkpointer, is_logger).attached_to(trainer))
        hooks.enter_context(watchdog.attached_to(trainer))
        summary = trainer.train()
    if device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        summary["max_memory_gib"] = get_accelerator().max_memory_allocated(device) / 2**30
    if is_logger:
        summary["parameters"] = n_params
        (Path(config.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done: run dir {config.run_dir} (config.json, metrics.jsonl, tensorboard/)", flush=True)
    return summary
