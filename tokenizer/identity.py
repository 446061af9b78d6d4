"""A tokenizer's identity: the SHA-256 of what defines its behaviour, not of its file's bytes. A
SentencePiece model and the tokenizer.json exported from it (tokenizer/hf_export.py) are different files
of the same tokenizer: the data made with one trains with the other.

Both kinds are described in the form of a Hugging Face tokenizer.json, a SentencePiece BPE model as the
exporter rebuilds it (the same vocabulary and ids, merges ranked by its piece scores, byte fallback, its
whitespace handling), and the identity covers the parts that decide the ids of a text and the text of
the ids: the normalizer, the pre-tokenizer, the model (vocabulary, merges, byte fallback, unk), the
special (added) tokens and the decoder, with the end-of-document, bos, pad and unk ids the trainer uses.
Not the post-processor: training encodes without it. A SentencePiece model the exporter cannot rebuild
exactly (unigram, normalizing) is identified by its file's bytes."""
from __future__ import annotations

import hashlib
import json

from tokenizer.hf_export import build_hf_tokenizer
from tokenizer.interface import Tokenizer, tokenizer_sha256
from tokenizer.kinds import SENTENCEPIECE

BEHAVIOUR = ("normalizer", "pre_tokenizer", "model", "added_tokens", "decoder")


def _tokenizer_json(tokenizer: Tokenizer) -> dict | None:
    """The tokenizer as a tokenizer.json; None for a SentencePiece model with no exact rebuild."""
    if tokenizer.tokenizer_type != SENTENCEPIECE:
        return json.loads(tokenizer.model_file.read_text())
    try:
        return json.loads(build_hf_tokenizer(tokenizer.model_file).to_str())
    except ValueError:  # the exporter names what it cannot rebuild exactly
        return None


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    spec = _tokenizer_json(tokenizer)
    if spec is None:
        return tokenizer_sha256(tokenizer)
    behaviour = {key: spec.get(key) for key in BEHAVIOUR}
    behaviour["special_ids"] = [tokenizer.eod_id, tokenizer.bos_id, tokenizer.pad_id, tokenizer.unk_id]
    return hashlib.sha256(json.dumps(behaviour, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
