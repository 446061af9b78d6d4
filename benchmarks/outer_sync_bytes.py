"""Bytes per rank per outer sync, measured on the real collectives, against the bytes the
data-parallel baseline all-reduces over the same H inner steps.

    python benchmarks/outer_sync_bytes.py [--model 150m] [--vocab-size 32000] [--sync-interval 30]
                                          [--workers 2 4] [--compressions LABEL ...] [--embedding-bits B] [--vector-bits B]

Launches itself under torchrun once per K (gloo on CPU). Every rank is one whole worker (T=1) and
builds the preset's real model; then, for each compression and collective, an OuterLoop over that
model takes one outer sync of random pseudogradients through its hook, and the sync's collectives
count every byte they send. The DP baseline ring all-reduces 2 (K-1)/K x 4 bytes x parameters per
rank per inner step over the same K replicas, H times per outer sync. Embeddings/head and 1-D tensors
are sent at `compression.embedding_bits` / `vector_bits` (the config's defaults unless given; 32 =
fp32). Prints a table per K; the last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

COMPRESSIONS = {
    "none": {"method": "none"},
    "statistical 8-bit + EF": {"method": "statistical", "bits": 8, "error_feedback": True},
    "statistical 4-bit + EF": {"method": "statistical", "bits": 4, "error_feedback": True},
    "statistical 2-bit + EF": {"method": "statistical", "bits": 2, "error_feedback": True},
    "linear 4-bit + EF": {"method": "linear", "bits": 4, "error_feedback": True},
    "top-2% + EF": {"method": "topk", "topk_fraction": 0.02, "error_feedback": True},
    # The codec at the paper's settings (issue 44): per row and per tensor, and SparseLoCo's form.
    "statistical 4-bit": {"method": "statistical", "bits": 4},
    "statistical 2-bit + EF per tensor": {"method": "statistical", "bits": 2, "error_feedback": True,
                                          "granularity": "tensor"},
    "linear 2-bit + EF": {"method": "linear", "bits": 2, "error_feedback": True},
    "linear 2-bit + EF per tensor": {"method": "linear", "bits": 2, "error_feedback": True, "granularity": "tensor"},
    **{f"SparseLoCo {percent}% + 2-bit + EF": {"method": "topk", "topk_fraction": percent / 100, "topk_value_bits": 2,
                                              "granularity": "tensor", "error_feedback": True}
       for percent in (1.5, 2, 3)},
}
COLLECTIVES = ("all_gather", "reduce_scatter")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="150m")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--sync-interval", type=int, default=30, help="H: inner steps per outer sync")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="K values, one launch each")
    p.add_argument("--compressions", nargs="+", choices=list(COMPRESSIONS), default=list(COMPRESSIONS),
                   help="rows of the grid to measure (default: all)")
    p.add_argument("--embedding-bits", type=int, help="embeddings and head (default: the config's)")
    p.add_argument("--vector-bits", type=int, help="1-D tensors (default: the config's)")
    p.add_argument("--out", help=argparse.SUPPRESS)  # a rank's result file (set by the launcher)
    return p.parse_args(argv)


def group_bits(args: argparse.Namespace) -> dict[str, int]:
    bits = {"embedding_bits": args.embedding_bits, "vector_bits": args.vector_bits}
    return {key: value for key, value in bits.items() if value is not None}


def measure(args: argparse.Namespace) -> list[dict]:
    """One rank of a K-rank launch: every sync of the grid on the real model; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    from outer_worker import worker_model
    from muloco.diloco.config import CompressionConfig, MuLoCoConfig
    from muloco.diloco.membership import StaticMembership
    from muloco.diloco.outer_loop import OuterLoop
    from trainer.outer_host import megatron_tensors
    from trainer.model.builder import canonical_names

    model, topology, shape = worker_model(args.model, args.vocab_size)
    K = dist.get_world_size()
    params = sum(p.numel() for p in model.parameters())
    dp_bytes = 2 * (K - 1) / K * 4 * params * args.sync_interval
    generator = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for label in args.compressions:
        compression = {**COMPRESSIONS[label], **group_bits(args)}
        for collective in COLLECTIVES:
            config = MuLoCoConfig(workers=K, sync_interval=args.sync_interval, collective=collective,
                                  compression=CompressionConfig(**compression))
            records = []
            outer = OuterLoop(config, megatron_tensors(list(model.named_parameters()), canonical_names(model), 0,
                                                               shape.num_layers, config.streaming.fragments),
                              topology, log=lambda record, step: records.append(record),
                              membership=StaticMembership(config, topology, None))
            with torch.no_grad():  # this worker's H inner steps, as far as the sync can tell
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
            outer.after_inner_step(args.sync_interval)
            outer.flush_metrics()
            del outer  # its fp32 global weights, momentum and error-feedback buffers
            if records:
                r = records[0]
                rows.append({"K": K, "compression": label, "collective": collective, "parameters": params,
                             "bytes_per_rank_per_sync": r["bytes_sent_per_rank"],
                             "dp_bytes_per_rank_per_H_steps": dp_bytes,
                             "dp_over_outer": dp_bytes / r["bytes_sent_per_rank"],
                             "compression_error": r["compression_error"], "sync_seconds": r["sync_seconds"]})
    dist.destroy_process_group()
    return rows


def launch(args: argparse.Namespace, workers: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        forwarded = ["--model", args.model, "--vocab-size", str(args.vocab_size),
                     "--sync-interval", str(args.sync_interval), "--out", str(out), "--compressions", *args.compressions]
        for flag, value in (("--embedding-bits", args.embedding_bits), ("--vector-bits", args.vector_bits)):
            if value is not None:
                forwarded += [flag, str(value)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                        __file__, *forwarded], check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun
        rows = measure(args)
        if rows:
            Path(args.out).write_text(json.dumps(rows))
        return
    from muloco.diloco.config import CompressionConfig

    widths = CompressionConfig(**group_bits(args))
    print(f"model {args.model}, H = {args.sync_interval}, embeddings/head at {widths.embedding_bits} bits, "
          f"1-D tensors at {widths.vector_bits} bits (32 = fp32)", flush=True)
    print(f"{'K':>2} {'compression':<34} {'collective':<15} {'MB/rank/sync':>13} {'DP MB/rank/H':>13} "
          f"{'DP/outer':>9} {'rel. error':>10} {'sync s':>7}", flush=True)
    rows = []
    for K in args.workers:  # each K's rows as soon as its launch is done
        rows += launch(args, K)
        for r in rows[-len(args.compressions) * len(COLLECTIVES):]:
            print(f"{r['K']:>2} {r['compression']:<34} {r['collective']:<15} {r['bytes_per_rank_per_sync'] / 1e6:>13.2f} "
                  f"{r['dp_bytes_per_rank_per_H_steps'] / 1e6:>13.1f} {r['dp_over_outer']:>9.1f} "
                  f"{r['compression_error']:>10.3f} {r['sync_seconds']:>7.2f}", flush=True)
    print(f"parameters: {rows[0]['parameters']:,}")
    print(json.dumps({"model": args.model, "sync_interval": args.sync_interval,
                      "embedding_bits": widths.embedding_bits, "vector_bits": widths.vector_bits, "rows": rows}))


if __name__ == "__main__":
    main()
