"""The quorum server of elastic MuLoCo workers: torchft's lighthouse behind an authenticated gateway.

    python -m muloco.elastic.lighthouse --bind 0.0.0.0:29510 --key-file job.key \\
        --join-timeout-s 30 --heartbeat-timeout-s 10

Every worker's torchft ManagerServer heartbeats to it and asks it for a quorum at each outer sync. A
quorum forms as soon as every worker it believes alive (heartbeat within --heartbeat-timeout-s) has
asked, or --join-timeout-s after the first one asked (the grace window of a slower worker), with at
least --min-workers of them (give it the workers' muloco.elastic.min_workers). So a
worker that died or stalled is out of the next quorum after about max(heartbeat, join) timeout; set
both near muloco.sync_timeout_s. The lighthouse holds no training state: restarting it only delays
the next quorum.

torchft's lighthouse itself listens on loopback only; --bind is the gateway in front of it
(muloco/elastic/tunnel.py), which admits only connections that prove they hold the job secret
(--key-file, default $MULOCO_AUTH_KEY_FILE, and --job-id as in the workers' muloco.auth). With
--no-auth the lighthouse listens on --bind directly and anyone who reaches it can join the quorum.
That loopback is one of the lighthouse's own (a network namespace, muloco/elastic/private_network.py),
so no other process on this host reaches torchft's port; where the kernel refuses one, the lighthouse
says so and any process on this host can reach that port: the workers still count only the quorum
members whose replica id the job secret signed, and log the others (muloco/elastic/authentic_quorum.py).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from muloco.diloco.auth import KEY_FILE_ENV, AuthConfig, read_private_job_key
from muloco.elastic.private_network import enter_private_network
from muloco.core.network import host_port
from muloco.elastic.tunnel import Gateway
from muloco.core.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", default="127.0.0.1:29510", help="HOST:PORT the workers connect to")
    p.add_argument("--key-file", default=os.environ.get(KEY_FILE_ENV, ""),
                   help=f"the job secret (default ${KEY_FILE_ENV})")
    p.add_argument("--job-id", default=AuthConfig.job_id, help="muloco.auth.job_id of the workers")
    p.add_argument("--no-auth", action="store_true", help="no gateway: anyone who reaches --bind can join")
    p.add_argument("--min-workers", type=int, default=1,
                   help="the smallest quorum it forms: give it the workers' muloco.elastic.min_workers (they refuse "
                        "smaller quorums anyway, asking again until their quorum_timeout_s)")
    p.add_argument("--join-timeout-s", type=float, default=30.0)
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    args = p.parse_args(argv)
    try:
        host, port = host_port(args.bind)
        if not args.no_auth and not args.key_file:
            raise ConfigError(f"the lighthouse admits only workers that hold the job secret: give --key-file or "
                              f"${KEY_FILE_ENV} (or --no-auth to admit anyone)")
        key = None if args.no_auth else read_private_job_key(Path(args.key_file), args.job_id)
    except (ValueError, ConfigError) as err:
        sys.exit(f"configuration error: {err}")
    from torchft.coordination import LighthouseServer  # torch and torchft: not for --help or a bad flag

    timeouts = dict(min_replicas=args.min_workers, join_timeout_ms=int(args.join_timeout_s * 1000),
                    heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000))
    if key is None:
        print("WARNING: --no-auth: anyone who can reach the lighthouse can join the quorum and send state to "
              "every worker", file=sys.stderr, flush=True)
        server, gateway = LighthouseServer(bind=f"{host}:{port}", **timeouts), None
        print(f"lighthouse at {server.address()} (no authentication)", flush=True)
    else:
        # The public port first, in the host's network; torchft's lighthouse (which starts threads) in its own.
        try:
            gateway = Gateway(host, port, None, key)
        except OSError as err:
            sys.exit(f"lighthouse: cannot listen on {args.bind}: {err}")
        try:
            refused = enter_private_network()
        except OSError as err:
            sys.exit(f"lighthouse: cannot set up a network of its own: {err}")
        server = LighthouseServer(bind="127.0.0.1:0", **timeouts)
        gateway.target = ("127.0.0.1", host_port(server.address())[1])
        gateway.start()
        reach = "only the gateway reaches torchft's port, on a loopback of the lighthouse's own"
        if refused is not None:
            reach = f"any process on this host can reach torchft's port 127.0.0.1:{gateway.target[1]}"
            print(f"WARNING: {reach}: a network of the lighthouse's own was refused ({refused}); the workers count "
                  "only the quorum members the job secret signed, and log the others", file=sys.stderr, flush=True)
        print(f"lighthouse at {gateway.address[0]}:{gateway.address[1]} (workers must hold the job secret; {reach})",
              flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if gateway is not None:
        gateway.close()
    server.shutdown()


if __name__ == "__main__":
    main()
