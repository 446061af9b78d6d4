"""What the DeepSpeed hook costs: its sync's wall time on the example's model against the trainer's
path on the same shapes, and peak memory per rank of ZeRO-1 against stage 0, beside the planner's
memory model.

    python benchmarks/deepspeed_hook_cost.py [--hidden 256 --layers 4 --syncs 6]

Each ZeRO stage is one 4-rank launch (K=2 workers x D=2 ranks, gloo on CPU, one thread per rank) of
examples/deepspeed_muloco.py's Llama and loop with 4-bit + EF syncs every H steps:
- hook: the median `sync_seconds` of its syncs (the records the outer loop logs);
- trainer path: in the stage-0 launch, an OuterLoop over the same parameters as this trainer hands
  them (whole tensors replicated over the D ranks, each rank owning 1/D), synced as many times;
- memory: each rank's peak resident set (ru_maxrss) after the run minus before the model was built,
  the largest over the ranks; the planner's figure is tools/plan.py's memory model for these
  parameters (weights 4 + gradients 4 + AdamW moments 8 bytes per parameter on the device, fp32
  master weights 4 more under ZeRO, ZeRO dividing master weights and moments by D; host outer state
  12 per owned parameter plus 4 of error feedback, owned 1/D).
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

from tools.trainer_runs import launcher_command

REPO = Path(__file__).resolve().parents[1]
K, D = 2, 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sync-interval", type=int, default=3)
    p.add_argument("--syncs", type=int, default=6)
    p.add_argument("--zero-stage", type=int, default=None, help=argparse.SUPPRESS)  # a launched rank's
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _example():
    spec = importlib.util.spec_from_file_location("deepspeed_muloco", REPO / "examples" / "deepspeed_muloco.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(args: argparse.Namespace) -> dict:
    """One launched rank: train with the hook at args.zero_stage; on stage 0 also the trainer's path."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from muloco.diloco.config import MuLoCoConfig
    from muloco import attach, data_parallel_workers
    from muloco.diloco.membership import StaticMembership
    from muloco.diloco.outer_loop import OuterLoop
    from muloco.diloco.plan import synced_tensors
    from muloco.core.typed_json import load

    example = _example()
    deepspeed.init_distributed(dist_backend="gloo")
    workers = data_parallel_workers(K)
    before = _peak_mib()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    ds = example.ds_config(argparse.Namespace(inner="adamw", lr=None, micro_batch=4, zero_stage=args.zero_stage,
                                              bf16=False))
    engine, *_ = deepspeed.initialize(model=model, config=ds, mpu=workers.mpu)
    block = {"workers": K, "sync_interval": args.sync_interval, "auth": "none",
             "compression": {"method": "statistical", "bits": 4, "error_feedback": True}}
    records = []
    outer = attach(engine, block, workers, log=lambda record, step: records.append(record))
    batches = example.markov_batches(1024, 64, 4, seed=dist.get_rank())
    for _ in range(args.syncs * args.sync_interval):
        tokens = next(batches)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    outer.detach()
    result = {"hook_sync_s": [r["sync_seconds"] for r in records], "hook_cpu_s": [r["sync_cpu_seconds"] for r in records],
              "peak_mib": _peak_mib() - before,
              "parameters": sum(p.numel() for p in model.parameters())}
    if args.zero_stage == 0:  # the trainer's path: whole tensors, replicated, 1/D owned per rank
        trainer_records = []
        config = load(MuLoCoConfig, block, "muloco")
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


def planned_mib(parameters: int, zero: int) -> float:
    device = (4 + 4) * parameters + (8 + 4) * parameters / D if zero else (4 + 4 + 8) * parameters
    host = (12 + 4) * parameters / D
    return (device + host) / 2**20


def launch(args: argparse.Namespace, zero: int, out: Path) -> list[dict]:
    command = [*launcher_command("deepspeed", K * D, 29700 + zero), __file__, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--sync-interval", str(args.sync_interval), "--syncs", str(args.syncs),
               "--zero-stage", str(zero), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out.mkdir(parents=True)
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    if done.returncode != 0:
        sys.exit(f"the ZeRO {zero} launch failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(K * D)]


def main() -> None:
    args = parse_args()
    if args.zero_stage is not None:  # a launched rank
        import torch.distributed as dist
        result = measure(args)
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = {zero: launch(args, zero, Path(tmp, f"zero{zero}")) for zero in (0, 1)}
    n = runs[0][0]["parameters"]
    print(f"Llama hidden {args.hidden}, {args.layers} layers: {n:,} parameters; K={K} x D={D}, 4-bit + EF, "
          f"{args.syncs} syncs of H={args.sync_interval}; load average {os.getloadavg()[0]:.1f}")
    # Wall time includes waiting in the collective for the slowest worker to arrive (after a training
    # step, the workers arrive apart); the sync thread's CPU time is the sync's own work.
    for kind, label in (("sync", "wall"), ("cpu", "CPU")):
        def median(zero: int, path: str) -> float:  # over ranks and syncs, the first one a warm-up
            return statistics.median(s for rank in runs[zero] for s in rank[f"{path}_{kind}_s"][1:])
        trainer, hook, hook_zero1 = median(0, "trainer"), median(0, "hook"), median(1, "hook")
        print(f"sync {label} seconds: trainer path {trainer:.4f}, hook at ZeRO 0 {hook:.4f} (ratio "
              f"{hook / trainer:.2f}), hook at ZeRO 1 {hook_zero1:.4f} (ratio {hook_zero1 / trainer:.2f})")
    peak = {zero: max(rank["peak_mib"] for rank in runs[zero]) for zero in (0, 1)}
    for zero in (0, 1):
        print(f"ZeRO {zero}: peak RSS growth per rank {peak[zero]:.0f} MiB; planner's model {planned_mib(n, zero):.0f} MiB")
    print(f"ZeRO 1 / ZeRO 0 peak memory: measured {peak[1] / peak[0]:.2f}, planned "
          f"{planned_mib(n, 1) / planned_mib(n, 0):.2f}")


if __name__ == "__main__":
    main()
