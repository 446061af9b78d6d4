"""Bytes distributed Muon's collectives send per rank per optimizer step, next to the inner-DP
gradient all-reduce of the same step.

    python benchmarks/muon_comm.py [--steps 2] [--vocab-size 128256]

- tiny, T=2 x D=2 (measured): 4 CPU ranks train real steps with the real launcher; every call of
  muloco.core.comm's collectives inside DistributedMuon.step is counted on every rank, and must equal
  trainer.optim.muon_comm_model's formula for that rank (the script fails otherwise).
- 150m (T=2, D=2) and 15B (T=4, P=2, D=4): the same formulas evaluated (not run) on the shard
  shapes of Megatron's GPTModel built on the meta device (tools/plan.py's builder), per stage.

"Bytes sent per rank" (muloco.core.comm.bytes_sent): all-to-all: what the rank addresses to the other
ranks; all-gather: (g-1) x its input; ring all-reduce: 2(g-1)/g x the buffer. Muon's pieces travel
in the Newton-Schulz dtype of the configuration's ds_config (tiny: cpu_tiny_muon.json, fp32; 150m:
gpu_150m_dp_muon.json and 15B: gpu_15b_muloco_k16.json, bf16). The gradient all-reduce is
DeepSpeed's over inner DP of every local parameter's fp32 gradient (the trainer never hands DeepSpeed
its bf16 block, so DeepSpeed communicates in the parameters' fp32). Each row is the rank with the
largest Muon / gradient ratio; `peak_transient_bytes` is the model's peak of the step's buffers beyond
parameters, gradients and optimizer state (muon_comm_model.MuonExchange.transient_bytes), and
`previous_design_bytes` what the replaced exchange sent (fp32: all-gather of every TP shard over TP,
all-reduce over DP of a T x local buffer, reduce-scatter over TP: (T-1) L + 2(D-1)/D T L + (T-1) L
elements for L local Muon elements) — the baseline.

The last line printed is JSON: {"rows": [...]}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


from tools.trainer_runs import TINY_VOCAB, launch_ranks, tiny_flags
from trainer.ds_config import load_ds_config
from trainer.model.presets import PRESETS
from trainer.optim.muon import MOMENTUM_DTYPES
from trainer.optim.muon_comm_model import MuonExchange, comm_dtype, grad_allreduce_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
SHAPED = [("150m", 2, 1, 2, "gpu_150m_dp_muon.json"), ("15b", 4, 2, 4, "gpu_15b_muloco_k16.json")]


# -- inside each rank of the tiny launch ----------------------------------------------------------

def probe(out_dir: Path, flags: list[str]) -> None:
    """Train like pretrain.py, counting the bytes of every collective DistributedMuon.step calls."""
    import torch.distributed as dist

    from tools.trainer_runs import init_distributed, run_trainer
    from muloco.core import comm
    from trainer.optim.distributed_muon import DistributedMuon
    from trainer.training import Trainer

    seen: dict = {"steps": []}
    original_step = DistributedMuon.step

    def counted_step(self, momentum_buffers, config, lr, weight_decay):
        with comm.counting_bytes_sent() as counts:
            original_step(self, momentum_buffers, config, lr, weight_decay)
        seen["steps"].append(sum(counts.values()))
        element_size = 2 if config.ns_dtype == "bfloat16" else 4
        seen.update(predicted=self.exchange.bytes_sent(self.dp.rank, self.tp.rank, element_size).total,
                    data=self.dp.size, tensor=self.tp.size, ns_dtype=config.ns_dtype,
                    muon_numel=sum(p.numel() for p in self.params))

    class CountingTrainer(Trainer):
        def train(self):
            result = super().train()
            seen["local_numel"] = sum(p.numel() for p in self.model.parameters())
            return result

    DistributedMuon.step = counted_step
    init_distributed()
    run_trainer(flags, CountingTrainer)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))


# -- the benchmark --------------------------------------------------------------------------------

def row(preset: str, tensor: int, pipeline: int, data: int, measured: bool, per_rank: list[dict],
        comm_bytes: str) -> dict:
    worst = max(per_rank, key=lambda r: r["muon_bytes"] / r["grad_allreduce_bytes"])
    return {"preset": preset, "tensor": tensor, "pipeline": pipeline, "data": data, "measured": measured,
            "muon_bytes": worst["muon_bytes"], "grad_allreduce_bytes": worst["grad_allreduce_bytes"],
            "muon_over_grad_allreduce": round(worst["muon_bytes"] / worst["grad_allreduce_bytes"], 4),
            "muon_over_muon_matrices_grad_allreduce": round(worst["muon_bytes"] / worst["muon_grad_bytes"], 4),
            "previous_design_bytes": worst["previous"],
            "muon_dtype": comm_bytes, "grad_dtype": "float32",
            "peak_transient_bytes": max(r.get("transient", 0) for r in per_rank) or None}


def previous_design_bytes(local_muon_numel: int, tensor: int, data: int) -> int:
    """Per rank per step of the replaced exchange (fp32 throughout)."""
    L = local_muon_numel
    return 4 * ((tensor - 1) * L + 2 * (data - 1) * tensor * L // data + (tensor - 1) * L)


def measure_tiny(steps: int) -> dict:
    from tools.synthetic_data import write_markov_dataset

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_markov_dataset(str(work / "markov"), vocab_size=TINY_VOCAB)
        flags = tiny_flags(data, work / "run", "muon", "--tensor-model-parallel-size", "2",
                           "--train-iters", str(steps), "--micro-batch-size", "2", "--global-batch-size", "4",
                           "--lr-warmup-iters", "0", "--eval-interval", "0")
        launch_ranks(Path(__file__), 4, ["--probe", str(work), *flags], timeout_s=600).check("tiny T=2 D=2 run")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(4)]
    per_rank = []
    for r, seen in enumerate(ranks):
        if any(s != seen["predicted"] for s in seen["steps"]) or len(seen["steps"]) != steps:
            raise SystemExit(f"rank {r}: counted {seen['steps']} bytes per step, the formula says {seen['predicted']}")
        per_rank.append({"muon_bytes": seen["predicted"],
                         "grad_allreduce_bytes": grad_allreduce_bytes(seen["local_numel"], seen["data"]),
                         "muon_grad_bytes": grad_allreduce_bytes(seen["muon_numel"], seen["data"]),
                         "previous": previous_design_bytes(seen["muon_numel"], seen["tensor"], seen["data"])})
    print(f"tiny T=2 D=2: counted bytes per step equal the formula on all 4 ranks, {steps} steps "
          f"({ranks[0]['ns_dtype']} pieces)")
    return row("tiny", 2, 1, 2, True, per_rank, ranks[0]["ns_dtype"])


def evaluate(preset: str, tensor: int, pipeline: int, data: int, ds_config: str, vocab: int) -> dict:
    from tools.planning.shards import build_stage_shards

    muon = load_ds_config(REPO_ROOT / "ds_configs" / ds_config).optimizer.params  # as the trainer reads it
    element_size = comm_dtype(muon.ns_dtype).itemsize
    per_rank = []
    for stage in build_stage_shards(PRESETS[preset], vocab, tensor, pipeline):
        matrices = [p for p in stage if p.muon]
        exchange = MuonExchange.for_local_shards([p.name for p in matrices], [p.shape for p in matrices],
                                                 PRESETS[preset], tensor, data, muon.ns_steps, ns_form=muon.ns_form)
        local, muon_local = sum(p.numel for p in stage), sum(p.numel for p in matrices)
        for d in range(data):
            for t in range(tensor):
                per_rank.append({
                    "muon_bytes": exchange.bytes_sent(d, t, element_size).total,
                    "grad_allreduce_bytes": grad_allreduce_bytes(local, data),
                    "muon_grad_bytes": grad_allreduce_bytes(muon_local, data),
                    "previous": previous_design_bytes(muon_local, tensor, data),
                    "transient": exchange.transient_bytes(d, t, element_size, element_size,
                                                          [p.numel for p in matrices], muon.nesterov,
                                                          MOMENTUM_DTYPES[muon.momentum_dtype].itemsize)})
    return row(preset, tensor, pipeline, data, False, per_rank, muon.ns_dtype)


def main() -> int:
    if "--probe" in sys.argv:
        i = sys.argv.index("--probe")
        probe(Path(sys.argv[i + 1]), [a for a in sys.argv[i + 2:] if not a.startswith("--local_rank")])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="measured tiny steps")
    parser.add_argument("--vocab-size", type=int, default=128_256, help="vocabulary of the 150m and 15B rows")
    args = parser.parse_args()
    rows = [measure_tiny(args.steps)] + [evaluate(*shaped, args.vocab_size) for shaped in SHAPED]
    print(f"{'preset':>6} {'T':>2} {'P':>2} {'D':>2} {'measured':>8} {'muon MB':>10} {'grad AR MB':>10} "
          f"{'ratio':>7} {'vs Muon-matrix grads':>20} {'peak transient':>14} {'previous MB':>12} {'gain':>6}")
    for r in rows:
        transient = f"{r['peak_transient_bytes'] / GIB:.3f} GiB" if r["peak_transient_bytes"] else "-"
        print(f"{r['preset']:>6} {r['tensor']:>2} {r['pipeline']:>2} {r['data']:>2} {str(r['measured']):>8} "
              f"{r['muon_bytes'] / 1e6:>10.2f} {r['grad_allreduce_bytes'] / 1e6:>10.2f} "
              f"{r['muon_over_grad_allreduce']:>7.3f} {r['muon_over_muon_matrices_grad_allreduce']:>20.3f} "
              f"{transient:>14} {r['previous_design_bytes'] / 1e6:>12.2f} "
              f"{r['previous_design_bytes'] / r['muon_bytes']:>5.1f}x")
    print(f"(Muon pieces in each row's muon_dtype, gradients in fp32; vocabulary {args.vocab_size} for 150m/15B)")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
