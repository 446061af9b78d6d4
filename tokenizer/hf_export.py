"""Export the training tokenizer for Hugging Face `transformers` (a fast tokenizer).

python -m tokenizer.hf_export --tokenizer-model M --output DIR

A Hugging Face tokenizer.json is shipped as it is, with the special tokens the training used. A SentencePiece
BPE model is rebuilt as a `tokenizers` BPE model: same vocabulary and ids, merges
ranked by SentencePiece's piece scores (SentencePiece merges the adjacent pair whose result scores
highest; `tokenizers` merges the pair of lowest rank, so the two orders coincide), byte fallback,
and the same whitespace handling (spaces become "▁", one "▁" is prepended). Control pieces
(bos/eos/pad) are special tokens. Either way the tokenizer is saved with `split_special_tokens=True` so
that a literal "</s>" in text is tokenized as characters, exactly as the training data was.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

from tokenizer.interface import SENTENCEPIECE, load_tokenizer

SPACE = "▁"  # SentencePiece's visible space (U+2581)


def _load_proto(model_path: Path) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    return proto


def _check_supported(proto: sentencepiece_model_pb2.ModelProto, model_path: Path) -> None:
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        problems.append("model type is not BPE")
    if not trainer.byte_fallback:
        problems.append("byte_fallback is off")
    if normalizer.name != "identity" or normalizer.remove_extra_whitespaces:
        problems.append("it normalizes text (train with normalization 'identity', remove_extra_whitespaces off)")
    if trainer.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix is on")
    if problems:
        raise ValueError(f"cannot export {model_path} exactly: " + "; ".join(problems))


def _bpe_merges(proto: sentencepiece_model_pb2.ModelProto) -> list[tuple[str, str]]:
    """Every split of every normal piece into two vocabulary pieces, best-scoring pieces first."""
    Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
    mergeable = {p.piece for p in proto.pieces if p.type in (Piece.NORMAL, Piece.USER_DEFINED)}
    ranked = sorted(
        ((-p.score, index, p.piece) for index, p in enumerate(proto.pieces) if p.type == Piece.NORMAL),
    )
    merges = []
    for _, _, piece in ranked:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((left, right))
    return merges


def build_hf_tokenizer(model_path: str | Path) -> Tokenizer:
    model_path = Path(model_path)
    proto = _load_proto(model_path)
    _check_supported(proto, model_path)
    vocab = {p.piece: index for index, p in enumerate(proto.pieces)}
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=_bpe_merges(proto), unk_token=proto.trainer_spec.unk_piece,
            byte_fallback=True, fuse_unk=True)
    )
    dummy_prefix = [normalizers.Prepend(SPACE)] if proto.normalizer_spec.add_dummy_prefix else []
    tokenizer.normalizer = normalizers.Sequence(dummy_prefix + [normalizers.Replace(" ", SPACE)])
    strip_dummy_prefix = [decoders.Strip(" ", 1, 0)] if proto.normalizer_spec.add_dummy_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()] + strip_dummy_prefix
    )
    Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
    tokenizer.add_special_tokens(
        [AddedToken(p.piece, special=True, normalized=False)
         for p in proto.pieces if p.type in (Piece.CONTROL, Piece.UNKNOWN)]
    )
    return tokenizer


def export_hf_tokenizer(model_path: str | Path, out_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json (and special tokens) loadable by AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = load_tokenizer(model_path)
    if tokenizer.tokenizer_type == SENTENCEPIECE:
        fast = build_hf_tokenizer(tokenizer.model_file)
    else:
        fast = Tokenizer.from_file(str(tokenizer.model_file))

    def piece_or_none(token_id: int) -> str | None:
        return tokenizer.id_to_piece(token_id) if token_id >= 0 else None

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=fast,
        bos_token=piece_or_none(tokenizer.bos_id),
        eos_token=piece_or_none(tokenizer.eod_id),
        pad_token=piece_or_none(tokenizer.pad_id),
        unk_token=piece_or_none(tokenizer.unk_id),
        split_special_tokens=True,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    hf_tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-model", type=Path, required=True, help="SentencePiece .model, tokenizer.json, or a folder holding one")
    parser.add_argument("--output", type=Path, required=True, help="directory to write")
    args = parser.parse_args(argv)
    try:
        out_dir = export_hf_tokenizer(args.tokenizer_model, args.output)
    except (ValueError, FileNotFoundError) as error:
        print(f"tokenizer.hf_export: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote Hugging Face tokenizer to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
