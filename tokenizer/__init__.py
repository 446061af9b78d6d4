"""Tokenizers: training the project's SentencePiece model (`train`), one interface over SentencePiece and
Hugging Face `tokenizers` (`interface.load_tokenizer`), and the Hugging Face export (`hf_export`)."""
