#!/usr/bin/env bash
# The first command on a fresh machine: sets up .venv, builds a small real-text corpus from the
# Python standard library's documentation, trains a tokenizer, preprocesses, pretrains a tiny
# model with DeepSpeed on 2 CPU processes for a few minutes and saves it, exports the checkpoint to
# Hugging Face (verified against the trainer's logits) and samples one continuation from the export.
# Offline once installed. Re-running skips the stages that finished.
set -euo pipefail
cd "$(dirname "$0")/.."

DS_CONFIG=ds_configs/cpu_tiny_muloco.json  # the method the demo shows: MuLoCo, K=2 workers, 4-bit + EF
TRAIN_ITERS="${TRAIN_ITERS:-120}"  # steps; the environment may override (a quick smoke test)
EVAL_INTERVAL="${EVAL_INTERVAL:-20}"
DATA=demo_data
RUN_DIR=runs/demo
CKPT="$RUN_DIR/checkpoints"  # the trainer's --save
HF_DIR="$RUN_DIR/hf"         # its export, a Hugging Face folder
PROMPT="Return the"          # the corpus is the standard library's docstrings

. scripts/venv.sh

echo "[demo 1/7] corpus: Python stdlib docs in Nemotron-CC form -> $DATA/corpus"
if [ -f "$DATA/corpus/.complete" ]; then
    echo "  done before, skipping"
else
    python -m tools.build_demo_corpus --output "$DATA/corpus"
    touch "$DATA/corpus/.complete"
fi

echo "[demo 2/7] tokenizer: SentencePiece BPE, vocab 4096 -> $DATA/tokenizer/demo.model"
if [ -f "$DATA/tokenizer/demo.model" ]; then
    echo "  done before, skipping"
else
    python -m tokenizer.train --input "$DATA/corpus/train" --vocab-size 4096 --output-prefix "$DATA/tokenizer/demo"
fi

echo "[demo 3/7] preprocess: tokenize into Megatron .bin/.idx with 2 processes -> $DATA/data"
for split in train valid; do
    if [ -f "$DATA/data/${split}_text_document.idx" ]; then  # written last, under its final name
        echo "  $split: done before, skipping"
    else
        python tools/preprocess_data.py --input "$DATA/corpus/$split" --output-prefix "$DATA/data/$split" \
            --tokenizer-model "$DATA/tokenizer/demo.model" --processes 2
    fi
done

echo "[demo 4/7] pretrain: tiny model, $DS_CONFIG, $TRAIN_ITERS steps on 2 CPU processes -> $RUN_DIR, checkpoint $CKPT"
if [ -f "$RUN_DIR/summary.json" ] && [ -f "$CKPT/latest" ]; then
    echo "  done before, skipping (delete $RUN_DIR to train again)"
else
    rm -rf "$RUN_DIR"  # an interrupted run (or one without a checkpoint): metrics.jsonl would otherwise mix two runs
    master_port="$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
    # The K=2 workers tag every message with the job secret (made once, kept beside the data).
    [ -f "$DATA/job.key" ] || python -m muloco.diloco.auth new-key "$DATA/job.key"
    export MULOCO_AUTH_KEY_FILE="$(cd "$DATA" && pwd)/job.key"
    deepspeed --num_gpus 2 --master_port "$master_port" trainer/pretrain.py --ds_config "$DS_CONFIG" \
        --model tiny --train-iters "$TRAIN_ITERS" --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --log-interval 10 \
        --data-path "$DATA/data/train_text_document" --valid-data-path "$DATA/data/valid_text_document" \
        --tokenizer-model "$DATA/tokenizer/demo.model" --run-dir "$RUN_DIR" --save "$CKPT"
fi

echo "[demo 5/7] export: the last checkpoint (the global weights) to Hugging Face, verified -> $HF_DIR"
if [ -f "$HF_DIR/.complete" ]; then
    echo "  done before, skipping"
else
    rm -rf "$HF_DIR"  # an interrupted export
    python -m tools.convert_checkpoint --load "$CKPT" --save "$HF_DIR" --verify
    touch "$HF_DIR/.complete"
fi

echo "[demo 6/7] sample: one continuation of \"$PROMPT\" from the export (transformers; blank lines left out)"
python tools/generate.py --model "$HF_DIR" --prompt "$PROMPT" --max-new-tokens 48 | sed '/^[[:space:]]*$/d; s/^/  /'

echo "[demo 7/7] result"
python - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if "val_loss" in r]
first, last = evals[0], evals[-1]
print(f"  validation loss {first['val_loss']:.3f} at step {first['step']} -> {last['val_loss']:.3f} at step {last['step']}")
syncs = [r for r in map(json.loads, open(sys.argv[1])) if "outer_step" in r]
if syncs:
    print(f"  {len(syncs)} outer syncs, {syncs[-1]['bytes_sent_per_rank'] / 1e6:.2f} MB sent per rank per sync, "
          f"pseudogradient cosine {syncs[-1]['pseudograd_cosine']:.3f}")
if last["val_loss"] >= first["val_loss"]:
    sys.exit("  validation loss did not go down: something is wrong")
PY
echo "demo done: run dir $RUN_DIR (config.json, metrics.jsonl, summary.json, checkpoints/, hf/); TensorBoard: tensorboard --logdir $RUN_DIR/tensorboard"
