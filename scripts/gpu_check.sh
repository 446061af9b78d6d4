#!/usr/bin/env bash
# The prepared device check (issue 10): stages a-e of scripts/gpu_check.py on one GPU, at most about
# 5 minutes, writing results/gpu_check.md and results/gpu_check.json.
#
#   bash scripts/gpu_check.sh          on the GPU machine: Python 3.12 with torch, transformers,
#                                      sentencepiece, safetensors, tensorboard, numpy, pyarrow, and no
#                                      network; deepspeed, megatron-core and what they import come from
#                                      the wheels in .gpu_wheels/ (filled here by scripts/gpu_wheels.sh)
#   bash scripts/gpu_check.sh --cpu    the same stages on CPU (gloo, fp32, the tiny preset) with the
#                                      python on PATH; the report goes to a temporary folder
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ " $* " == *" --cpu "* ]]; then
    exec python scripts/gpu_check.py "$@"
fi

shopt -s nullglob
wheels=(.gpu_wheels/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .gpu_wheels/: run 'bash scripts/gpu_wheels.sh' on a machine with network first" >&2
    exit 2
fi
# A venv that sees the machine's torch and friends, plus the carried wheels (no index: no network).
VENV="${TMPDIR:-/tmp}/muloco_gpu_check_venv"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "${wheels[@]}"
exec "$VENV/bin/python" scripts/gpu_check.py "$@"
