"""The share of a real link's capacity the outer sync uses: K workers, each one rank in a network namespace
of its own whose egress the kernel limits to RATE (tools/datacenters.py; needs root and iproute2).

    python benchmarks/link_share.py [--rates 50mbit 200mbit 1000mbit] [--workers 2 3]
                                    [--collectives all_gather reduce_scatter] [--syncs 2] [--model 150m]

Every rank builds the preset's real model (gloo, its outer traffic on its namespace's address) and an
OuterLoop over it with 4-bit statistical compression + error feedback, then takes SYNCS outer syncs of
random pseudogradients per collective. Per sync and worker it prints the bytes its interface sent
(the kernel's counter: payload, framing and TCP/IP headers), the sync's wall time (this rank's, with its metrics), the time spent
inside the transport's collectives, and the link share: (bytes x 8 / rate) over the sync's wall
time, and over the transport's. One launch per K and rate; the last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
COMPRESSION = {"method": "statistical", "bits": 4, "error_feedback": True}
SYNC_INTERVAL = 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["50mbit", "200mbit", "1000mbit"])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    p.add_argument("--collectives", nargs="+", default=["all_gather", "reduce_scatter"],
                   choices=["all_gather", "reduce_scatter"])
    p.add_argument("--syncs", type=int, default=2, help="outer syncs per collective")
    p.add_argument("--model", default="150m")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--rate", help=argparse.SUPPRESS)  # a rank's link (set by the driver)
    p.add_argument("--out", help=argparse.SUPPRESS)  # a rank's result file (set by the driver)
    return p.parse_args(argv)


def _tx_bytes() -> int:
    from tools.datacenters import INTERFACE
    return int(Path(f"/sys/class/net/{INTERFACE}/statistics/tx_bytes").read_text())


def measure(args: argparse.Namespace) -> list[dict]:
    """One rank: every sync of every collective; its rows."""
    import torch
    import torch.distributed as dist

    from outer_worker import worker_model
    from muloco.diloco import wire as transport
    from muloco.diloco.config import CompressionConfig, MuLoCoConfig
    from muloco.diloco.membership import StaticMembership
    from muloco.diloco.outer_loop import OuterLoop
    from tools.datacenters import rate_bits
    from trainer.model.builder import canonical_names
    from trainer.outer_host import megatron_tensors

    in_transport = [0.0]  # seconds inside the transport's collectives, this sync

    def timed(raw):
        def run(self, *a, **k):
            start = time.perf_counter()
            try:
                return raw(self, *a, **k)
            finally:
                in_transport[0] += time.perf_counter() - start
        return run
    wire = transport.GroupWire
    wire._all_gather_into, wire._all_to_all_into = timed(wire._all_gather_into), timed(wire._all_to_all_into)

    model, topology, shape = worker_model(args.model, args.vocab_size)
    K, rank, rate = dist.get_world_size(), dist.get_rank(), rate_bits(args.rate)
    generator = torch.Generator().manual_seed(rank)
    rows = []
    for collective in args.collectives:
        config = MuLoCoConfig(workers=K, sync_interval=SYNC_INTERVAL, collective=collective,
                              compression=CompressionConfig(**COMPRESSION))
        records = []
        outer = OuterLoop(config, megatron_tensors(list(model.named_parameters()), canonical_names(model), 0,
                                                   shape.num_layers, config.streaming.fragments),
                          topology, log=lambda record, step: records.append(record),
                          membership=StaticMembership(config, topology, None))
        for sync in range(1, args.syncs + 1):
            with torch.no_grad():  # this worker's H inner steps, as far as the sync can tell
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
            dist.barrier()
            in_transport[0], sent, start = 0.0, _tx_bytes(), time.perf_counter()
            outer.after_inner_step(sync * SYNC_INTERVAL)  # the sync, blocking (no overlap)
            outer.flush_metrics()
            wall, sent = time.perf_counter() - start, _tx_bytes() - sent
            rows.append({"K": K, "rank": rank, "rate": args.rate, "collective": collective, "sync": sync,
                         # the record (the logging rank's): the mean over ranks of the payload bytes sent
                         "payload_bytes": records[-1]["bytes_sent_per_rank"] if records else None,
                         "interface_bytes": sent, "sync_seconds": wall, "transport_seconds": in_transport[0],
                         "share_of_sync": sent * 8 / rate / wall, "share_of_transport": sent * 8 / rate / in_transport[0]})
        del outer
    dist.destroy_process_group()
    return rows


def launch(args: argparse.Namespace, workers: int, rate: str) -> list[dict]:
    """K ranks, one per datacenter namespace, on links of `rate`."""
    from tools.datacenters import INTERFACE, Datacenters, wait_until
    from tools.trainer_runs import free_port

    with tempfile.TemporaryDirectory() as tmp, Datacenters([rate] * workers) as dcs:
        port = free_port()
        procs = []
        for k, site in enumerate(dcs.sites):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "RANK": str(k),
                   "LOCAL_RANK": "0", "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": dcs.sites[0].address, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": INTERFACE}
            argv = [sys.executable, __file__, "--rate", rate, "--out", f"{tmp}/rank{k}.json", "--model", args.model,
                    "--vocab-size", str(args.vocab_size), "--syncs", str(args.syncs),
                    "--collectives", *args.collectives]
            procs.append(dcs.spawn(site, argv, Path(tmp) / f"rank{k}.log", env, cwd=REPO_ROOT))
        wait_until(lambda: all(p.poll() is not None for p in procs), 3600, "the ranks to finish", poll_s=1.0)
        failed = [k for k, p in enumerate(procs) if p.returncode != 0]
        if failed:
            sys.exit("\n".join(f"rank {k} failed:\n{(Path(tmp) / f'rank{k}.log').read_text()[-3000:]}" for k in failed))
        return [row for k in range(workers) for row in json.loads((Path(tmp) / f"rank{k}.json").read_text())]


def main() -> None:
    args = parse_args()
    if args.out:  # a rank
        rows = measure(args)
        Path(args.out).write_text(json.dumps(rows))
        return
    from tools.datacenters import unavailable

    why = unavailable()
    if why:
        sys.exit(f"link_share: cannot make network namespaces here: {why}")
    print(f"model {args.model}, 4-bit statistical + EF, one rank per worker, each worker's egress limited by tbf",
          flush=True)
    print(f"{'K':>2} {'rate':>9} {'collective':<15} {'sync':>4} {'payload MB':>10} {'sent MB (per worker)':<24} "
          f"{'sync s':>7} {'transport s':>11} {'share/sync':>10} {'share/transport':>15}", flush=True)
    rows = []
    for K in args.workers:
        for rate in args.rates:
            got = launch(args, K, rate)
            rows += got
            for collective in args.collectives:
                for sync in range(1, args.syncs + 1):
                    per = sorted((r for r in got if r["collective"] == collective and r["sync"] == sync),
                                 key=lambda r: r["rank"])
                    slowest = max(per, key=lambda r: r["sync_seconds"])
                    sent = " ".join(f"{r['interface_bytes'] / 1e6:.1f}" for r in per)
                    print(f"{K:>2} {rate:>9} {collective:<15} {sync:>4} {per[0]['payload_bytes'] / 1e6:>10.1f} "
                          f"{sent:<24} {slowest['sync_seconds']:>7.2f} "
                          f"{max(r['transport_seconds'] for r in per):>11.2f} "
                          f"{min(r['share_of_sync'] for r in per):>10.2f} "
                          f"{min(r['share_of_transport'] for r in per):>15.2f}", flush=True)
    print(json.dumps({"model": args.model, "compression": COMPRESSION, "rows": rows}))


if __name__ == "__main__":
    main()
