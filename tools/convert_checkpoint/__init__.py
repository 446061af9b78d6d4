"""Export a training checkpoint to a Hugging Face `transformers` model, and check the export.

python -m tools.convert_checkpoint --load CKPT --save HF_DIR [--iteration N] [--verify]

- `merge`: worker 0 / DP rank 0's shards, one pipeline stage at a time, merged over TP with the
  shared layout mapping (trainer.model.layout), un-padded vocabulary;
- `hf_mapping`: Megatron names and fused QKV / gate-up to Qwen3 (QK-norm) or Llama (no QK-norm);
- `safetensors_writer`: sharded model-*.safetensors written tensor by tensor, with the index;
- `verify`: the export, loaded by transformers, against the trainer's model rebuilt at T=1 P=1,
  and that model against the logits the sharded training model recorded when it saved.
"""
from tools.convert_checkpoint.export import export
from tools.convert_checkpoint.verify import VerifyReport, verify

__all__ = ["export", "verify", "VerifyReport"]
