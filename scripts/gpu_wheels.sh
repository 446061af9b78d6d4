#!/usr/bin/env bash
# Fills .gpu_wheels/ with the wheels scripts/gpu_check.sh installs on the GPU machine: what the trainer
# imports beyond the machine's own packages (Python 3.12, torch, transformers, sentencepiece,
# safetensors, tensorboard, numpy, pyarrow), with their whole dependency closure, at the versions the
# CPU suite runs. Needs the package index once. .gpu_wheels/ is git-ignored, so it reaches the GPU
# machine only when the run names it to be carried:
#     run  command: bash scripts/gpu_check.sh --out "$OUT"   carry: [".gpu_wheels"]   timeout_s: 420
# (the report, gpu_check.md and gpu_check.json, comes back from $OUT; scripts/gpu_twin.sh rehearses it here).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu_wheels
LIMIT_MIB=40  # the working tree and these wheels travel together, within 64 MiB
mkdir -p "$DEST"

# deepspeed's own requirements (einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm) and
# pydantic's (pydantic-core annotated-types typing-inspection typing-extensions); megatron-core needs
# only numpy/packaging/torch; zstandard is imported by the outer loop's compression.
BINARY=(
    megatron-core==0.16.1
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions hjson==3.1.0 einops==0.8.2 ninja==1.13.2 py-cpuinfo==9.0.0 psutil==7.2.2
    msgpack==1.2.4 tqdm packaging zstandard
)
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    --dest "$DEST" "${BINARY[@]}"
# deepspeed ships only an sdist: build a pure-Python wheel (no ops compiled ahead of time) with the
# torch already in this environment.
if ! ls "$DEST"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$DEST" deepspeed==0.19.8
fi
total=$(du -sm "$DEST" | cut -f1)
ls -1 "$DEST"
echo "[wheels] $(ls "$DEST" | wc -l) wheels, ${total} MiB in $DEST"
if [ "$total" -gt "$LIMIT_MIB" ]; then
    echo "[wheels] more than $LIMIT_MIB MiB: the working tree would not travel" >&2
    exit 1
fi
