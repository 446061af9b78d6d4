"""python -m tools.convert_checkpoint --load CKPT --save HF_DIR [--iteration N] [--verify]"""
from __future__ import annotations

import argparse
import sys
import time

from tools.convert_checkpoint.export import DEFAULT_MAX_SHARD_BYTES, export
from tools.convert_checkpoint.verify import verify
from trainer.checkpoint import CheckpointError, CheckpointReader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.convert_checkpoint", description=__doc__)
    p.add_argument("--load", required=True, help="checkpoint directory (the trainer's --save)")
    p.add_argument("--save", required=True, help="output directory for the Hugging Face model")
    p.add_argument("--iteration", type=int, default=None, help="step to export (default: latest)")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    p.add_argument("--verify", action="store_true", help="compare the export's logits with the trainer's model")
    p.add_argument("--verify-only", action="store_true", help="verify an existing export in --save, write nothing")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="do not check rank files against the SHA-256 recorded in meta.json")
    args = p.parse_args(argv)
    try:
        reader = CheckpointReader(args.load, args.iteration, verify_checksums=args.verify_checksums)
        if not args.verify_only:
            _export(reader, args)
        if not (args.verify or args.verify_only):
            return 0
        report = verify(reader, args.save)
    except CheckpointError as err:  # a rank file is read (and checked) when first used
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 2
    print(report)
    if not report.ok:
        print("VERIFY FAILED: the exported model does not reproduce the trainer's logits", file=sys.stderr)
        return 1
    print("verify passed")
    return 0


def _export(reader: CheckpointReader, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    result = export(reader, args.save, args.max_shard_bytes)
    print(f"exported {reader.directory} ({reader.meta.describe_layout()}) as {result.architecture} to {result.out_dir}: "
          f"{len(result.files)} safetensors file(s), {result.total_bytes / 2 ** 20:.1f} MiB"
          f"{', tokenizer' if result.tokenizer else ''} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
