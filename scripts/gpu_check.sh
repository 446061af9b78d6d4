#!/usr/bin/env bash
# The prepared device check (stages a-g of scripts/gpu_check.py) on one GPU, within 6 minutes of
# command time by its own budget (the install step below included); the report (gpu_check.md and
# gpu_check.json) is rewritten in the --out folder after every stage.
#
#   on the GPU machine, through the device tool (no network there: the carried wheels fill the gap):
#       run  command: bash scripts/gpu_check.sh --out "$OUT"
#            carry:   [".gpu_wheels"]          (git-ignored: travels only when named; scripts/gpu_wheels.sh fills it)
#            timeout_s: 420                    (the check ends itself at 360 s; a rerun fits the 15 minutes)
#       Python 3.12 with torch, transformers, sentencepiece, safetensors, tensorboard, numpy, pyarrow;
#       deepspeed, megatron-core and what they import come from the wheels in .gpu_wheels/
#   bash scripts/gpu_check.sh --cpu    the same stages on CPU (gloo, fp32, the tiny preset) with the
#                                      python on PATH; the report goes to a temporary folder (or --out)
#   bash scripts/gpu_check.sh --cpu --with-wheels   the install step first, as on the GPU (scripts/gpu_twin.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The check's time budget counts from here: the install step is part of the command's time.
export MULOCO_CHECK_STARTED="${MULOCO_CHECK_STARTED:-$(date +%s)}"

source scripts/carried_wheels.sh
run_device_script scripts/gpu_check.py "$@"
