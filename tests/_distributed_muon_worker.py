"""One rank of tests/test_distributed_muon.py (torchrun, 4 ranks, gloo).

In one launch, for each layout T x D of the 4 ranks (4x1, 2x2, 1x4) and each communication dtype,
DistributedMuon takes STEPS steps on the TP shards of a 2-layer model's hidden matrices, with small
buckets so the overlapped gather of the next bucket is exercised; the reference is single-process
Muon (trainer.optim.muon.Muon) on every whole logical matrix with the same gradients. Every rank
writes to OUT/rank<R>.json, per case: the largest relative difference per logical matrix from the
reference, the bytes its Muon collectives sent (counted at muloco.core.comm's calls) and the bytes
trainer.optim.muon_comm_model predicts for it.
"""
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from muloco.core import comm
from trainer.model.sharding import sharding_of, logical_matrices, shard
from trainer.model.presets import ModelShape
from trainer.optim.distributed_muon import DistributedMuon, ShardGroup
from trainer.optim.muon import MOMENTUM_DTYPES, Muon, MuonConfig
from trainer.optim.muon_comm_model import comm_dtype

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=96, kv_channels=16,
                   num_query_groups=4)
NAMES = [f"decoder.layers.{layer}.{name}" for layer in range(SHAPE.num_layers) for name in (
    "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight")]
qkv_rows = (SHAPE.num_attention_heads + 2 * SHAPE.query_groups) * SHAPE.kv_channels
FULL_SHAPES = [(qkv_rows, 64), (64, 128), (2 * 96, 64), (64, 96)] * SHAPE.num_layers
LAYOUTS = [(4, 1), (2, 2), (1, 4)]  # (T, D)
BUCKET_NUMEL = 30_000  # about two parameters per bucket
STEPS = 2
LR, WEIGHT_DECAY = 0.02, 0.1


def full_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=generator) * 0.02 for s in FULL_SHAPES]


def full_grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator) for s in FULL_SHAPES]


def reference(config: MuonConfig) -> list[dict[str, torch.Tensor]]:
    """Full weights after STEPS steps of Muon on every whole logical matrix, per logical matrix."""
    parts = [{k: torch.nn.Parameter(v.clone()) for k, v in logical_matrices(n, p, SHAPE).items()}
             for n, p in zip(NAMES, full_params())]
    muon = Muon([p for ps in parts for p in ps.values()], config, lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        for name, ps, g in zip(NAMES, parts, full_grads(step)):
            for k, gp in logical_matrices(name, g, SHAPE).items():
                ps[k].grad = gp.clone()
        muon.step()
    return [{k: v.detach() for k, v in ps.items()} for ps in parts]


def run_case(T: int, D: int, config: MuonConfig, tp_group, dp_group, tp_rank: int, dp_rank: int) -> dict:
    params = [torch.nn.Parameter(shard(p, sharding_of(n), tp_rank, T).clone())
              for n, p in zip(NAMES, full_params())]
    muon = DistributedMuon(NAMES, params, SHAPE, ShardGroup.of(tp_group), ShardGroup.of(dp_group),
                           bucket_numel=BUCKET_NUMEL)
    buffers = [torch.zeros_like(p, dtype=MOMENTUM_DTYPES[config.momentum_dtype]) for p in params]
    with comm.counting_bytes_sent() as counted:
        for step in range(STEPS):
            for n, p, g in zip(NAMES, params, full_grads(step)):
                p.grad = shard(g, sharding_of(n), tp_rank, T).clone()
            muon.step(buffers, config, LR, WEIGHT_DECAY)
    gaps = []  # ||w - w_ref|| / ||w_ref - w_0|| on this rank's piece of each logical matrix
    for n, p, p0, ref_parts in zip(NAMES, params, full_params(), reference(config)):
        def piece(whole: torch.Tensor, dim: int = sharding_of(n).partition_dim) -> torch.Tensor:
            return whole.chunk(T, dim=dim)[tp_rank]  # this TP rank's piece of a logical matrix

        local = logical_matrices(n, p.detach(), muon.local_shape)
        start = logical_matrices(n, p0, SHAPE)
        for part, ref_whole in ref_parts.items():
            ref = piece(ref_whole)
            gaps.append(float(torch.linalg.norm(local[part] - ref) / torch.linalg.norm(ref - piece(start[part]))))
    element_size = torch.empty((), dtype=comm_dtype(config.ns_dtype)).element_size()
    predicted = muon.exchange.bytes_sent(dp_rank, tp_rank, element_size)
    return {"T": T, "D": D, "ns_dtype": config.ns_dtype, "nesterov": config.nesterov, "ns_form": config.ns_form,
            "momentum_dtype": config.momentum_dtype,
            "buckets": len(muon.exchange.buckets), "max_relative_gap": max(gaps),
            "counted_bytes": sum(counted.values()), "counted": counted,
            "predicted_bytes": STEPS * predicted.total}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = []
    for T, D in LAYOUTS:
        # rank = d*T + t; every rank creates every group, in the same order.
        tp_groups = [dist.new_group([d * T + t for t in range(T)]) for d in range(D)]
        dp_groups = [dist.new_group([d * T + t for d in range(D)]) for t in range(T)]
        d, t = divmod(rank, T)
        # fp32: each matrix's cheaper form; bf16: the Gram form throughout, and momentum kept in bf16.
        for ns_dtype, nesterov, ns_form in (("float32", False, "auto"), ("bfloat16", True, "gram")):
            config = MuonConfig(momentum=0.9, nesterov=nesterov, ns_dtype=ns_dtype, ns_form=ns_form,
                                momentum_dtype=ns_dtype)
            results.append(run_case(T, D, config, tp_groups[d], dp_groups[t], t, d))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
