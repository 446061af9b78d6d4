"""A Hugging Face `tokenizers` tokenizer (a tokenizer.json: Llama-3, Qwen, or one trained with `tokenizers`)
behind the project's tokenizer interface."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from tokenizer.kinds import HUGGINGFACE

# tokenizer.json names no end-of-document token; these are the ones models use, in order of preference.
# The choice depends on the tokenizer.json alone, so the copy inside a checkpoint resolves the same.
EOD_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|end|>")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]")


class HuggingFaceTokenizer:
    """Encodes without the post-processor's bos/eos. Special-token strings inside text are encoded as
    text: a web page that quotes "<|endoftext|>" must not end its document there."""

    tokenizer_type = HUGGINGFACE

    def __init__(self, model_file: str | Path):
        self.model_file = Path(model_file)
        self._tokenizer = Tokenizer.from_file(str(self.model_file))
        self._tokenizer.encode_special_tokens = True
        self._eod = self._first_present(EOD_TOKENS)
        if self._eod < 0:
            raise ValueError(f"{self.model_file} has none of the end-of-document tokens {', '.join(EOD_TOKENS)}")

    def _first_present(self, tokens: tuple[str, ...]) -> int:
        for token in tokens:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        return -1

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The fast variant skips the offsets, which nothing here reads; the ids are the same.
        return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        return self._eod

    @property
    def bos_id(self) -> int:
        return self._first_present(BOS_TOKENS)

    @property
    def pad_id(self) -> int:
        return self._first_present(PAD_TOKENS)

    @property
    def unk_id(self) -> int:
        unk = getattr(self._tokenizer.model, "unk_token", None)
        token_id = self._tokenizer.token_to_id(unk) if unk else None
        return -1 if token_id is None else token_id
