#!/usr/bin/env bash
# The GPU run that decides claim (e) at 150M (stages a-b of scripts/gpu_evidence.py) on one GPU, within
# 6 minutes of command time by its own budget (the install step included); the report
# (gpu_evidence.md and gpu_evidence.json) is rewritten in the --out folder after every stage.
#
#   on the GPU machine, through the device tool, after scripts/gpu_check.sh (same conventions):
#       run  command: bash scripts/gpu_evidence.sh --out "$OUT"
#            carry:   [".gpu_wheels"]          (git-ignored: travels only when named; scripts/gpu_wheels.sh fills it)
#            timeout_s: 420                    (the run ends itself at 360 s)
#   bash scripts/gpu_evidence.sh --cpu    the same stages on CPU (gloo, fp32, the tiny preset) with the
#                                         python on PATH; the report goes to a temporary folder (or --out)
#   bash scripts/gpu_evidence.sh --cpu --with-wheels   the install step first, as on the GPU (scripts/gpu_twin.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The run's time budget counts from here: the install step is part of the command's time.
export MULOCO_CHECK_STARTED="${MULOCO_CHECK_STARTED:-$(date +%s)}"

source scripts/carried_wheels.sh
run_device_script scripts/gpu_evidence.py "$@"
