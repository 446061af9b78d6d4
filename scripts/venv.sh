# Sourced by the scripts in this folder, from the repository root: creates .venv on first use,
# installs the project into it and activates it. Reinstalls when the package metadata changes.
VENV_DIR=.venv
INSTALL_STAMP="$VENV_DIR/.muloco-installed"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "[setup] creating $VENV_DIR"
    python3 -m venv "$VENV_DIR"
fi
. "$VENV_DIR/bin/activate"
wanted_install="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$INSTALL_STAMP" 2>/dev/null)" != "$wanted_install" ]; then
    echo "[setup] installing the project into $VENV_DIR (once; later runs skip this)"
    # torch pinned first: resolved as a bare dependency it could pull a multi-GB CUDA build.
    pip install --quiet torch==2.13.0
    pip install --quiet -e ".[trainer,hf,test]"
    echo "$wanted_install" > "$INSTALL_STAMP"
fi
# (No blanket PYTHONWARNINGS=ignore: importing `trainer` filters the specific import-time warnings
# megatron-core gives about optional kernels it does not use; every other warning shows.)
# DeepSpeed JIT-builds its CPU comm op on first use; a per-venv folder keeps another venv's build
# (other torch, or one in progress) from being waited on or loaded.
export TORCH_EXTENSIONS_DIR="$PWD/$VENV_DIR/torch_extensions"
# Build the CPU ops once here, not inside the first launch (where the ranks would wait on them): the
# comm op every launch uses, and the FusedAdam that DeepSpeed's Muon builds for its Adam half.
if [ ! -d "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm" ] || [ ! -d "$TORCH_EXTENSIONS_DIR/fused_adam" ]; then
    python - <<'PY'
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":
    print("[setup] building DeepSpeed's CPU comm and FusedAdam ops (once, about two minutes)", flush=True)
    from deepspeed.ops.op_builder.cpu import FusedAdamBuilder, ShareMemCommBuilder
    ShareMemCommBuilder().load(verbose=False)
    FusedAdamBuilder().load(verbose=False)
PY
fi
