"""Corpus data preparation shared by `tokenizer/` and `tools/`: reading input files (`input_files`), cutting them
into independently tokenizable chunks (`chunks`), and the metadata written beside a tokenized dataset
(`dataset_meta`)."""
