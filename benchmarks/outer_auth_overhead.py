"""What authenticating the outer link costs: the time of one outer sync with the job secret (every
message tagged with HMAC-SHA256 and checked, muloco/diloco/auth.py) over the same sync without it.

    python benchmarks/outer_auth_overhead.py [--model 150m] [--vocab-size 32000] [--workers 2] [--repeats 5]

Launches itself under torchrun (K ranks, gloo on CPU, loopback); every rank is one whole worker of
the preset's real model. For each compression, syncs with and without the secret alternate (so drift
of a shared machine hits both alike); each sync's `sync_seconds` (vote, exchange, checks: the
critical path) is recorded, and the ratio of the medians is printed. Both sides check the payloads by
content (that is not optional); the difference is the tags alone. The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

COMPRESSIONS = {
    "statistical 4-bit + EF": {"method": "statistical", "bits": 4, "error_feedback": True},
    "none": {"method": "none"},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="150m")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="syncs of each kind per compression")
    p.add_argument("--out", help=argparse.SUPPRESS)  # rank 0's result file (set by the launcher)
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    from outer_worker import worker_model
    from muloco.diloco.auth import JobKey
    from muloco.diloco.config import CompressionConfig
    from muloco.diloco.config import MuLoCoConfig
    from muloco.diloco.membership import StaticMembership
    from muloco.diloco.outer_loop import OuterLoop
    from trainer.outer_host import megatron_tensors
    from trainer.model.builder import canonical_names

    model, topology, shape = worker_model(args.model, args.vocab_size)
    key = JobKey(b"benchmark secret" * 2, "outer_auth_overhead")
    generator = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for label, compression in COMPRESSIONS.items():
        config = MuLoCoConfig(workers=dist.get_world_size(), compression=CompressionConfig(**compression))
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats + 1):  # the first of each kind warms up
            for with_key in (False, True):
                records = []
                outer = OuterLoop(config, megatron_tensors(list(model.named_parameters()), canonical_names(model), 0,
                                                                   shape.num_layers, config.streaming.fragments),
                                  topology, log=lambda record, step: records.append(record),
                                  membership=StaticMembership(config, topology, key if with_key else None))
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
                outer.after_inner_step(config.sync_interval)
                outer.flush_metrics()
                del outer
                if repeat and records:
                    seconds[with_key].append(records[0]["sync_seconds"])
        if records:
            plain, tagged = statistics.median(seconds[False]), statistics.median(seconds[True])
            rows.append({"compression": label, "workers": dist.get_world_size(), "sync_s_without": plain,
                         "sync_s_with": tagged, "ratio": tagged / plain, "repeats": args.repeats,
                         "bytes_per_rank": records[0]["bytes_sent_per_rank"]})
    dist.destroy_process_group()
    return rows


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" in os.environ:
        rows = measure(args)
        if rows:
            Path(args.out).write_text(json.dumps(rows))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={args.workers}", __file__, "--model", args.model, "--vocab-size",
                        str(args.vocab_size), "--repeats", str(args.repeats), "--out", str(out)],
                       check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    print(f"model {args.model}, K = {args.workers}, medians of {args.repeats} syncs each, alternating")
    print(f"{'compression':<24} {'MB/rank':>8} {'sync s, no auth':>16} {'sync s, auth':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['compression']:<24} {r['bytes_per_rank'] / 1e6:>8.1f} {r['sync_s_without']:>16.3f} "
              f"{r['sync_s_with']:>13.3f} {r['ratio']:>6.3f}")
    print(json.dumps({"model": args.model, "rows": rows}))


if __name__ == "__main__":
    main()
