"""Tokenizer: training on the sample corpus, the wrapper's contract, and the Hugging Face export."""
from itertools import islice
from pathlib import Path

import pytest

from tokenizer.hf_export import export_hf_tokenizer
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tokenizer.train import TokenizerTrainingConfig, train_tokenizer, training_sentences
from tools.shard_reader import read_documents, resolve_inputs

VOCAB_SIZE = 4096

# Text that exercises byte fallback, newlines, runs of spaces and tabs, and special-token look-alikes.
EDGE_CASES = [
    "",
    " ",
    "a",
    " leading space",
    "trailing spaces   ",
    "two  spaces, three   spaces,\ttab\t\ttabs",
    "lines\nand\n\nblank lines\r\n",
    "emoji 😀, math ∀x∈ℝ, CJK 日本語, accents naïve façade, combining e\u0301",
    "zero width\u200bspace and BOM \ufeff",
    "control \x00\x07 bytes",
    "looks special: <s> </s> <pad> <unk> <0x41>",
    "digits 1234567890 and 3.14159",
]


@pytest.fixture(scope="session")
def sentencepiece_model(shakespeare: Path, tmp_path_factory) -> Path:
    """A small tokenizer trained once per session on the sample corpus (also used by test_preprocess)."""
    prefix = tmp_path_factory.mktemp("tokenizer") / "shakespeare"
    config = TokenizerTrainingConfig(
        inputs=(str(shakespeare / "train"),), output_prefix=prefix, vocab_size=VOCAB_SIZE,
        max_chars=1_000_000, num_threads=2,
    )
    return train_tokenizer(config).model_path


def sample_texts(shakespeare: Path, count: int) -> list[str]:
    shards = resolve_inputs([str(shakespeare / "valid")])
    documents = (doc.text for shard in shards for doc in read_documents(shard, "text", print))
    return list(islice(documents, count))


def test_trained_tokenizer_contract(sentencepiece_model: Path):
    assert sentencepiece_model.with_suffix(".vocab").is_file()
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert (tokenizer.bos_id, tokenizer.eod_id, tokenizer.pad_id) == (1, 2, 3)
    ids = tokenizer.encode("To be, or not to be")
    assert ids and tokenizer.bos_id not in ids and tokenizer.eod_id not in ids
    for text in EDGE_CASES:  # lossless: identity normalization, whitespace kept, byte fallback
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_training_reads_an_even_share_of_every_file(shakespeare: Path, tmp_path: Path):
    (tmp_path / "notes.txt").write_text("first line\n\nsecond line\n")
    config = TokenizerTrainingConfig(
        inputs=(str(shakespeare / "train"), str(tmp_path / "*.txt")), output_prefix=tmp_path / "unused",
        max_chars=9000,
    )
    sentences = list(training_sentences(config))
    assert {"first line", "second line"} <= set(sentences)
    assert all(sentence.strip() for sentence in sentences)
    # 9 files, 1000 characters each, a file stops at the line that crosses its share
    assert 8 * 1000 < sum(map(len, sentences)) < 9000 + 8 * max(map(len, sentences))


def test_hf_export_loads_offline_and_matches_sentencepiece(
    sentencepiece_model: Path, shakespeare: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    out_dir = export_hf_tokenizer(sentencepiece_model, tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        tokenizer.bos_id, tokenizer.eod_id, tokenizer.pad_id,
    )
    assert len(hf_tokenizer) == tokenizer.vocab_size
    for text in sample_texts(shakespeare, 20) + EDGE_CASES:
        ids = tokenizer.encode(text)
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids, text[:80]
        assert hf_tokenizer.decode(ids) == text
