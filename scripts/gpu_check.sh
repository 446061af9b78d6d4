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
PYTHON="$(command -v python3 || command -v python)"
# The wheels go to a folder put first on PYTHONPATH (the machine's own packages stay as they are).
# pip installs them without an index; where pip is missing, a wheel is a zip archive to unpack.
SITE="${TMPDIR:-/tmp}/muloco_gpu_check_site"
rm -rf "$SITE" && mkdir -p "$SITE"
# Only what the machine lacks: a carried wheel must not shadow a package the machine already has.
mapfile -t wheels < <("$PYTHON" - "${wheels[@]}" <<'PY'
import importlib.metadata, sys
for wheel in sys.argv[1:]:
    name = wheel.rsplit("/", 1)[-1].split("-")[0]
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PY
)
echo "[check] installing ${#wheels[@]} carried wheels: ${wheels[*]}"
if [ ${#wheels[@]} -eq 0 ]; then
    :
elif "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$SITE" "${wheels[@]}"
else
    for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
fi
export PYTHONPATH="$SITE:$PYTHONPATH"
exec "$PYTHON" scripts/gpu_check.py "$@"
