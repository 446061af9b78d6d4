"""The quorum server of elastic MuLoCo workers: torchft's lighthouse, started in this process.

    python -m trainer.elastic.lighthouse --bind 127.0.0.1:29510 --join-timeout-s 30 --heartbeat-timeout-s 10

Every worker's torchft ManagerServer heartbeats to it and asks it for a quorum at each outer sync. A
quorum forms as soon as every worker it believes alive (heartbeat within --heartbeat-timeout-s) has
asked, or --join-timeout-s after the first one asked, with at least --min-workers of them. So a
worker that died or stalled is out of the next quorum after about max(heartbeat, join) timeout; set
both near muloco.sync_timeout_s. The lighthouse holds no training state: restarting it only delays
the next quorum.
"""
from __future__ import annotations

import argparse
import signal
import threading

from torchft.coordination import LighthouseServer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", default="127.0.0.1:29510", help="HOST:PORT to listen on")
    p.add_argument("--min-workers", type=int, default=1, help="the smallest quorum allowed")
    p.add_argument("--join-timeout-s", type=float, default=30.0)
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    args = p.parse_args(argv)
    server = LighthouseServer(bind=args.bind, min_replicas=args.min_workers,
                              join_timeout_ms=int(args.join_timeout_s * 1000),
                              heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000))
    print(f"lighthouse at {server.address()}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
