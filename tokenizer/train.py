"""Train the project's SentencePiece tokenizer: BPE with byte fallback, lossless on any text.

python -m tokenizer.train --input <files/dirs/globs ...> --vocab-size N --output-prefix P
writes P.model and P.vocab. Inputs are a corpus's input files (the formats tools/preprocess_data.py reads)
or plain .txt files. Training reads at most --max-chars characters, spread evenly over the input
files, so that a tokenizer for a huge corpus still trains in minutes on a CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece

from dataprep.input_files import (
    INPUT_SUFFIXES,
    BadRecord,
    has_suffix,
    read_documents,
    resolve_inputs,
)
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

TEXT_SUFFIXES = (".txt",)

# Fixed ids keep every model of the project interchangeable in the data pipeline.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


@dataclass(frozen=True)
class TokenizerTrainingConfig:
    inputs: tuple[str, ...]
    output_prefix: Path
    vocab_size: int = 32000
    max_chars: int = 50_000_000
    json_key: str = "text"
    bos_piece: str = "<s>"
    eos_piece: str = "</s>"  # also the end-of-document token
    pad_piece: str = "<pad>"
    unk_piece: str = "<unk>"
    # Rare characters are left to byte fallback instead of spending vocabulary on them.
    character_coverage: float = 0.9995
    num_threads: int = os.cpu_count() or 1


def training_sentences(config: TokenizerTrainingConfig) -> Iterator[str]:
    """Non-empty lines of the inputs, at most `max_chars` in total, the same share from each file.

    Lines rather than whole documents: SentencePiece drops over-long sentences, and newlines are
    then byte-fallback tokens, which keeps the Hugging Face export exactly equivalent.
    """
    paths = resolve_inputs(config.inputs, INPUT_SUFFIXES + TEXT_SUFFIXES)
    budget_per_file = max(1, config.max_chars // len(paths))
    bad_records: list[BadRecord] = []
    for path in paths:
        budget = budget_per_file
        for text in _texts(path, config.json_key, bad_records.append):
            for line in text.splitlines():
                if line.strip():
                    yield line
                    budget -= len(line)
                    if budget <= 0:
                        break
            if budget <= 0:
                break
    if bad_records:
        print(f"tokenizer.train: skipped {len(bad_records)} bad records, first: {bad_records[0]}",
              file=sys.stderr)


def _texts(path: Path, json_key: str, on_bad) -> Iterator[str]:
    if has_suffix(path, TEXT_SUFFIXES):
        with open(path, encoding="utf-8", errors="replace") as text_file:
            yield from text_file
    else:
        for document in read_documents(path, json_key, on_bad):
            yield document.text


def train_tokenizer(config: TokenizerTrainingConfig) -> SentencePieceTokenizer:
    config.output_prefix.parent.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=training_sentences(config),
        model_prefix=str(config.output_prefix),
        model_type="bpe",
        vocab_size=config.vocab_size,
        byte_fallback=True,
        character_coverage=config.character_coverage,
        # Lossless: no Unicode normalization, whitespace kept as written (code, poetry, tables).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        unk_piece=config.unk_piece,
        bos_piece=config.bos_piece,
        eos_piece=config.eos_piece,
        pad_piece=config.pad_piece,
        num_threads=config.num_threads,
        minloglevel=1,
    )
    return SentencePieceTokenizer(f"{config.output_prefix}.model")


def parse_args(argv: Sequence[str] | None = None) -> TokenizerTrainingConfig:
    defaults = TokenizerTrainingConfig(inputs=(), output_prefix=Path())
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="input files (corpus formats or .txt), dirs or globs")
    parser.add_argument("--output-prefix", type=Path, required=True, help="writes PREFIX.model, PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--max-chars", type=int, default=defaults.max_chars,
                        help="characters of training text read at most (default %(default)s)")
    parser.add_argument("--json-key", default=defaults.json_key)
    parser.add_argument("--bos-piece", default=defaults.bos_piece)
    parser.add_argument("--eos-piece", default=defaults.eos_piece, help="also the end-of-document token")
    parser.add_argument("--pad-piece", default=defaults.pad_piece)
    parser.add_argument("--character-coverage", type=float, default=defaults.character_coverage)
    parser.add_argument("--num-threads", type=int, default=defaults.num_threads)
    args = parser.parse_args(argv)
    return TokenizerTrainingConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        vocab_size=args.vocab_size,
        max_chars=args.max_chars,
        json_key=args.json_key,
        bos_piece=args.bos_piece,
        eos_piece=args.eos_piece,
        pad_piece=args.pad_piece,
        character_coverage=args.character_coverage,
        num_threads=args.num_threads,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        tokenizer = train_tokenizer(config)
    except (ValueError, RuntimeError) as error:
        print(f"tokenizer.train: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {tokenizer.model_path} (vocab {tokenizer.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
