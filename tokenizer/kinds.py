"""The tokenizer kinds, named as Megatron's `--tokenizer-type` names them."""

SENTENCEPIECE = "SentencePieceTokenizer"
HUGGINGFACE = "HuggingFaceTokenizer"
TOKENIZER_TYPES = (SENTENCEPIECE, HUGGINGFACE)
