#!/usr/bin/env bash
# Elastic MuLoCo on one machine: a torchft lighthouse and K=3 workers, each its own `deepspeed`
# launch (tiny model, 1 CPU rank each, 4-bit statistical compression with error feedback). Worker 2
# is killed with SIGKILL after its second outer sync and relaunched once the two others have synced
# without it; it loads the outer state from a live peer and trains on. Prints every outer sync
# (K_eff, who was missing, each worker's global-weight checksum) and ends with one JSON line. The
# config emulates a WAN link (500 ms per round trip), which also keeps the survivors from finishing
# before worker 2 is back.
# Authentication on: the lighthouse and the workers share a fresh job secret. Loopback only; every
# process it starts is killed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

TRAIN_ITERS="${TRAIN_ITERS:-150}"  # the survivors must outlast worker 2's restart
WORK="${ELASTIC_DEMO_DIR:-runs/elastic_demo}"
DS_CONFIG=ds_configs/cpu_tiny_elastic.json

. scripts/venv.sh
export OMP_NUM_THREADS=1
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

GROUPS_STARTED=()
MASTER_PORTS=()
cleanup() {
    for pgid in "${GROUPS_STARTED[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
    # DeepSpeed's per-rank shared-memory files (about 70 MB each): the trainer unlinks them at start,
    # but a rank killed before that leaves its own. Only this demo's launches' (named by their ports).
    for port in "${MASTER_PORTS[@]}"; do
        find /dev/shm -maxdepth 1 -name "deepspeed_allreduce_buffer_$(id -u)_*_${port}_*" -delete 2>/dev/null || true
    done
}
trap cleanup EXIT INT TERM

rm -rf "$WORK" && mkdir -p "$WORK"
echo "[elastic 1/4] data: a learnable synthetic token stream -> $WORK/markov"
python tools/synthetic_data.py "$WORK/markov"

# One secret for the lighthouse and every worker: nobody without it can join or send a message.
python -m muloco.diloco.auth new-key "$WORK/job.key"
export MULOCO_AUTH_KEY_FILE="$(cd "$WORK" && pwd)/job.key"
LIGHTHOUSE_PORT="$(free_port)"
export TORCHFT_LIGHTHOUSE="http://127.0.0.1:$LIGHTHOUSE_PORT"
echo "[elastic 2/4] lighthouse on 127.0.0.1:$LIGHTHOUSE_PORT, workers 0 1 2 (one deepspeed launch each)"
setsid python -m muloco.elastic.lighthouse --bind "127.0.0.1:$LIGHTHOUSE_PORT" --join-timeout-s 5 \
    --heartbeat-timeout-s 5 > "$WORK/lighthouse.log" 2>&1 &
GROUPS_STARTED+=($!)

start_worker() {  # worker id, run name
    local port
    port="$(free_port)"
    MASTER_PORTS+=("$port")
    setsid deepspeed --num_gpus 1 --master_port "$port" trainer/pretrain.py --ds_config "$DS_CONFIG" \
        --model tiny --data-path "$WORK/markov" --vocab-size 1000 --train-iters "$TRAIN_ITERS" \
        --log-interval 5 --eval-interval 0 --worker-id "$1" --run-dir "$WORK/$2" > "$WORK/$2.log" 2>&1 &
    GROUPS_STARTED+=($!)
    eval "PID_$2=$!"
}
outer_syncs() { cat "$WORK/$1/metrics.jsonl" 2>/dev/null | grep -c '"outer_step"' || true; }
wait_for() {  # description, condition (a shell expression), timeout in seconds
    local deadline=$((SECONDS + $3))
    until eval "$2"; do
        if [ $SECONDS -gt $deadline ]; then echo "timed out waiting for $1" >&2; exit 1; fi
        sleep 1
    done
}

start_worker 0 worker0; start_worker 1 worker1; start_worker 2 worker2
wait_for "worker 2's second outer sync" '[ "$(outer_syncs worker2)" -ge 2 ]' 600
echo "[elastic 3/4] SIGKILL worker 2 (after $(outer_syncs worker2) syncs)"
kill -KILL -- "-$PID_worker2"
wait_for "a sync of workers 0 and 1 alone" 'grep -q "\"missing\": \[2\]" "$WORK/worker0/metrics.jsonl"' 120
echo "[elastic 3/4] relaunch worker 2; it rejoins at its peers' next sync"
start_worker 2 worker2_restarted
for run in worker0 worker1 worker2_restarted; do
    pid_var="PID_$run"
    wait "${!pid_var}" || { echo "$run failed; its log: $WORK/$run.log" >&2; exit 1; }
done

echo "[elastic 4/4] outer syncs"
python - "$WORK" <<'PY'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
runs = {"0": "worker0", "1": "worker1", "2": "worker2", "2'": "worker2_restarted"}
records = {name: [json.loads(line) for line in (work / run / "metrics.jsonl").read_text().splitlines()]
           for name, run in runs.items()}
syncs = {name: {r["outer_step"]: r for r in rs if "outer_step" in r} for name, rs in records.items()}
steps = sorted(syncs["0"])
print(f"{'outer':>5} {'step':>5} {'K_eff':>5}  {'quorum':<8} {'missing':<8} {'left out':<12} " +
      " ".join(f"{'sha ' + name:<17}" for name in runs))
k_eff = []
for n in steps:
    r = syncs["0"][n]
    k_eff.append(r["workers_in_sync"])
    shas = " ".join(f"{syncs[name][n]['weights_sha'] if n in syncs[name] else '-':<17}" for name in runs)
    print(f"{n:>5} {r['step']:>5} {r['workers_in_sync']:>5}  {','.join(map(str, r['quorum'])):<8} "
          f"{','.join(map(str, r['missing'])) or '-':<8} {','.join(r['left_out']) or '-':<12} {shas}")
losses = [r["loss"] for r in records["0"] if "loss" in r]
last = steps[-1]
final = {"0": syncs["0"][last]["weights_sha"], "1": syncs["1"][last]["weights_sha"],
         "2": syncs["2'"][last]["weights_sha"]}
rejoined = any(r.get("rejoined") for r in syncs["2'"].values())
summary = {"syncs": len(steps), "k_eff": k_eff, "rejoined": rejoined, "final_checksums": final,
           "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4)}
if not (rejoined and len(set(final.values())) == 1 and losses[-1] < losses[0]):
    print(json.dumps(summary))
    sys.exit("the workers did not end with the same weights, worker 2 did not rejoin, or the loss did not fall")
print(json.dumps(summary))
PY
