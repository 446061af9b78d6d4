#!/usr/bin/env bash
# Datacenters on real sockets on this machine (root, iproute2): K=3 elastic workers, each its own
# `deepspeed` launch of 2 CPU ranks inside a network namespace of its own, the lighthouse behind its
# gateway in another, every datacenter's egress limited by the kernel's tbf qdisc (200 Mbit/s), the job
# secret required. Prints each outer sync's global-weight checksum per worker and whether they agree;
# removes every namespace, link and process it made on exit (Ctrl-C and failures too).
# Options (python -m tools.rehearsal --help): --rates 200mbit,200mbit,50mbit --latency-ms 20 ...
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null || ! command -v tc > /dev/null; then
    echo "datacenters: needs root and iproute2 (ip, tc) to make network namespaces" >&2
    exit 2
fi
. scripts/venv.sh
export OMP_NUM_THREADS=1
exec python -m tools.rehearsal "$@"
