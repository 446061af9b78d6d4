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

args=() with_wheels=0 cpu=0
for arg in "$@"; do
    case "$arg" in
        --with-wheels) with_wheels=1 ;;
        --cpu) cpu=1; args+=("$arg") ;;
        *) args+=("$arg") ;;
    esac
done
if [ $cpu -eq 1 ] && [ $with_wheels -eq 0 ]; then
    exec python scripts/gpu_check.py "${args[@]}"
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
install_start=$(date +%s%N)
if [ ${#wheels[@]} -eq 0 ]; then
    :
elif "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$SITE" "${wheels[@]}"
else
    for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
fi
echo "[check] install step: $(( ($(date +%s%N) - install_start) / 1000000 )) ms"
export PYTHONPATH="$SITE:$PYTHONPATH"
exec "$PYTHON" scripts/gpu_check.py "${args[@]}"
