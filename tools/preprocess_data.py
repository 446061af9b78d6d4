"""Tokenize a corpus's input files into Megatron's indexed dataset format (P_text_document.bin/.idx/.meta.json).

python tools/preprocess_data.py --input <files/dirs/globs ...> --output-prefix P \
    --tokenizer-model M [--tokenizer-type T] [--json-key text] [--processes N] [--strict] [--keep-parts]
    [--partition I/N] [--input-files-per-output K] [--max-tokens-per-file T]
python tools/preprocess_data.py --merge-manifests 'P_partition-*.json' --data-args-path P.data_args \
    [--subset-weights high=2,medium=1 | weights.json]

One document per JSON line (or parquet row), each followed by the end-of-document token (unless
--no-append-eod). Megatron's spellings work too: --json-keys text, --append-eod, --workers N (for
--processes), --tokenizer-type SentencePieceTokenizer|HuggingFaceTokenizer. --tokenizer-model names a
SentencePiece .model, a Hugging Face tokenizer.json, or a folder holding one.

Each input file is cut into chunks (dataprep.chunks) so that N processes share even one big file: uncompressed
JSONL by byte ranges, compressed JSONL decompressed once here and handed out in blocks of lines, parquet by
row groups. Each chunk's result is published atomically as a part file pair in a .parts/ folder with a
manifest; the parts are merged in order, so the output is byte-identical for any number of processes. The
processes only tokenize (into each part's .bin); this one writes the .idx files with Megatron's own writer, whose
import (about as long as torch's, without the rest of megatron.core: dataprep.index_code) it makes while the first
chunks are tokenized. A rerun
with the same arguments reuses the finished chunks, so an interrupted run resumes; the final files appear
only once complete, their .meta.json (dataprep.dataset_meta) last.

Without --partition, --input-files-per-output or --max-tokens-per-file everything goes into P_text_document.
With any of them there is one output per input group (dataprep.partition: K consecutive input files of one
subset, default 1), written as P_000123_text_document (P_000123_0000_text_document, ... when cut by
--max-tokens-per-file), the same files whichever process writes them. --partition I/N (or a Slurm
array's variables) processes only the I-th of N shares of the groups and records them in
P_partition-IIIII-of-NNNNN.json (dataprep.manifest); a rerun skips its finished groups. --merge-manifests
checks that the partitions covered every input file exactly once and writes the blend (dataprep.blend).

Bad records (malformed JSON, missing key, invalid UTF-8, lone surrogates, a record longer than
--max-document-bytes, ...) are dropped, counted and reported with file and line; an input file that cannot be
read is reported and skipped. --strict stops at the first. Writing no document at all is an error. No input is
held whole: compressed files inflate a piece at a time and an over-long line streams past unread.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from dataprep.input_files import DEFAULT_MAX_DOCUMENT_BYTES, DEFAULT_MAX_INFLATE_RATIO, NoInputMatchedError
from dataprep.manifest import SubsetStats
from dataprep.merge_partitions import MergeConfig, MergeSummary, run_merge
from dataprep.partition import Partition, PartitionError
from tokenizer.interface import TOKENIZER_TYPES
from tools.preprocessing.config import PreprocessConfig
from tools.preprocessing.run import run_preprocess
from tools.preprocessing.tokenize_worker import StrictModeError


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig | MergeConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+",
                        help="input files, dirs (searched recursively) or globs: "
                             ".jsonl.zstd .jsonl.zst .jsonl.gz .jsonl .parquet")
    parser.add_argument("--output-prefix", help="writes PREFIX_text_document.bin/.idx/.meta.json (one output per "
                                                "input group: PREFIX_000123_text_document..., and a manifest)")
    parser.add_argument("--tokenizer-model", type=Path,
                        help="SentencePiece .model, Hugging Face tokenizer.json, or a folder holding a tokenizer.json")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                        help="Megatron's spelling; checked against the model file (default: read from it)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--json-key", default="text", help="field (or parquet column) holding the text")
    key.add_argument("--json-keys", nargs="+", metavar="KEY", help="Megatron's spelling; exactly one key")
    parser.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                        help="end every document with the end-of-document token (the default here; "
                             "accepted for Megatron's scripts, where it is off by default)")
    parser.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    parser.add_argument("--processes", "--workers", type=int, default=1,
                        help="tokenizing processes; they share the chunks of every input file, big or small "
                             "(--workers: Megatron's spelling)")
    parser.add_argument("--chunk-mb", type=float,
                        help="chunk size in MB of uncompressed text (default: 1/64 of each input file, 1-256 MiB)")
    parser.add_argument("--max-document-bytes", type=int, default=DEFAULT_MAX_DOCUMENT_BYTES,
                        help="drop (as a bad record) a JSON line or parquet text longer than this many bytes, "
                             "without holding it (default: %(default)s)")
    parser.add_argument("--max-inflate-ratio", type=float, default=DEFAULT_MAX_INFLATE_RATIO,
                        help="drop (as one bad record) the rest of a compressed input file, or a parquet column "
                             "chunk, once it inflates past this many times its stored bytes (16 MiB always pass; "
                             "default: %(default)g)")
    parser.add_argument("--strict", action="store_true", help="fail on the first bad record")
    parser.add_argument("--keep-parts", action="store_true", help="keep the per-chunk parts after merging")
    per_group = parser.add_argument_group("one output per group of input files, split across machines")
    per_group.add_argument("--partition", metavar="I/N",
                           help="process the I-th (0-based) of N shares of the input (default inside a Slurm array "
                                "job: its SLURM_ARRAY_TASK_ID among the array's tasks)")
    per_group.add_argument("--input-files-per-output", "--shards-per-file", type=int,
                           help="input files (of one subset) per output (default 1; --shards-per-file: its "
                                "former spelling)")
    per_group.add_argument("--max-tokens-per-file", type=int,
                           help="cut each output file at document boundaries to at most this many tokens (a group's "
                                 "last file, if under half of it, shares the documents of the one before evenly)")
    merge = parser.add_argument_group("merging the partitions (reads metadata only)")
    merge.add_argument("--merge-manifests", nargs="+", metavar="MANIFEST",
                       help="the partitions' PREFIX_partition-*-of-*.json files (or globs)")
    merge.add_argument("--data-args-path", type=Path, help="where the merge writes the blend (weights and prefixes, "
                                                           "as the trainer's and Megatron's --data-args-path read it)")
    merge.add_argument("--subset-weights", "--bucket-weights", metavar="NAME=W,...|FILE.json",
                       help="multiply the token-count weight of each subset matching NAME (a folder such as "
                            "quality=high, or its value high) by W (--bucket-weights: its former spelling)")
    args = parser.parse_args(argv)
    if args.merge_manifests:
        if not args.data_args_path:
            parser.error("--merge-manifests needs --data-args-path FILE (where the blend goes)")
        given = [flag for flag in ("input", "output_prefix", "tokenizer_model", "partition") if getattr(args, flag)]
        if given:
            parser.error(f"--merge-manifests reads manifests only; drop --{given[0].replace('_', '-')}")
        return MergeConfig(tuple(args.merge_manifests), args.data_args_path, args.subset_weights)
    missing = [flag for flag in ("input", "output_prefix", "tokenizer_model") if not getattr(args, flag)]
    if missing:
        parser.error(f"the following arguments are required: --{missing[0].replace('_', '-')}")
    if args.data_args_path or args.subset_weights:
        parser.error("--data-args-path and --subset-weights belong to --merge-manifests")
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.json_keys is not None and len(args.json_keys) != 1:
        parser.error(f"--json-keys takes one key here (every document is one field), got {args.json_keys}")
    if args.chunk_mb is not None and args.chunk_mb <= 0:
        parser.error("--chunk-mb must be positive")
    if args.max_document_bytes < 1:
        parser.error("--max-document-bytes must be at least 1")
    if not args.max_inflate_ratio >= 1:  # NaN too
        parser.error("--max-inflate-ratio must be a number >= 1")
    for flag in ("input_files_per_output", "max_tokens_per_file"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        partition = Partition.parse(args.partition) if args.partition else Partition.from_slurm(os.environ)
    except PartitionError as error:
        parser.error(str(error))
    return PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer_model=args.tokenizer_model,
        tokenizer_type=args.tokenizer_type,
        json_key=args.json_keys[0] if args.json_keys else args.json_key,
        append_eod=args.append_eod,
        processes=args.processes,
        strict=args.strict,
        keep_parts=args.keep_parts,
        chunk_bytes=None if args.chunk_mb is None else max(1, int(args.chunk_mb * 1e6)),
        partition=partition,
        input_files_per_output=args.input_files_per_output,
        max_tokens_per_file=args.max_tokens_per_file,
        max_document_bytes=args.max_document_bytes,
        max_inflate_ratio=args.max_inflate_ratio,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        if isinstance(config, MergeConfig):
            _print_merge(config, run_merge(config))
            return 0
        if config.partition is not None:
            print(f"partition {config.partition} (from {config.partition.source})", file=sys.stderr)
        summary = run_preprocess(config)
    except (NoInputMatchedError, StrictModeError, FileNotFoundError, ValueError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 1
    except BrokenProcessPool:
        print("preprocess_data: error: a tokenizing process died; rerun the same command to resume",
              file=sys.stderr)
        return 1
    bad = ", ".join(f"{kind}={count}" for kind, count in sorted(summary.bad_by_kind.items())) or "none"
    print(
        f"done: input_files={summary.input_files} chunks={summary.chunks} (reused {summary.reused_chunks}) "
        f"documents={summary.documents} tokens={summary.tokens} max_token_id={summary.max_token_id} "
        f"empty_documents={summary.empty_documents} bad_records={summary.bad_records} ({bad}) "
        f"seconds={summary.seconds:.2f} tokens/s={summary.tokens_per_second:.0f} MB/s={summary.megabytes_per_second:.2f}"
    )
    for subset, stats in sorted(summary.subsets.items()):
        print(f"subset {subset or '(all)'}: {stats.describe()}")
    if summary.manifest is None:
        print(f"wrote {config.dataset_prefix}.bin, .idx and .meta.json")
    else:
        count = config.partition.count if config.partition else 1
        print(f"wrote {len(summary.files)} file(s) ({summary.reused_groups} group(s) from an earlier run) and "
              f"{summary.manifest}; once all {count} partition(s) are done: python tools/preprocess_data.py "
              f"--merge-manifests '{config.output_prefix}_partition-*-of-{count:05d}.json' "
              f"--data-args-path {config.output_prefix}.data_args")
    return 0


def _print_merge(config: MergeConfig, summary: MergeSummary) -> None:
    total_weight = sum(entry.weight for entry in summary.entries)
    weight_of = {subset: summary.multipliers[subset] * stats.tokens for subset, stats in summary.subsets.items()}
    for subset, stats in sorted(summary.subsets.items()):
        print(f"subset {subset or '(all)'}: {stats.describe()} weight x{summary.multipliers[subset]:g} "
              f"share {100 * weight_of[subset] / total_weight:.2f}%")
    totals = SubsetStats()
    for stats in summary.subsets.values():
        totals.add(stats)
    print(f"merged {summary.partitions} partition(s): {totals.describe()}")
    print(f"wrote {config.data_args_path}: {len(summary.entries)} prefixes weighted by tokens x subset weight "
          f"(use it as --data-args-path)")


if __name__ == "__main__":
    sys.exit(main())
