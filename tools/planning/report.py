"""A plan as markdown: the memory table, bytes per sync, the wall-clock table, and the layouts that fit a node."""
from __future__ import annotations

from tools.planning.inputs import PlanInputs
from tools.planning.plan import GIB, NODE_GPUS, LayoutFit, Plan
from trainer.model.presets import PRESETS
from trainer.model.stages import stage_layers


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def render(plan: Plan) -> str:
    i = plan.inputs
    z = i.sizes
    run = "this trainer" if i.hook_zero is None else f"a DeepSpeed hook run (muloco/hook/) at ZeRO {i.hook_zero}"
    lines = [f"# plan: {i.model}, K={z.workers} x D={z.data} x P={z.pipeline} x T={z.tensor} = {z.world} GPUs, {run}",
             f"parameters: {plan.parameters:,} (vocab {i.vocab_size}, seq {i.seq_length})",
             f"pipeline stages: {' + '.join(map(str, stage_layers(PRESETS[i.model].num_layers, z.pipeline)))} layers",
             f"batch: B={i.global_batch} sequences/step = {i.global_batch // z.workers} per worker = "
             f"micro {i.micro_batch} x accumulation {i.micro_batches} x D {z.data}",
             "", f"## memory per rank (worst pipeline stage; {_precision(i)})",
             f"| | {i.optimizer.type} inner (stage {plan.memory[0].stage}) | adamw (stage {plan.memory[1].stage}) |",
             "|---|---|---|"]
    for key in ("weights", "bf16_weight_copies", "master_weights", "gradients", "muon_momentum", "adamw_moments",
                "muon_workspace", "activations", "logits"):
        lines.append(f"| {key} | {_gib(getattr(plan.memory[0], key))} | {_gib(getattr(plan.memory[1], key))} |")
    lines += [f"| **device total** | **{_gib(plan.memory[0].device_total)}** | {_gib(plan.memory[1].device_total)} |",
              f"| host outer state | {_gib(plan.memory[0].host_outer_state)} | |",
              f"fits a {i.gpu_memory_gib:g} GiB GPU with 10% headroom: {'yes' if plan.fits else 'NO'}"]
    if i.hook_zero is None:  # DistributedMuon's exchange (DeepSpeed's own Muon is not modelled)
        lines.append(f"Muon exchange per inner step ({i.muon.ns_dtype if i.muon else '-'}, intra-worker): "
                     f"{plan.memory[0].muon_bytes_per_step:,} B per rank vs the fp32 gradient all-reduce's "
                     f"{plan.memory[0].grad_allreduce_bytes_per_step:,} B")
    lines += ["", f"## bytes per outer sync ({i.compression.method}"
              f"{'' if i.compression.method == 'none' else ':' + str(i.compression.bits)}"
              f"{'+EF' if i.compression.error_feedback else ''}, {i.muloco.collective})",
              f"per rank: {plan.sync.per_rank_max:,} B (max), {plan.sync.per_rank_mean:,.0f} B (mean); "
              f"per datacenter: {plan.sync.per_worker:,} B; "
              f"uncompressed per rank: {plan.sync.uncompressed_per_rank_max:,} B "
              f"({plan.sync.uncompressed_per_rank_max / max(plan.sync.per_rank_max, 1):.1f}x)",
              "", f"## idealised wall-clock for {i.tokens:.3g} tokens at {i.bandwidth_gbit:g} Gbit/s per "
              f"{i.bandwidth_scope} ({i.gpu_tflops:g} TFLOP/s x MFU {i.mfu:g}; codec "
              + (f"{i.codec.encode / 1e6:,.0f}M/{i.codec.decode / 1e6:,.0f}M elements/s encode/decode from "
                 f"{i.codec.source})" if i.codec else "time not modelled: see --codec-json)"),
              "| method | steps | compute s/step | cross-DC s/step | hours | vs fastest | cross-DC bytes/rank |",
              "|---|---|---|---|---|---|---|"]
    fastest = min(t.total_hours for t in plan.times)
    for t in plan.times:
        lines.append(f"| {t.method} | {t.steps:,} | {t.compute_s_per_step:.3f} | {t.communication_s_per_step:.3f} | "
                     f"{t.total_hours:,.1f} | {t.total_hours / fastest:.2f}x | {t.cross_dc_bytes_per_rank:.3g} |")
    return "\n".join(lines)


def _precision(inputs: PlanInputs) -> str:
    if inputs.hook_zero is None:
        return "bf16 autocast" if inputs.bf16 else "fp32"
    return "bf16 weights, fp32 master weights" if inputs.bf16 else "fp32"


def render_layouts(inputs: PlanInputs, fits: list[LayoutFit]) -> str:
    shape = PRESETS[inputs.model]
    lines = [f"## layouts of {inputs.model} on {NODE_GPUS}-GPU nodes of {inputs.gpu_memory_gib:g} GiB "
             f"(D={inputs.sizes.data}, micro-batch {inputs.micro_batch}, {inputs.optimizer.type} inner)",
             "| T | P | stage layers | GiB per GPU (worst stage) | fits |", "|---|---|---|---|---|"]
    for f in fits:
        layers = " + ".join(map(str, stage_layers(shape.num_layers, f.pipeline)))
        lines.append(f"| {f.tensor} | {f.pipeline} | {layers} | {f.device_gib:.1f} | {'yes' if f.fits else 'no'} |")
    return "\n".join(lines)
