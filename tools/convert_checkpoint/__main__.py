"""python -m tools.convert_checkpoint --load CKPT --save HF_DIR [--iteration N] [--worker K] [--verify]  (export)
python -m tools.convert_checkpoint --from-hf HF_DIR --save CKPT [--tensor-model-parallel-size T]
    [--pipeline-model-parallel-size P] [--untie-embeddings] [--verify]                           (import)"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from muloco.core.errors import CheckpointError, ConfigError
from tools.convert_checkpoint import DEFAULT_MAX_SHARD_BYTES
from tools.convert_checkpoint.folder_files import HfFolderError

if TYPE_CHECKING:
    from tools.convert_checkpoint.verify import VerifyReport

# Each direction imports what it runs, once the arguments are good: the export transformers (and Megatron to
# verify), the import Megatron; --help and a mistyped flag answer at once.


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.convert_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="export: checkpoint directory (the trainer's --save)")
    source.add_argument("--from-hf", metavar="HF_DIR",
                        help="import: a Hugging Face folder (config.json, safetensors, tokenizer.json) of a Llama, "
                             "Qwen3 or Gemma3 (the form --arch paper exports) model")
    p.add_argument("--save", required=True, help="export: the Hugging Face folder; import: the checkpoint directory")
    p.add_argument("--iteration", type=int, default=None, help="export: step to export (default: latest)")
    p.add_argument("--worker", type=int, default=None,
                   help="export: worker K's own weights (default: the outer loop's global weights, which every "
                        "worker shares; a data-parallel checkpoint holds one model)")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="import: T of the checkpoint's shards")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="import: P of the checkpoint's shards")
    p.add_argument("--untie-embeddings", action="store_true",
                   help="import a model with tied embeddings: the output layer starts as a copy of the embedding "
                        "and is trained as its own matrix")
    p.add_argument("--verify", action="store_true",
                   help="export: the export's logits against the trainer's model; import: the imported model's "
                        "logits at T x P against transformers', and the round trip back to Hugging Face tensors")
    p.add_argument("--verify-only", action="store_true", help="export: verify an existing export in --save, write nothing")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="do not check rank files against the SHA-256 recorded in meta.json")
    args = p.parse_args(argv)
    try:
        report = _import(args) if args.from_hf else _export(args)
    except (HfFolderError, ConfigError) as err:
        print(f"{'import' if args.from_hf else 'export'} error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # a rank file is read (and checked) when first used
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 2
    if report is None:
        return 0
    print(report)
    if not report.ok:
        what = "imported model does not reproduce transformers'" if args.from_hf else \
            "exported model does not reproduce the trainer's"
        print(f"VERIFY FAILED: the {what} logits or tensors", file=sys.stderr)
        return 1
    print("verify passed")
    return 0


def _export(args: argparse.Namespace) -> VerifyReport | None:
    from tools.convert_checkpoint.export import export
    from tools.convert_checkpoint.merge import WeightSource
    from trainer.checkpoint import CheckpointReader

    reader = CheckpointReader(args.load, args.iteration, verify_checksums=args.verify_checksums)
    source = WeightSource.of(reader, args.worker)
    if not args.verify_only:
        start = time.perf_counter()
        result = export(reader, args.save, source, args.max_shard_bytes)
        print(f"exported {reader.directory} ({reader.meta.describe_layout()}) as {result.architecture} to "
              f"{result.out_dir}: {len(result.files)} safetensors file(s), {result.total_bytes / 2 ** 20:.1f} MiB"
              f"{', tokenizer' if result.tokenizer else ''} in {time.perf_counter() - start:.1f}s")
        print(f"weights: {source.describe()}")
    if not (args.verify or args.verify_only):
        return None
    from tools.convert_checkpoint.verify import verify

    return verify(reader, args.save, source)


def _import(args: argparse.Namespace) -> VerifyReport | None:
    from tools.convert_checkpoint.import_hf import import_hf

    start = time.perf_counter()
    result = import_hf(args.from_hf, args.save, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                       args.untie_embeddings)
    print(f"imported {args.from_hf} ({result.architecture}) as {result.directory} ({result.layout}, weights only"
          f"{', tokenizer' if result.tokenizer else ''}) in {time.perf_counter() - start:.1f}s")
    for note in result.notes:
        print(f"  {note}")
    if not args.verify:
        return None
    from tools.convert_checkpoint.verify import verify_import
    from trainer.checkpoint import CheckpointReader

    return verify_import(CheckpointReader(args.save), args.from_hf, args.untie_embeddings)


if __name__ == "__main__":
    sys.exit(main())
