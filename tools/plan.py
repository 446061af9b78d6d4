"""Plan a MuLoCo run before renting machines: parameters, per-rank memory, bytes per outer sync and
an idealised wall-clock for a token budget against data-parallel AdamW and Muon.

    python tools/plan.py --model 15b --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --data 4 \
        --workers 16 --sync-interval 30 --compression statistical:4 --error-feedback --seq-length 2048 \
        --global-batch-size 1024 --bandwidth-gbit 10 --tokens 1e11 \
        [--ds_config ds_configs/gpu_15b_muloco_k16.json] [--hook-zero {0,1,2,3}] [--json]

Shapes come from the real Megatron GPTModel: every pipeline stage of one tensor-parallel rank is
built on the meta device (no memory) in a single process that joins a *fake* T x P world
(torch's "fake" process-group backend), so Megatron's own layers decide the shard shapes. TP ranks of
a stage hold identically shaped shards, so one TP rank per stage is enough.

Memory model (bytes per rank, the largest pipeline stage; this trainer keeps fp32 parameters and
runs bf16 as Megatron autocast over them):
  weights 4/param; bf16 weight copies autocast keeps for the backward 2/param (bf16 only);
  gradients 4/param (DeepSpeed without ZeRO keeps them in the parameter dtype);
  Muon momentum 4 per Muon parameter (2 with muon.momentum_dtype bfloat16); AdamW moments 8 per
  AdamW parameter;
  Muon step workspace: the peak of the step's transient buffers on the busiest rank, and Muon's bytes
  sent per rank per inner step (intra-worker, reported next to the gradient all-reduce, not in the
  wall-clock), both from trainer/optim/muon_comm_model.py, the formulas DistributedMuon executes;
  activations (Korthikanti et al. 2022, no sequence parallelism, no recomputation, Megatron's local
  attention that materialises the scores): s*b*h*(10 + 24/T + 5*a*s/(h*T)) bytes per layer and
  micro-batch of b sequences, min(P, M) micro-batches in flight on the first stage (1F1B);
  logits on the last stage: 8 bytes per token and local vocab entry (fp32 logits and their gradient).
  Not counted: the CUDA context and allocator fragmentation (keep ~10% headroom).
Host memory (outer state, per rank): each of the D inner-DP replicas owns ~1/D of its shard (the
outer loop's own owner assignment): fp32 global weights 4 + outer momentum 4 + error feedback 4 (the
compressed parameters, when on) + the fp32 pseudogradient 4 built at a sync.

A DeepSpeed hook run (`--hook-zero N`: a team's own loop with muloco/hook/ attached) is the same
model as DeepSpeed holds it (`zero_model_states`): the model's weights in bf16 with fp32 master weights
in the optimizer (or all fp32), the master weights and optimizer state partitioned over D from ZeRO 1,
the gradients from ZeRO 2, the weights from ZeRO 3 (plus what it keeps gathered: up to 1e9); the
synced shard and its host outer state are the rank's ZeRO partition (`hook_synced`).

Bytes per outer sync per rank: the compression module's `Compressor.payload_nbytes` on each owned
tensor as the outer loop sends it (row-parallel weights transposed; embeddings/head and 1-D tensors
at `embedding_bits` / `vector_bits`, via `compression_group`), put through the formulas of
muloco/diloco/averaging.py (all_gather: (K-1) * S; reduce_scatter: sum_{j != k} S_j + (K-1) * max_j S_j),
plus (K-1) * (8 + 16) bytes of header in the first collective (the payload's norm claim and the
skip-vote ballot), K + 8 bytes of verdicts and claim ahead of each re-quantized chunk
(reduce_scatter), and with the job secret (on unless `"auth": "none"`) a 32-byte tag on every part
sent (all_gather: K-1 of them; reduce_scatter: 2 (K-1)).

Wall-clock model (idealised): compute is 6 * N * tokens FLOPs at `--mfu` of `--gpu-tflops` per GPU,
on the same K*D*P*T GPUs for every method, stretched by the pipeline bubble (M + P - 1) / M.
The K datacenters are joined by links of `--bandwidth-gbit` each; with `--bandwidth-scope datacenter`
(the default) the ranks of a datacenter share its link, with `rank` each rank has its own.
- DP AdamW / DP Muon: every step, a hierarchical gradient all-reduce whose cross-datacenter part is a
  ring all-reduce over K of each rank's 1/D share of its shard, 2 (K-1)/K * shard/D * `--dp-grad-bytes`,
  assumed perfectly overlapped with compute (step = max(compute, communication), the best case for DP).
- MuLoCo: every H steps one sync of the bytes above, not overlapped (or overlapped with tau inner steps
  when the ds_config's streaming block sets overlap_steps). With `--codec-json FILE` (the last line of
  `benchmarks/codec_throughput.py` run on the target device) the sync also pays the codec on the
  busiest rank's E owned elements: all_gather encodes E and decodes K payloads of E; reduce_scatter
  encodes E, decodes K chunks of E/K, re-encodes E/K and decodes the K averaged chunks.
Latency, the intra-datacenter collectives and Newton-Schulz time are ignored. Same tokens for every
method: MuLoCo at K > 1 reaches a somewhat higher loss at equal tokens (the paper's final-loss table, see docs/performance.md), which this
model does not price in.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from muloco.core.errors import ConfigError, TopologyError
from muloco.core.topology import ParallelSizes
from muloco.core.typed_json import read_json_object, set_path
from muloco.diloco.config import CompressionConfig, MuLoCoConfig
from tools.planning.inputs import CodecThroughput, PlanInputs, parse_compression
from tools.planning.plan import GIB, NODE_GPUS, layouts_that_fit, make_plan
from tools.planning.report import render, render_layouts
from trainer.config import (DATA_FLAGS, DS_CONFIG_FLAGS, MODEL_FLAGS, RUN_FLAGS, add_ds_config_flag,
                            add_global_batch_size)
from trainer.ds_config import LayoutConfig, load_ds_config
from trainer.flags import Flag, add_flags, field_flag
from trainer.model.presets import PRESETS
from trainer.recipe import PAPER_VOCAB  # the paper presets' counts match a Llama-3 vocabulary


def _trainer_flag(field: str) -> Flag:
    return next(f for f in (*RUN_FLAGS, *DATA_FLAGS, *MODEL_FLAGS, *DS_CONFIG_FLAGS) if f.field == field)


# The flags that set ds_config values before the trainer's loader reads it, so plan and run read the
# same values: the trainer's own (T and P planned into the layout block the trainer checks a run
# against), and the planner's for settings the trainer takes from the ds_config only.
DS_FLAGS = [replace(_trainer_flag("tensor_parallel"), path="layout.tensor"),
            replace(_trainer_flag("pipeline_parallel"), path="layout.pipeline"),
            field_flag("--data", LayoutConfig, "data", "layout.data"),
            _trainer_flag("train_micro_batch_size_per_gpu"),
            field_flag("--workers", MuLoCoConfig, "workers", "muloco.workers"),
            field_flag("--sync-interval", MuLoCoConfig, "sync_interval", "muloco.sync_interval"),
            field_flag("--collective", MuLoCoConfig, "collective", "muloco.collective")]
ERROR_FEEDBACK = field_flag("--error-feedback", CompressionConfig, "error_feedback",
                            "muloco.compression.error_feedback")


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    raw = read_json_object(args.ds_config) if args.ds_config else {}
    origins = {}
    if args.compression is not None:  # the whole block: what the ds_config's said of another method goes
        set_path(raw, "muloco.compression", parse_compression(args.compression))
        origins.update({f"muloco.compression.{k}": "--compression" for k in ("method", "bits", "topk_fraction")})
    for flag in [*DS_FLAGS, ERROR_FEEDBACK]:
        if getattr(args, flag.field) is not None:
            set_path(raw, flag.path, getattr(args, flag.field))
            origins[flag.path] = flag.name
    ds = load_ds_config(raw, origins)
    ds.check_model(args.model)
    layout = ds.layout or LayoutConfig()  # the layout the ds_config was planned for
    muloco = ds.muloco or MuLoCoConfig()  # without an outer loop: MuLoCo planned at its defaults
    sizes = ParallelSizes(workers=muloco.workers, data=layout.data or 1, pipeline=layout.pipeline or 1,
                          tensor=layout.tensor or 1)
    micro = ds.train_micro_batch_size_per_gpu
    if args.global_batch_size is not None:
        global_batch = args.global_batch_size
    else:
        global_batch = micro * ds.gradient_accumulation_steps * sizes.data * sizes.workers
    codec = CodecThroughput.from_benchmark(args.codec_json, muloco.compression) if args.codec_json else None
    return PlanInputs(
        model=args.model, sizes=sizes, muloco=muloco, optimizer=ds.optimizer,
        seq_length=PRESETS[args.model].with_overrides(seq_length=args.seq_length).seq_length,
        global_batch=global_batch, micro_batch=micro, bf16=ds.bf16.enabled,
        bandwidth_gbit=args.bandwidth_gbit, bandwidth_scope=args.bandwidth_scope, tokens=args.tokens,
        gpu_tflops=args.gpu_tflops, mfu=args.mfu, dp_grad_bytes=args.dp_grad_bytes,
        vocab_size=PAPER_VOCAB if args.vocab_size is None else args.vocab_size,
        gpu_memory_gib=args.gpu_memory_gib, codec=codec, hook_zero=args.hook_zero)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(PRESETS))
    # Each over the ds_config's value at its path; neither given: the setting's default.
    g = p.add_argument_group("the ds_config's settings")
    add_flags(g, DS_FLAGS, override=True, where="default: the ds_config's {path}")
    add_global_batch_size(g)
    g.add_argument("--compression", default=None,
                   help="none | statistical:BITS | linear:BITS | topk:FRACTION (the whole muloco.compression block)")
    add_flags(g, [ERROR_FEEDBACK], override=True, where="default: the ds_config's {path}")
    g = p.add_argument_group("the model")
    add_flags(g, [_trainer_flag("seq_length")], override=True, where="default: the preset's")
    add_flags(g, [_trainer_flag("vocab_size")], override=True)  # its doc says the planner's default
    p.add_argument("--bandwidth-gbit", type=float, default=10.0)
    p.add_argument("--bandwidth-scope", choices=["datacenter", "rank"], default="datacenter")
    p.add_argument("--tokens", type=float, default=1e11)
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s per GPU (H100 SXM)")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--dp-grad-bytes", type=int, default=2, help="bytes per gradient element DP all-reduces (bf16)")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    add_ds_config_flag(p, required=False, help="take K, H, compression, collective, optimizer, bf16, batch and layout "
                       "from it, as the trainer reads them (without one: the trainer's defaults, AdamW in fp32)")
    p.add_argument("--codec-json", type=Path, default=None,
                   help="benchmarks/codec_throughput.py's output on the target device: the sync's codec time")
    p.add_argument("--hook-zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="plan a DeepSpeed hook run (muloco/hook/: a team's own loop) under this ZeRO stage instead of "
                        "this trainer's run: DeepSpeed's weights, master weights and gradients, the ZeRO partition "
                        "as the synced shard")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of markdown")
    p.add_argument("--list-layouts", action="store_true",
                   help=f"also list every T x P that fits {NODE_GPUS}-GPU nodes of --gpu-memory-gib")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when the asked-for layout fits the GPU memory, 1 when it does not, 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        inputs = inputs_from_args(args)
        plan = make_plan(inputs)
        fits = layouts_that_fit(inputs) if args.list_layouts else None
    except (ConfigError, TopologyError, ValueError) as err:
        print(f"plan error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(plan), **({"layouts": [asdict(f) for f in fits]} if fits is not None else {})},
                         default=str))
    else:
        print(render(plan))
        if fits is not None:
            print("\n" + render_layouts(inputs, fits))
    if not plan.fits:
        print(f"plan error: T={inputs.sizes.tensor} P={inputs.sizes.pipeline} needs "
              f"{plan.memory[0].device_total / GIB:.1f} GiB per GPU, more than {args.gpu_memory_gib:g} GiB with 10% "
              "headroom (--list-layouts shows the layouts that fit)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
