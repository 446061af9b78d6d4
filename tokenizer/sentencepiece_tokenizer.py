"""The project's own tokenizer kind: a thin, typed wrapper over a SentencePiece model file."""
from __future__ import annotations

from pathlib import Path

import sentencepiece

from tokenizer.kinds import SENTENCEPIECE


class SentencePieceTokenizer:
    """Encodes text to ids without adding bos/eos; documents end with `eod_id` (the eos piece)."""

    tokenizer_type = SENTENCEPIECE

    def __init__(self, model_path: str | Path):
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {self.model_path}")
        # One thread per batch: parallelism comes from preprocessing's --processes.
        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(self.model_path), num_threads=1)
        if self._processor.eos_id() < 0:
            raise ValueError(f"{self.model_path} has no eos piece, which the data needs as end-of-document")

    @property
    def model_file(self) -> Path:
        return self.model_path

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Same as `encode` per text; SentencePiece's batch call saves Python overhead."""
        return self._processor.encode(texts, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self._processor.decode(list(ids))

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(token_id)

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eod_id(self) -> int:
        return self._processor.eos_id()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    @property
    def pad_id(self) -> int:
        return self._processor.pad_id()

    @property
    def unk_id(self) -> int:
        return self._processor.unk_id()
