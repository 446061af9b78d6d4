"""The preprocessing run behind tools/preprocess_data.py, in the parts that need a tokenizer (dataprep/, below the
tokenizer package, holds the rest): its settings (`config`), the tokenizing processes (`tokenize_worker`), handing
chunks to them and publishing their parts (`dispatch`), and the run that plans, resumes and writes (`run`)."""
