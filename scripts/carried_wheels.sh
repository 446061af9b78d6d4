#!/usr/bin/env bash
# Sourced by the device runs (scripts/gpu_check.sh, scripts/gpu_evidence.sh): run_device_script
# SCRIPT.py ARGS... runs SCRIPT.py with python, after the install step of the wheels carried in
# .gpu_wheels/ unless --cpu without --with-wheels. The caller has cd'd to the repository root and set
# MULOCO_CHECK_STARTED (the time budget counts from there: the install step is part of it).
run_device_script() {
    local script="$1"; shift
    local args=() with_wheels=0 cpu=0 arg
    for arg in "$@"; do
        case "$arg" in
            --with-wheels) with_wheels=1 ;;
            --cpu) cpu=1; args+=("$arg") ;;
            *) args+=("$arg") ;;
        esac
    done
    if [ $cpu -eq 1 ] && [ $with_wheels -eq 0 ]; then
        exec python "$script" "${args[@]}"
    fi

    shopt -s nullglob
    local wheels=(.gpu_wheels/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no wheels in .gpu_wheels/: run 'bash scripts/gpu_wheels.sh' on a machine with network first" >&2
        exit 2
    fi
    local PYTHON
    PYTHON="$(command -v python3 || command -v python)"
    # The wheels go to a folder put first on PYTHONPATH (the machine's own packages stay as they are).
    # pip installs them without an index; where pip is missing, a wheel is a zip archive to unpack.
    local SITE="${TMPDIR:-/tmp}/muloco_gpu_check_site"
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
    local install_start
    install_start=$(date +%s%N)
    if [ ${#wheels[@]} -eq 0 ]; then
        :
    elif "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$SITE" "${wheels[@]}"
    else
        local wheel
        for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
    fi
    echo "[check] install step: $(( ($(date +%s%N) - install_start) / 1000000 )) ms"
    export PYTHONPATH="$SITE:$PYTHONPATH"
    exec "$PYTHON" "$script" "${args[@]}"
}
