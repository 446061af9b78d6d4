"""Corpus data preparation shared by `tokenizer/` and `tools/`: reading shards (`shards`), cutting them
into independently tokenizable chunks (`chunks`), and the metadata written beside a tokenized dataset
(`dataset_meta`)."""
