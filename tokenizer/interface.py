"""One tokenizer interface for preprocessing, training and the Hugging Face export.

`load_tokenizer(path)` takes what `--tokenizer-model` names: a SentencePiece `.model` file, a Hugging Face
`tokenizer.json`, or a folder holding one (a Llama-3 or Qwen tokenizer directory). The kind is read from
the file's content, not its name, so a tokenizer copied into a checkpoint under any name loads the same.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from tokenizer.hf_tokenizer import HuggingFaceTokenizer
from tokenizer.kinds import HUGGINGFACE, SENTENCEPIECE, TOKENIZER_TYPES
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
_FILE_IN_FOLDER = {HUGGINGFACE: "tokenizer.json", SENTENCEPIECE: "tokenizer.model"}


class Tokenizer(Protocol):
    """Encodes text without bos/eos; documents end with `eod_id`. Ids absent from a vocabulary are -1."""

    model_file: Path  # the one file that defines the tokenizer (hashed, copied into checkpoints)
    tokenizer_type: str

    def encode(self, text: str) -> list[int]: ...
    # [encode(text) for text in texts] in one call of the library's native batch encoder (SentencePiece on
    # a list, `tokenizers`' encode_batch_fast), one thread: preprocessing's parallelism is its processes.
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def id_to_piece(self, token_id: int) -> str: ...

    @property
    def vocab_size(self) -> int: ...
    @property
    def eod_id(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def unk_id(self) -> int: ...


def tokenizer_file(path: str | Path, tokenizer_type: str | None = None) -> Path:
    """The file that defines the tokenizer at `path` (for a folder: its tokenizer.json, or its
    tokenizer.model when asked for SentencePiece)."""
    path = Path(path)
    if path.is_dir():
        names = [_FILE_IN_FOLDER[tokenizer_type]] if tokenizer_type else [_FILE_IN_FOLDER[HUGGINGFACE]]
        for name in names:
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"tokenizer folder {path} holds no {' or '.join(names)}")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer model not found: {path}")
    return path


def detect_tokenizer_type(file: Path) -> str:
    """A tokenizer.json is a JSON object; a SentencePiece model is a binary protobuf."""
    with open(file, "rb") as handle:
        head = handle.read(64).lstrip()
    return HUGGINGFACE if head.startswith(b"{") else SENTENCEPIECE


def load_tokenizer(path: str | Path, tokenizer_type: str | None = None) -> Tokenizer:
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose from {', '.join(TOKENIZER_TYPES)}")
    file = tokenizer_file(path, tokenizer_type)
    detected = detect_tokenizer_type(file)
    if tokenizer_type is not None and tokenizer_type != detected:
        raise ValueError(f"{file} is a {detected} model, not a {tokenizer_type} (from --tokenizer-type)")
    try:
        return HuggingFaceTokenizer(file) if detected == HUGGINGFACE else SentencePieceTokenizer(file)
    except ValueError:  # ours: readable, but unfit (no end-of-document token), already one line
        raise
    except Exception as error:  # `tokenizers` raises a bare Exception, SentencePiece a RuntimeError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnreadableTokenizerError(f"tokenizer model {file} cannot be read as a {detected}: "
                                       f"{reason}") from None


class UnreadableTokenizerError(ValueError):
    """A tokenizer file that its library cannot parse (not a model, damaged, or the wrong kind)."""


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """Of the tokenizer's model file's bytes: what data made before tokenizer/identity.py records."""
    return hashlib.sha256(tokenizer.model_file.read_bytes()).hexdigest()
