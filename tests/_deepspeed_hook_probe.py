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
from muloco.core.errors import CheckpointError, ConfigError, DisagreementError

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


def engine_for(workers, zero: int, inner: str, vocab: int = 128, bf16: bool = False, nudge: float = 0.0,
               training_data=None):
    """`nudge`: added to worker 1's first weight matrix (a worker that starts elsewhere)."""
    args = Namespace(inner=inner, lr=None, micro_batch=2, zero_stage=zero, bf16=bf16)
    model = EXAMPLE.llama(vocab, 16)
    if nudge and workers.topology.coords.worker == 1:
        with torch.no_grad():
            next(model.parameters()).add_(nudge)
    engine, _, loader, _ = deepspeed.initialize(model=model, config=EXAMPLE.ds_config(args), mpu=workers.mpu,
                                                training_data=training_data)
    return engine


def quiet(record: dict, step: int) -> None:
    pass


def take_steps(engine, outer, batches, n: int, losses: list, checksums: dict, poison: set[int] = frozenset(),
               applied: list | None = None) -> None:
    """`n` inner steps; a step in `poison` gets a NaN loss on this rank (DeepSpeed skips that step);
    `applied` receives DeepSpeed's was_step_applied() of each."""
    applied = [] if applied is None else applied
    for _ in range(n):
        tokens = next(batches)
        loss = engine(input_ids=tokens, labels=tokens).loss
        if engine.global_steps + 1 in poison:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        applied.append(engine.was_step_applied())
        if outer is not None and outer.outer_step not in checksums:
            checksums[outer.outer_step] = outer.loop.state.checksum()


def results(name: str, engine, outer, losses: list, checksums: dict, **more) -> None:
    """The rank's results to OUT; the outer loop detaches (its syncs in flight land)."""
    result = {"losses": losses, "checksums": checksums,
              "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
              "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__, **more}
    if outer is not None:
        outer.detach()
        result["worker_sha256"] = outer.global_weights_sha256()
        result["global_weights"] = {n: w.clone() for n, w in outer.loop.state.tensors_by_name()["global_weights"].items()}
    torch.save(result, OUT / f"{name}.rank{dist.get_rank()}.pt")
    engine.destroy()


def train(name: str, workers, zero: int, inner: str, muloco: dict | None, steps: int = STEPS,
          config_dir: Path = OUT, bf16: bool = False, poison: set[int] = frozenset()) -> None:
    """`steps` inner steps on every rank's own token stream, with the outer loop attached when
    `muloco` is given; the rank's results to OUT."""
    engine = engine_for(workers, zero, inner, bf16=bf16)
    outer = attach(engine, muloco, workers, last_step=steps, config_dir=config_dir, log=quiet) if muloco else None
    losses, checksums, applied = [], {}, []
    take_steps(engine, outer, EXAMPLE.markov_batches(128, 16, 2, seed=dist.get_rank()), steps, losses, checksums,
               poison, applied)
    results(name, engine, outer, losses, checksums, applied=applied)


def resumed(name: str, workers, zero: int, muloco: dict, save_at: int, steps: int = STEPS) -> None:
    """A run saved after step `save_at` (outer.save_checkpoint, a sync in flight), stopped there as a
    crash would (no final sync) and resumed by fresh engines (outer.load_checkpoint); as train()'s."""
    folder = OUT / f"{name}_checkpoint"
    engine = engine_for(workers, zero, "adamw")
    outer = attach(engine, muloco, workers, last_step=steps, config_dir=OUT, log=quiet)
    batches = EXAMPLE.markov_batches(128, 16, 2, seed=dist.get_rank())
    losses, checksums = [], {}
    take_steps(engine, outer, batches, save_at, losses, checksums)
    outer.save_checkpoint(folder)
    in_flight = len(outer.loop.pending)
    for entry in outer.loop.pending:  # every worker launched it: let its collectives end, unapplied
        entry.future.result()
    outer.__exit__(RuntimeError, RuntimeError("stopped"), None)  # no final sync
    engine.destroy()
    engine = engine_for(workers, zero, "adamw")
    outer = attach(engine, muloco, workers, last_step=steps, config_dir=OUT, log=quiet)
    outer.load_checkpoint(folder)
    take_steps(engine, outer, batches, steps - save_at, losses, checksums)
    results(name, engine, outer, losses, checksums, in_flight_at_save=in_flight)


def refused(name: str, setup) -> None:
    """`setup()` must raise one of the hook's errors on every rank; its kind and message to OUT."""
    try:
        setup()
        message, kind = None, None
    except (ConfigError, CheckpointError, DisagreementError) as err:
        message, kind = str(err), type(err).__name__
    torch.save({"error": message, "kind": kind}, OUT / f"{name}.rank{dist.get_rank()}.pt")


def guards(two, block: dict) -> None:
    """Each of a user loop's mistakes against the guard that names it."""
    refused("different_start", lambda: attach(engine_for(two, 1, "adamw", nudge=1e-3), block, two, log=quiet))
    engine = engine_for(two, 1, "adamw", nudge=1e-3)  # ... unless every worker takes worker 0's
    outer = attach(engine, block, two, start="worker0", log=quiet)
    results("worker0_start", engine, outer, [], {})

    # DeepSpeed's own dataloader: every rank of every worker reads its own samples.
    samples = torch.utils.data.TensorDataset(torch.arange(64))
    engine = engine_for(two, 1, "adamw", training_data=samples)
    outer = attach(engine, block, two, log=quiet)
    first = next(iter(engine.training_dataloader))[0].tolist()
    results("deepspeed_loader", engine, outer, [], {}, first_batch=first, batches=len(engine.training_dataloader))

    def past_the_end():
        engine = engine_for(two, 1, "adamw")
        outer = attach(engine, block, two, last_step=3, log=quiet)
        batches = EXAMPLE.markov_batches(128, 16, 2, seed=dist.get_rank())
        take_steps(engine, outer, batches, 4, [], {})

    refused("past_the_end", past_the_end)

    folder = OUT / "two_tags"
    engine = engine_for(two, 1, "adamw")
    outer = attach(engine, block, two, log=quiet)
    batches = EXAMPLE.markov_batches(128, 16, 2, seed=dist.get_rank())
    take_steps(engine, outer, batches, 3, [], {})
    outer.save_checkpoint(folder)
    take_steps(engine, outer, batches, 3, [], {})
    outer.save_checkpoint(folder)
    outer.detach()
    engine.destroy()

    def resumed_at_other_steps():  # worker 0 from step 3's checkpoint, worker 1 from step 6's
        engine = engine_for(two, 1, "adamw")
        tag = f"global_step{3 * (1 + two.topology.coords.worker)}"
        attach(engine, block, two, log=quiet).load_checkpoint(folder, tag=tag)

    refused("other_steps", resumed_at_other_steps)

    def model_loaded_without_the_outer_state():
        engine = engine_for(two, 1, "adamw")
        outer = attach(engine, block, two, log=quiet)
        engine.load_checkpoint(str(outer.worker_folder(folder)))
        take_steps(engine, outer, EXAMPLE.markov_batches(128, 16, 2, seed=0), 1, [], {})

    refused("outer_state_not_loaded", model_loaded_without_the_outer_state)


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
    guards(two, none)
    # Resumes with a sync in flight (saved after step 4: F=2 fragments, one launched at step 4 and applied at
    # 5) under ZeRO 0 to 3, against the run that was not stopped; K=4 x D=1 too (every worker's files
    # in its own folder: at D=1 they all have DeepSpeed's one name, mp_rank_00_*).
    for zero in (0, 1, 2, 3):
        train(f"k2_uninterrupted_zero{zero}", two, zero, "adamw", streaming)
        resumed(f"k2_resumed_zero{zero}", two, zero, streaming, save_at=4)
    four = data_parallel_workers(4)
    four_workers = {**streaming, "workers": 4}
    train("k4_uninterrupted_zero1", four, 1, "adamw", four_workers)
    resumed("k4_resumed_zero1", four, 1, four_workers, save_at=4)
    # bf16 under ZeRO 1: DeepSpeed skips a step with a non-finite gradient on that worker alone (its
    # overflow check), at a sync step (3, worker 0) and at the step a sync in flight is due (5, worker 1).
    poison = {0: {3}, 1: {5}}[two.topology.coords.worker]
    train("k2_skipped_bf16_zero1", two, 1, "adamw", streaming, bf16=True, poison=poison)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
