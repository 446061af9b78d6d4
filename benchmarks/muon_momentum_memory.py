"""Peak memory per rank of Muon's state and step with its momentum in bf16 against fp32, measured and
planned, in one command.

Each momentum dtype runs in a fresh process: the preset's Muon matrices of one rank (T = D = 1, every
layer: fused QKV, O, fused gate-up, down; the AdamW-routed embeddings and norms are the same in both
and left out) as fp32 parameters with fp32 gradients, and --steps steps of DistributedMuon with the
momentum buffers in the dtype. Measured: on CPU the process's peak resident set (ru_maxrss) minus
its resident set before the first tensor was made; on CUDA torch.cuda.max_memory_allocated. Planned:
tools/plan.py's memory model for the same parts (weights 4 + gradients 4 + momentum 4 or 2 bytes per
parameter, and trainer.optim.muon_comm_model's peak of the step's transient buffers). Printed per
dtype: measured and planned bytes and measured / planned; then bf16 / fp32 of each. For scale, the
planner's whole-rank device memory (weights, gradients, optimizer state, workspace, activations,
logits of the worst stage) of the shipped 150m DP Muon and 15B MuLoCo configs at their layouts, fp32
momentum against bf16.

    python benchmarks/muon_momentum_memory.py [--preset 150m] [--steps 2] [--device cuda]

The last line printed is a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch


from muon_ownership import muon_parameters
from trainer.model.presets import PRESETS
from trainer.optim.distributed_muon import DistributedMuon, ShardGroup
from trainer.optim.muon import MOMENTUM_DTYPES, MuonConfig
from trainer.optim.muon_comm_model import DEFAULT_BUCKET_NUMEL, MuonExchange, comm_dtype

DTYPES = ("float32", "bfloat16")
WHOLE_RANK_CONFIGS = (("150m", "ds_configs/gpu_150m_dp_muon.json"), ("15b", "ds_configs/gpu_15b_muloco_k16.json"))


def resident_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def planned_bytes(preset: str, config: MuonConfig) -> int:
    names, shapes = muon_parameters(PRESETS[preset], PRESETS[preset].num_layers)
    numels = [math.prod(s) for s in shapes]
    x = MuonExchange.build(names, shapes, PRESETS[preset], 1, 1, config.ns_steps, DEFAULT_BUCKET_NUMEL, config.ns_form)
    element = comm_dtype(config.ns_dtype).itemsize
    momentum = MOMENTUM_DTYPES[config.momentum_dtype].itemsize
    transient = x.max_transient_bytes(element, element, numels, config.nesterov, momentum)
    return (4 + 4 + momentum) * sum(numels) + transient


def planned_whole_rank(preset: str, ds_config: str) -> dict[str, float]:
    """tools/plan.py's device bytes per rank (worst stage) of a shipped config, per momentum dtype."""
    from tools import plan as planner  # builds Megatron's model on meta: imported only here
    from tools.planning.plan import make_plan

    inputs = planner.inputs_from_args(planner.build_parser().parse_args(["--model", preset, "--ds_config", ds_config]))
    params = inputs.optimizer.params
    totals = {}
    for dtype in DTYPES:
        with_dtype = replace(inputs, optimizer=replace(inputs.optimizer, params=replace(params, momentum_dtype=dtype)))
        totals[dtype] = make_plan(with_dtype).memory[0].device_total  # the worst stage, inner optimizer
    return totals


def measure(preset: str, config: MuonConfig, steps: int, device: torch.device) -> int:
    """Peak bytes of the parameters, gradients, momentum and `steps` Muon steps on `device`."""
    names, shapes = muon_parameters(PRESETS[preset], PRESETS[preset].num_layers)
    generator = torch.Generator().manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resident_bytes()
    params = [torch.nn.Parameter(torch.empty(s, device=device)) for s in shapes]
    momentum = [torch.zeros_like(p, dtype=MOMENTUM_DTYPES[config.momentum_dtype]) for p in params]
    muon = DistributedMuon(names, params, PRESETS[preset], ShardGroup.of(None), ShardGroup.of(None))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        muon.step(momentum, config, lr=0.02, weight_decay=0.1)
    if cuda:
        return torch.cuda.max_memory_allocated(device) - before
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="150m", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--ns-dtype", default="float32", choices=DTYPES, help="Newton-Schulz dtype (muon.ns_dtype)")
    parser.add_argument("--child", choices=DTYPES, help=argparse.SUPPRESS)  # one measurement, in this process
    args = parser.parse_args()

    def config(momentum_dtype: str) -> MuonConfig:
        return MuonConfig(ns_dtype=args.ns_dtype, momentum_dtype=momentum_dtype)

    if args.child:
        print(measure(args.preset, config(args.child), args.steps, torch.device(args.device)))
        return
    rows = {}
    for dtype in DTYPES:  # each in a fresh process: ru_maxrss is a process's lifetime peak
        # A fixed mmap threshold: glibc then maps every tensor-sized block on its own and unmaps it when
        # freed, so the resident set follows the live tensors (its default raises the threshold to
        # the largest block freed, after which freed tensors stay resident).
        child = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--steps", str(args.steps),
                                "--device", args.device, "--ns-dtype", args.ns_dtype, "--child", dtype],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
        measured = int(child.stdout.split()[-1])
        planned = planned_bytes(args.preset, config(dtype))
        rows[dtype] = {"measured_bytes": measured, "planned_bytes": planned,
                       "measured_over_planned": round(measured / planned, 3)}
        print(f"{args.preset} momentum {dtype}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} "
              f"MiB ({rows[dtype]['measured_over_planned']:.3f})", flush=True)
    ratios = {kind: round(rows["bfloat16"][f"{kind}_bytes"] / rows["float32"][f"{kind}_bytes"], 3)
              for kind in ("measured", "planned")}
    print(f"bf16 / fp32: measured {ratios['measured']:.3f}, planned {ratios['planned']:.3f}")
    whole = {}
    for preset, ds_config in WHOLE_RANK_CONFIGS:
        totals = planned_whole_rank(preset, ds_config)
        whole[preset] = {"ds_config": ds_config, **{f"{d}_bytes": int(v) for d, v in totals.items()},
                         "bf16_over_fp32": round(totals["bfloat16"] / totals["float32"], 4)}
        print(f"planned whole rank, {ds_config}: fp32 momentum {totals['float32'] / 2**30:.2f} GiB, bf16 "
              f"{totals['bfloat16'] / 2**30:.2f} GiB ({whole[preset]['bf16_over_fp32']:.4f})", flush=True)
    print(json.dumps({"preset": args.preset, "device": args.device, "ns_dtype": args.ns_dtype, "steps": args.steps,
                      "rows": rows, "bf16_over_fp32": ratios, "planned_whole_rank": whole}))


if __name__ == "__main__":
    main()
