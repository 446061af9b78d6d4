"""Tokenizer: training on the sample corpus, the SentencePiece and Hugging Face `tokenizers` kinds behind one
interface, and the Hugging Face export of both."""
import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from dataprep.dataset_meta import DatasetMeta, write_dataset_meta
from dataprep.input_files import read_documents, resolve_inputs
from tokenizer.hf_export import export_hf_tokenizer
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import HUGGINGFACE, SENTENCEPIECE, load_tokenizer
from tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from tokenizer.train import TokenizerTrainingConfig, train_tokenizer, training_sentences
from trainer.config import DataConfig
from trainer.data import check_data
from muloco.core.errors import ConfigError

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
    paths = resolve_inputs([str(shakespeare / "valid")])
    documents = (doc.text for path in paths for doc in read_documents(path, "text", print))
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


def test_training_drops_lone_surrogates(tmp_path: Path, capsys):
    (tmp_path / "input.jsonl").write_bytes(b'{"text": "kept line"}\n{"text": "lone \\udc80 surrogate"}\n')
    config = TokenizerTrainingConfig(inputs=(str(tmp_path / "input.jsonl"),), output_prefix=tmp_path / "unused")
    assert list(training_sentences(config)) == ["kept line"]
    err = capsys.readouterr().err
    assert "skipped 1 bad records" in err and f"{tmp_path / 'input.jsonl'}:2: lone_surrogate" in err


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


# ---------------------------------------------------------------------------------------------
# Hugging Face `tokenizers` models behind the same interface.

HF_VOCAB_SIZE = 1024


@pytest.fixture(scope="session")
def hf_tokenizer_dir(shakespeare: Path, tmp_path_factory) -> Path:
    """A byte-level BPE trained offline with the `tokenizers` library, saved as a folder holding a
    tokenizer.json, the way a Llama-3 or Qwen tokenizer directory arrives (with a bos-adding post-processor)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=HF_VOCAB_SIZE, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sample_texts(shakespeare, 400), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id(specials[0]))])
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_hf_tokenizer_contract(hf_tokenizer_dir: Path):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    for path in (hf_tokenizer_dir, hf_tokenizer_dir / "tokenizer.json"):
        tokenizer = load_tokenizer(path, tokenizer_type=None if path.is_dir() else HUGGINGFACE)
        assert tokenizer.tokenizer_type == HUGGINGFACE and tokenizer.model_file == hf_tokenizer_dir / "tokenizer.json"
    assert tokenizer.vocab_size == HF_VOCAB_SIZE
    assert (tokenizer.bos_id, tokenizer.eod_id) == (0, 1) == (
        reference.token_to_id("<|begin_of_text|>"), reference.token_to_id("<|end_of_text|>"))
    text = "To be, or not to be"
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids  # no bos added
    assert tokenizer.encode_batch([text, "that is"]) == [tokenizer.encode(text), tokenizer.encode("that is")]
    for text in EDGE_CASES:  # byte-level BPE: lossless
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # A document quoting the end-of-text token is text, not a document end.
    assert tokenizer.eod_id not in tokenizer.encode("a page quoting <|end_of_text|> in its text")


def test_tokenizer_kind_is_read_from_the_file(sentencepiece_model: Path, hf_tokenizer_dir: Path, tmp_path: Path):
    copied = tmp_path / "tokenizer.model"  # a checkpoint copies any tokenizer under this name
    copied.write_bytes((hf_tokenizer_dir / "tokenizer.json").read_bytes())
    assert load_tokenizer(copied).tokenizer_type == HUGGINGFACE
    assert load_tokenizer(sentencepiece_model, SENTENCEPIECE).tokenizer_type == SENTENCEPIECE
    with pytest.raises(ValueError, match="is a SentencePieceTokenizer model, not a HuggingFaceTokenizer"):
        load_tokenizer(sentencepiece_model, HUGGINGFACE)
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        load_tokenizer(tmp_path / "empty_folder")
    without_eod = tmp_path / "no_eod.json"
    without_eod.write_text((hf_tokenizer_dir / "tokenizer.json").read_text().replace("<|end_of_text|>", "<|other|>"))
    with pytest.raises(ValueError, match="none of the end-of-document tokens"):
        load_tokenizer(without_eod)


def test_hf_export_of_a_tokenizer_json_matches_training_ids(hf_tokenizer_dir: Path, shakespeare: Path, tmp_path: Path,
                                                            monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(hf_tokenizer_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(export_hf_tokenizer(hf_tokenizer_dir, tmp_path / "hf"))
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (tokenizer.bos_id, tokenizer.eod_id)
    for text in sample_texts(shakespeare, 20) + EDGE_CASES + ["quoting <|end_of_text|> here"]:
        assert hf_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text), text[:80]


def test_a_sentencepiece_model_and_its_exported_tokenizer_json_are_one_tokenizer(
        sentencepiece_model: Path, hf_tokenizer_dir: Path, shakespeare: Path, tmp_path: Path):
    """Data made with one trains with the other (the Hugging Face round trip); a tokenizer that encodes
    differently is still refused with the data check's line."""
    exported = export_hf_tokenizer(sentencepiece_model, tmp_path / "hf")
    spm, hf = load_tokenizer(sentencepiece_model), load_tokenizer(exported)
    assert tokenizer_identity(spm) == tokenizer_identity(hf)
    other = train_tokenizer(TokenizerTrainingConfig(inputs=(str(shakespeare / "train"),), output_prefix=tmp_path / "other",
                                                    vocab_size=VOCAB_SIZE, max_chars=200_000, num_threads=1)).model_path
    assert tokenizer_identity(load_tokenizer(other)) != tokenizer_identity(spm)  # same size, other merges
    assert tokenizer_identity(load_tokenizer(hf_tokenizer_dir)) != tokenizer_identity(spm)

    # One changed merge rank in the exported tokenizer.json: the same vocabulary, another tokenizer.
    swapped = json.loads((exported / "tokenizer.json").read_text())
    merges = swapped["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]
    (tmp_path / "swapped").mkdir()
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(swapped))
    assert tokenizer_identity(load_tokenizer(tmp_path / "swapped")) != tokenizer_identity(spm)

    prefix = tmp_path / "data_text_document"
    ids = spm.encode("Shall I compare thee") + [spm.eod_id]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    write_dataset_meta(prefix, DatasetMeta(max(ids), spm.vocab_size, tokenizer_identity(spm), 1, len(ids)))
    check_data(DataConfig(data_path=[str(prefix)], tokenizer_model=str(exported)))
    with pytest.raises(ConfigError, match=rf"^{prefix}.meta.json: the data was tokenized with a tokenizer whose "
                                          rf"SHA-256 is {tokenizer_identity(spm)}, but --tokenizer-model {other} has"):
        check_data(DataConfig(data_path=[str(prefix)], tokenizer_model=str(other)))
