"""What the DeepSpeed hook costs: its sync's time on the example's models against the trainer's path on
the same shapes, and peak memory per rank by ZeRO stage and tensor-parallel size, beside the planner's
memory model (tools/plan.py's, for a hook run).

    python benchmarks/deepspeed_hook_cost.py [--hidden 256 --layers 4 --syncs 6]

Each run is one 4-rank launch (gloo on CPU, one thread per rank) of K=2 workers with 4-bit + EF syncs
every H steps:
- zero0, zero1, zero3: examples/deepspeed_muloco.py's Llama and loop, D=2, at that ZeRO stage;
- t1, t2: examples/megatron_muloco.py's Megatron-core GPT (the same hidden size and layers) under ZeRO 1,
  at T=1 (D=2) and T=2 (D=1).
Measured:
- hook: the median `sync_seconds` and `sync_cpu_seconds` of its syncs (the records the outer loop logs);
- trainer path: in the zero0 launch, an OuterLoop over the same parameters as this trainer hands them
  (whole tensors replicated over the D ranks, each rank owning 1/D), synced as many times;
- memory: each rank's peak resident set (ru_maxrss) after the run minus before the model was built, the
  largest over the ranks; the planner's figure is tools/plan.py's model for a hook run of the rank's own
  parameters (zero_model_states: weights 4 + gradients 4, fp32 master weights 4 from ZeRO 1, the master
  weights and AdamW's 8 of moments partitioned from ZeRO 1, the weights and gradients from ZeRO 3 with
  what it keeps gathered between forward and backward, here all; host outer state 12 + 4 of error
  feedback per element of what the rank syncs, hook_synced), the largest over the ranks. It counts no
  activations, no DeepSpeed buffers and no allocator caching, which the resident set holds.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.trainer_runs import launcher_command, shared_memory_files

REPO = Path(__file__).resolve().parents[1]
K = 2
RUNS = {"zero0": ("llama", 0, 1), "zero1": ("llama", 1, 1), "zero3": ("llama", 3, 1),  # model, ZeRO stage, T
        "t1": ("gpt", 1, 1), "t2": ("gpt", 1, 2)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sync-interval", type=int, default=3)
    p.add_argument("--syncs", type=int, default=6)
    p.add_argument("--run", choices=sorted(RUNS), default=None, help=argparse.SUPPRESS)  # a launched rank's
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def planned_mib(model, zero: int, data: int, compression) -> float:
    """tools/plan.py's bytes for a hook run of this rank's parameters (fp32 weights, AdamW)."""
    from muloco.hook.engine_shards import _embedding_parameters
    from tools.planning.memory import outer_state_bytes, zero_model_states
    from tools.planning.shards import ShardParam
    from tools.planning.synced import hook_synced

    embedding = _embedding_parameters(model)
    params = [ShardParam(name, tuple(getattr(p, "ds_shape", p.shape)), getattr(p, "tensor_model_parallel", False),
                         getattr(p, "partition_dim", None) == 1, id(p) in embedding)
              for name, p in model.named_parameters()]
    n = sum(p.numel for p in params)
    device = sum(zero_model_states(params, zero, data, bf16=False).values()) + 8 * n / (data if zero else 1)
    host = max(outer_state_bytes(hook_synced(params, zero, data, d), compression) for d in range(data))
    return (device + host) / 2**20


def measure(args: argparse.Namespace) -> dict:
    """One launched rank: train with the hook attached; in the zero0 run also the trainer's path."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from muloco import attach, data_parallel_workers
    from muloco.core.typed_json import load
    from muloco.diloco.config import MuLoCoConfig
    from muloco.diloco.membership import StaticMembership
    from muloco.diloco.outer_loop import OuterLoop
    from muloco.diloco.plan import synced_tensors

    kind, zero, tensor = RUNS[args.run]
    deepspeed.init_distributed(dist_backend="gloo")
    block = {"workers": K, "sync_interval": args.sync_interval, "auth": "none",
             "compression": {"method": "statistical", "bits": 4, "error_feedback": True}}
    before = _peak_mib()
    if kind == "llama":
        example = _example("deepspeed_muloco")
        workers = data_parallel_workers(K)
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=args.hidden,
                                             intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, tie_word_embeddings=False))
        ds = example.ds_config(argparse.Namespace(inner="adamw", lr=None, micro_batch=4, zero_stage=0, bf16=False))
        engine, *_ = deepspeed.initialize(model=model, config={**ds, "zero_optimization": {"stage": zero}},
                                          mpu=workers.mpu)
        batches = example.markov_batches(1024, 64, 4, seed=dist.get_rank())

        def step():
            tokens = next(batches)
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()
    else:
        from megatron.core import parallel_state as mps
        example = _example("megatron_muloco")
        example.initialize_model_parallel(tensor, 1)
        workers = data_parallel_workers(K, mps)
        shape = example.parse_args(["--vocab", "1024", "--seq-length", "64", "--hidden", str(args.hidden),
                                    "--layers", str(args.layers), "--micro-batch", "4", "--micro-batches", "1",
                                    "--zero-stage", str(zero)])
        model = example.gpt(shape.vocab, shape.seq_length, shape.hidden, shape.layers)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=example.ds_config(shape), mpu=workers.mpu)
        c = workers.topology.coords
        batches = example.markov_batches(shape.vocab, shape.seq_length, shape.micro_batch,
                                         seed=c.worker * workers.topology.sizes.data + c.data)

        def step():
            example.train_step(engine, batches, shape)
    records = []
    outer = attach(engine, block, workers, log=lambda record, step: records.append(record))
    for _ in range(args.syncs * args.sync_interval):
        step()
    outer.detach()
    config = load(MuLoCoConfig, block, "muloco")
    result = {"hook_sync_s": [r["sync_seconds"] for r in records], "hook_cpu_s": [r["sync_cpu_seconds"] for r in records],
              "peak_mib": _peak_mib() - before,
              "planned_mib": planned_mib(model, zero, workers.topology.sizes.data, config.compression),
              "parameters": sum(p.numel() for p in model.parameters())}
    if args.run == "zero0":  # the trainer's path: whole tensors, replicated, 1/D owned per rank
        trainer_records = []
        loop = OuterLoop(config, synced_tensors(list(model.parameters()), None, 1), workers.topology,
                         lambda record, step: trainer_records.append(record),
                         StaticMembership(config, workers.topology, None))
        generator = torch.Generator().manual_seed(dist.get_rank())
        for sync in range(1, args.syncs + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
            loop.after_inner_step(sync * args.sync_interval)
        loop.finish()
        result["trainer_sync_s"] = [r["sync_seconds"] for r in trainer_records]
        result["trainer_cpu_s"] = [r["sync_cpu_seconds"] for r in trainer_records]
    return result


def launch(args: argparse.Namespace, run: str, port: int, out: Path) -> list[dict]:
    command = [*launcher_command("deepspeed", 4, port), __file__, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--sync-interval", str(args.sync_interval), "--syncs", str(args.syncs),
               "--run", run, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out.mkdir(parents=True)
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    for path in shared_memory_files(port):  # DeepSpeed's CPU all-reduce buffers of this launch
        path.unlink(missing_ok=True)
    if done.returncode != 0:
        sys.exit(f"the {run} launch failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def main() -> None:
    args = parse_args()
    if args.run is not None:  # a launched rank
        import torch.distributed as dist
        result = measure(args)
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = {run: launch(args, run, 29700 + i, Path(tmp, run)) for i, run in enumerate(RUNS)}

    def median(run: str, what: str) -> float:  # over ranks and syncs, the first one a warm-up
        return statistics.median(s for rank in runs[run] for s in rank[what][1:])

    print(f"hidden {args.hidden}, {args.layers} layers: Llama {runs['zero0'][0]['parameters']:,} parameters, GPT "
          f"{runs['t1'][0]['parameters']:,}; K={K}, 4 ranks, 4-bit + EF, {args.syncs} syncs of H={args.sync_interval}; "
          f"load average {os.getloadavg()[0]:.1f}")
    # Wall time includes waiting in the collective for the slowest worker to arrive (after a training
    # step, the workers arrive apart); the sync thread's CPU time is the sync's own work.
    trainer = {kind: median("zero0", f"trainer_{kind}_s") for kind in ("sync", "cpu")}
    print(f"trainer path (Llama, replicated, D=2): sync CPU {trainer['cpu']:.4f} s, wall {trainer['sync']:.4f} s")
    print("| run | sync CPU s | vs trainer path | sync wall s | peak RSS growth per rank MiB | planner's MiB |")
    print("|---|---|---|---|---|---|")
    for run in RUNS:
        cpu, wall = median(run, "hook_cpu_s"), median(run, "hook_sync_s")
        peak = max(rank["peak_mib"] for rank in runs[run])
        planned = max(rank["planned_mib"] for rank in runs[run])
        print(f"| {run} | {cpu:.4f} | {cpu / trainer['cpu']:.2f} | {wall:.4f} | {peak:.0f} | {planned:.0f} |")
    for label, base, other in (("ZeRO 3 / ZeRO 1", "zero1", "zero3"), ("ZeRO 1 / ZeRO 0", "zero0", "zero1"),
                               ("T=2 / T=1", "t1", "t2")):
        cpu = median(other, "hook_cpu_s") / median(base, "hook_cpu_s")
        peak = max(r["peak_mib"] for r in runs[other]) / max(r["peak_mib"] for r in runs[base])
        planned = max(r["planned_mib"] for r in runs[other]) / max(r["planned_mib"] for r in runs[base])
        print(f"{label}: sync CPU {cpu:.2f}; peak memory measured {peak:.2f}, planned {planned:.2f}")


if __name__ == "__main__":
    main()
