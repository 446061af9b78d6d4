"""Writes the Hugging Face directory: config.json (which records the weights it holds: the global ones
or one worker's, and the step), generation_config.json, sharded safetensors and, when the run used one,
the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import GenerationConfig

from tokenizer.hf_export import export_hf_tokenizer
from tokenizer.interface import load_tokenizer
from tools.convert_checkpoint import DEFAULT_MAX_SHARD_BYTES
from tools.convert_checkpoint.hf_mapping import hf_config, hf_tensors
from tools.convert_checkpoint.merge import WeightSource, full_weights
from tools.convert_checkpoint.safetensors_writer import ShardedSafetensorsWriter
from trainer.checkpoint import CheckpointReader


@dataclass
class ExportResult:
    out_dir: Path
    architecture: str
    files: list[Path]
    total_bytes: int
    tokenizer: bool


def _special_ids(reader: CheckpointReader) -> dict[str, int]:
    if reader.tokenizer_path is None:
        return {}
    tok = load_tokenizer(reader.tokenizer_path)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id, "pad_token_id": tok.pad_id}
    return {k: v for k, v in ids.items() if v is not None and v >= 0}


def export(reader: CheckpointReader, out_dir: str | Path, source: WeightSource,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ExportResult:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = _special_ids(reader)
    config = hf_config(reader.meta.model, reader.meta.vocab_size, special)
    config.muloco_export = source.metadata(reader.meta.step)  # transformers keeps unknown keys
    config.save_pretrained(out)
    GenerationConfig(**special).save_pretrained(out)
    writer = ShardedSafetensorsWriter(out, max_shard_bytes)
    for name, full in full_weights(reader, source):
        for hf_name, tensor in hf_tensors(name, full, reader.meta.model, reader.meta.vocab_size).items():
            writer.add(hf_name, tensor)
    files = writer.close()
    if reader.tokenizer_path is not None:
        export_hf_tokenizer(reader.tokenizer_path, out)
    return ExportResult(out, config.architectures[0], files, writer.total_bytes, bool(special))
