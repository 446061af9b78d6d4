"""The share of a real link's capacity the outer sync uses: K workers, each one rank in a network namespace
of its own whose egress the kernel limits to RATE (tools/datacenters.py; needs root and iproute2).

    python benchmarks/link_share.py [--rates 50mbit 200mbit 1000mbit] [--workers 2 3]
                                    [--collectives all_gather reduce_scatter] [--syncs 2] [--model 150m]

Every rank builds the preset's real model (gloo, its outer traffic on its namespace's address) and an
OuterLoop over it with 4-bit statistical compression + error feedback, then takes SYNCS outer syncs of
random pseudogradients per collective and form (`sync`: encoding, the exchange, decoding, the metrics);
then the wire alone moves a payload of the same size the way each collective does, SYNCS times per form.
The two forms, taken in turns: gloo's own collectives (`gloo collective`), and point to point with one
connection per direction (`lanes`: what the outer loop's gloo groups use, muloco/diloco/wire.py's exchange).
Every part starts on all ranks together (a barrier) and its time runs until all are done. Per part it
prints the payload bytes the wire counted (per rank), the bytes each worker's interface sent (the
kernel's counter: payload, tags, framing, TCP/IP headers), the time, and the link share: the least
interface bytes x 8 / rate over that time. One launch per K and rate; the last line is JSON.
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
    """One rank: every sync of every collective, then the transport alone on the same payload; its rows."""
    import torch
    import torch.distributed as dist

    from outer_worker import worker_model
    from muloco.diloco.config import CompressionConfig, MuLoCoConfig
    from muloco.diloco.membership import StaticMembership
    from muloco.diloco.outer_loop import OuterLoop
    from trainer.model.builder import canonical_names
    from trainer.outer_host import megatron_tensors

    model, topology, shape = worker_model(args.model, args.vocab_size)
    K, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    rows, payload = [], 0

    def row(part: str, collective: str, repeat: int, wall: float, sent: int, wire_bytes: float | None) -> dict:
        return {"K": K, "rank": rank, "rate": args.rate, "part": part, "collective": collective, "repeat": repeat,
                "wire_bytes": wire_bytes, "interface_bytes": sent, "seconds": wall}

    for collective in args.collectives:
        config = MuLoCoConfig(workers=K, sync_interval=SYNC_INTERVAL, collective=collective,
                              compression=CompressionConfig(**COMPRESSION))
        records = []
        membership = StaticMembership(config, topology, None)
        outer = OuterLoop(config, megatron_tensors(list(model.named_parameters()), canonical_names(model), 0,
                                                   shape.num_layers, config.streaming.fragments),
                          topology, log=lambda record, step: records.append(record), membership=membership)
        wire = membership._session.wire  # its lanes taken away for the syncs in gloo's collective form
        lanes = wire.lanes
        for sync in range(1, 2 * args.syncs + 1):
            form = "gloo collective" if sync % 2 else "lanes"  # in turns: a drift of the load hits both alike
            wire.lanes = lanes if form == "lanes" else None
            with torch.no_grad():  # this worker's H inner steps, as far as the sync can tell
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)
            dist.barrier()
            sent, start = _tx_bytes(), time.perf_counter()
            outer.after_inner_step(sync * SYNC_INTERVAL)  # the sync, blocking (no overlap)
            outer.flush_metrics()
            dist.barrier()  # until every worker is done
            # the record (the logging rank's): the mean over ranks of the payload bytes sent
            mean = records[-1]["bytes_sent_per_rank"] if records else None
            rows.append(row(f"sync, {form}", collective, (sync + 1) // 2, time.perf_counter() - start,
                            _tx_bytes() - sent, mean))
            payload = payload or (int(mean) // (K - 1) if mean and collective == "all_gather" else 0)
        del outer
    shared = [payload]
    dist.broadcast_object_list(shared, src=0)
    rows += transport(args, shared[0], row)
    dist.destroy_process_group()
    return rows


def transport(args: argparse.Namespace, payload: int, row) -> list[dict]:
    """The wire alone (tags on, as a job's) moving a payload of the sync's size the way each collective
    does: all_gather, one all-gather of it; reduce_scatter, an all-to-all of its K chunks, then an
    all-gather of one chunk; in two forms, in turns: gloo's own collectives, and point to point on lanes
    (what the outer loop's gloo groups use: muloco/diloco/wire.py's exchange). Every rank starts together and the
    time runs until every one is done."""
    import torch
    import torch.distributed as dist

    from muloco.diloco.auth import JobKey
    from muloco.diloco.wire import GroupWire, Lanes

    key = JobKey(b"benchmark-secret" * 2, "link-share")
    wires = {"gloo collective": GroupWire(None, link=None, key=key),
             "lanes": GroupWire(None, link=None, key=key, lanes=Lanes(dist.new_group(), dist.new_group()))}
    K = dist.get_world_size()
    buffer = torch.randint(0, 256, (payload - payload % K,), dtype=torch.uint8)
    chunks = list(buffer.chunk(K))
    rows = []
    for collective in args.collectives:
        for repeat in range(1, args.syncs + 1):
            for form, wire in wires.items():  # in turns: a drift of the machine's load hits both alike
                wire.begin(outer_step=repeat, fragment=0)
                dist.barrier()
                sent, start = _tx_bytes(), time.perf_counter()
                if collective == "all_gather":
                    wire.all_gather(buffer, "link share")
                else:
                    wire.all_to_all(chunks, [c.numel() for c in chunks], "link share")
                    wire.all_gather(chunks[wire.rank], "link share")
                dist.barrier()
                wall, sent = time.perf_counter() - start, _tx_bytes() - sent
                rows.append(row(f"wire, {form}", collective, repeat, wall, sent, wire.take_stats().bytes_sent))
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
    from tools.datacenters import rate_bits, unavailable

    why = unavailable()
    if why:
        sys.exit(f"link_share: cannot make network namespaces here: {why}")
    print(f"model {args.model}, 4-bit statistical + EF, one rank per worker, each worker's egress limited by tbf",
          flush=True)
    print(f"{'K':>2} {'rate':>9} {'collective':<15} {'part':<22} {'#':>2} {'wire MB':>8} "
          f"{'sent MB per worker':<20} {'seconds':>8} {'link share':>10}", flush=True)
    rows = []
    for K in args.workers:
        for rate in args.rates:
            got = launch(args, K, rate)
            rows += got
            for part in ("wire, gloo collective", "wire, lanes", "sync, gloo collective", "sync, lanes"):
                for collective in args.collectives:
                    for repeat in range(1, args.syncs + 1):
                        per = sorted((r for r in got if (r["part"], r["collective"], r["repeat"]) ==
                                      (part, collective, repeat)), key=lambda r: r["rank"])
                        wall = max(r["seconds"] for r in per)
                        wire_mb = max(r["wire_bytes"] or 0 for r in per)
                        share = min(r["interface_bytes"] for r in per) * 8 / rate_bits(rate) / wall
                        sent = " ".join(f"{r['interface_bytes'] / 1e6:.1f}" for r in per)
                        print(f"{K:>2} {rate:>9} {collective:<15} {part:<22} {repeat:>2} {wire_mb / 1e6:>8.1f} "
                              f"{sent:<20} {wall:>8.2f} {share:>10.2f}", flush=True)
    print(json.dumps({"model": args.model, "compression": COMPRESSION, "rows": rows}))


if __name__ == "__main__":
    main()
