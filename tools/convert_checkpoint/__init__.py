"""Checkpoints to and from Hugging Face `transformers` models.

python -m tools.convert_checkpoint --load CKPT --save HF_DIR [--iteration N] [--verify]      (export)
python -m tools.convert_checkpoint --from-hf HF_DIR --save CKPT --tensor-model-parallel-size T \
    --pipeline-model-parallel-size P [--verify]                                                (import)

- `merge`: worker 0 / DP rank 0's shards, one pipeline stage at a time, merged over TP with the
  shared sharding rules (trainer.model.sharding), un-padded vocabulary;
- `hf_mapping`: Megatron names and fused QKV / gate-up <-> Qwen3 (QK-norm), Llama (no QK-norm) or
  Gemma3 (the paper's blocks), in both directions;
- `safetensors_writer`: sharded model-*.safetensors written tensor by tensor, with the index;
- `export`: a checkpoint as a Hugging Face folder;
- `hf_folder`: a Hugging Face folder read and checked (config.json as a ModelShape, the tensors);
- `import_hf`: a Hugging Face folder as a weights-only checkpoint in T x P shards;
- `verify`: an export, loaded by transformers, against the trainer's model rebuilt at T=1 P=1, and
  that model against the logits the sharded training model recorded when it saved; an import's
  recorded logits against transformers', and its round trip back to Hugging Face tensors.
(The package imports nothing itself: the importer's shard writers import only what they use.)
"""

DEFAULT_MAX_SHARD_BYTES = 5 * 2 ** 30  # an export's safetensors files (here: the command's default needs no torch)
