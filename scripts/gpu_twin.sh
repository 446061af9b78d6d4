#!/usr/bin/env bash
# A CPU twin of the GPU machine: run this before any GPU attempt and whenever the wheel list changes.
#
#   bash scripts/gpu_twin.sh
#
# Builds once, outside the repository ($MULOCO_GPU_TWIN, default ~/.cache/muloco_gpu_twin), a Python
# 3.12 environment holding the GPU image's own packages at its versions (/work/.library/device/KINDS.md
# on the machines that lend one: torch 2.11.0, transformers 5.17.0, numpy 2.5.2, triton 3.6.0, ...),
# and none of what the check carries; then runs gpu_check.sh's own install step with no index (only
# the wheels in .gpu_wheels/, filled by scripts/gpu_wheels.sh if empty) and the CPU check on that stack,
# then the same for scripts/gpu_evidence.sh.
# torch comes from PyPI: the same cu130 build the GPU image has (it runs on CPU; CUDA's libraries come
# with it, about 3 GB). MULOCO_TWIN_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build
# instead (about 0.2 GB) where that index is reachable. Not part of CI (it downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
TWIN="${MULOCO_GPU_TWIN:-$HOME/.cache/muloco_gpu_twin}"
# The GPU image's packages that the check imports, or that its install step looks for before it
# installs a carried wheel (those it finds are not installed from .gpu_wheels/).
IMAGE_PACKAGES=(
    torch==2.11.0 transformers==5.17.0 numpy==2.5.2 triton==3.6.0 safetensors==0.8.0 sentencepiece==0.2.2
    tokenizers==0.23.2 huggingface-hub==1.33.0 tensorboard pyarrow protobuf einops msgpack ninja psutil
    py-cpuinfo tqdm packaging typing-extensions
)

if [ ! -x "$TWIN/bin/python" ] || [ "$(cat "$TWIN/.packages" 2>/dev/null)" != "${IMAGE_PACKAGES[*]}" ]; then
    python312=""
    # (pyenv's shim is on PATH even where no 3.12 is its selected version: each candidate must run.)
    for candidate in "$(command -v python3.12 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
        if [ -n "$candidate" ] && "$candidate" --version >/dev/null 2>&1; then python312="$candidate"; break; fi
    done
    if [ -z "$python312" ]; then
        echo "[twin] no Python 3.12 interpreter found (python3.12 on PATH or under pyenv)" >&2
        exit 2
    fi
    rm -rf "$TWIN"
    "$python312" -m venv "$TWIN"
    if [ -n "${MULOCO_TWIN_TORCH_INDEX:-}" ]; then
        "$TWIN/bin/pip" install --quiet --index-url "$MULOCO_TWIN_TORCH_INDEX" torch==2.11.0
    fi
    "$TWIN/bin/pip" install --quiet "${IMAGE_PACKAGES[@]}"
    echo "${IMAGE_PACKAGES[*]}" > "$TWIN/.packages"
fi

shopt -s nullglob
wheels=(.gpu_wheels/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    PATH="$TWIN/bin:$PATH" bash scripts/gpu_wheels.sh
fi
"$TWIN/bin/python" - <<'PY'
import sys, torch, transformers, numpy
print(f"[twin] python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"numpy {numpy.__version__}", flush=True)
PY
OUT="${MULOCO_TWIN_OUT:-$(mktemp -d -t muloco_twin_XXXXXX)}"
# Each device run's own install step (no index) and its CPU stages, with the twin's python first on
# PATH; no PYTHONPATH from here, so nothing but the image's packages and the carried wheels is
# importable. Both run, whatever the first gives; their reports share $OUT (gpu_check.*, gpu_evidence.*).
failed=0
for run in gpu_check gpu_evidence; do
    env -u PYTHONPATH PATH="$TWIN/bin:$PATH" TORCH_EXTENSIONS_DIR="$TWIN/torch_extensions" \
        bash "scripts/$run.sh" --cpu --with-wheels --out "$OUT" || failed=1
done
exit $failed
